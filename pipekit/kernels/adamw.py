"""Fused AdamW over flat runs of parameters, with the gradient unscale and the fp16
overflow check folded into the passes over memory.

    unscale_and_check_(grad, inv_scale, found_inf, in_place=True)
        pass 1: found_inf = 1 where some grad * inv_scale is not finite; grad *= inv_scale
        when in_place (else grad is only read), as torch._amp_foreach_non_finite_check_and_unscale_
    adamw_step_(param, grad, exp_avg, exp_avg_sq, step=, lr=, beta1=, beta2=, eps=, weight_decay=,
                maximize=False, grad_scale=1.0, found_inf=None)
        pass 2: one AdamW step of a flat run with g = grad * grad_scale (a float, or a 0-dim
        tensor on the device: a clipping coefficient), nothing written where found_inf is set
    FusedAdamW(params, lr, betas, eps, weight_decay, maximize=False)
        a torch.optim.Optimizer that steps runs of contiguous parameters with one call each

The update is torch.optim.AdamW's (decoupled weight decay, no amsgrad), term for term:
    param *= 1 - lr * wd;  exp_avg.lerp_(g, 1 - beta1);  exp_avg_sq = exp_avg_sq * beta2 + (1 - beta2) * g * g
    param += -lr / (1 - beta1**step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps)
with the bias corrections computed on the host in double precision from the step count (as
torch's default, non-capturable AdamW does). The reference (`adamw_step_reference`) is those
torch ops on the flat run, so float64 (always the reference) is bitwise torch's AdamW. The
Triton program does the same in float32 registers (IEEE sqrt and division), one program per
block of BLOCK elements; a run's parameters may be fp32/fp16/bf16, the moments have its dtype.

Skipping without a host sync: with `found_inf` (a 0-dim float32 device tensor, nonzero: skip)
every program loads the flag first and masks its loads and stores with it, so an overflowed
step writes nothing and no launch waits for the host. The step counts live on the host (as
torch's default AdamW's: the bias corrections are host doubles), so FusedAdamW.step reads the
flag once, after every run is queued, and takes back the steps it counted when it was set.
The reference reads the flag first (a host sync on CUDA; it runs in float64 or on the CPU,
where there is none to save).

Why two passes under a loss scaler (ZeroOptimizer with fused AdamW, pipekit/optim/zero.py):
the overflow must be known on every rank before any rank updates anything, and the clipping
coefficient is a function of the norm of the unscaled gradients, so one pass cannot both
decide and update. Pass 1 (`unscale_and_check_`) sets the flag, which is then all-reduced;
the norm and the clipping coefficient stay on the device; pass 2 (`adamw_step_`) multiplies
each gradient by its scale as it loads it and skips on the device where the flag is set.
Without clipping, pass 1 only reads (the unscale rides in pass 2's load); with clipping it
unscales in place (the norm needs the unscaled values) and pass 2 multiplies by the
coefficient, which saves the separate clipping pass. Each gradient goes through the same
float multiplications as in the unfused optimizer, so the results do not change. The host
reads the flag only once every update is queued (FusedAdamW for its step counts, then
ZeroOptimizer for the loss scaler and `last_step_skipped`, finding it ready).

FusedAdamW's state looks like torch.optim.AdamW's, per parameter: "step" (a 0-dim CPU
tensor, float32 or float64 as torch's), "exp_avg" and "exp_avg_sq" (the parameter's shape
and dtype), so `state_dict()`s and ZeroOptimizer.param_state checkpoints move between the two. They are
views into one flat buffer per param group, so that parameters that lie back to back in
memory (ZeroOptimizer's pieces of one master shard), have their gradients back to back too
and the same step count make one run, stepped by one `adamw_step_` call: one kernel launch
per bucket, typically. A parameter whose grad is None is skipped and its step does not
advance, as in torch. State written from outside (`load_state_dict`, ZeroOptimizer's
load_param_state) is copied into the flat buffers at the next step.
Limits: dense, contiguous, real parameters; amsgrad is refused (torch.optim.AdamW has it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from .dispatch import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the references need no triton
    triton = None

BLOCK = 4096  # elements per program (memory-bound; large blocks keep the interpreter's program count low)
_WARPS = 8
CHUNK = 1 << 16  # elements per pass of the reference (cache-sized on a CPU)
_KEYS = ("step", "exp_avg", "exp_avg_sq")


# ---------------------------------------------------------------------------------------------
# References: torch ops on the flat run.


def unscale_and_check_reference(grad: torch.Tensor, inv_scale: float, found_inf: torch.Tensor | None,
                                in_place: bool = True) -> None:
    """`unscale_and_check_` in torch ops."""
    unscaled = grad.mul_(inv_scale) if in_place else grad * inv_scale
    if found_inf is not None:
        found_inf.masked_fill_(~torch.isfinite(unscaled).all(), 1.0)


def adamw_step_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                         *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                         maximize: bool = False, grad_scale: float | torch.Tensor = 1.0,
                         found_inf: torch.Tensor | None = None) -> None:
    """`adamw_step_` in torch ops: torch.optim.AdamW's single-tensor update, bitwise, on the
    run (it reads `found_inf` on the host). Contiguous runs go in cache-sized chunks (CHUNK
    elements: each op then finds the last one's output in cache, as torch's optimizers do over
    ZeroOptimizer's 64k-element pieces: one pass per op over a whole 4M-element run measured ~2x slower)."""
    if found_inf is not None and found_inf.item():
        return
    tensors = [param, grad, exp_avg, exp_avg_sq]
    hyper = (step, lr, beta1, beta2, eps, weight_decay, maximize, grad_scale)
    if not all(t.is_contiguous() for t in tensors):
        return _adamw_reference(tensors, *hyper)
    flat = [t.view(-1) for t in tensors]
    for lo in range(0, param.numel(), CHUNK):
        _adamw_reference([t[lo:lo + CHUNK] for t in flat], *hyper)
    return None


def _adamw_reference(tensors: list[torch.Tensor], step: int, lr: float, beta1: float, beta2: float, eps: float,
                     weight_decay: float, maximize: bool, grad_scale: float | torch.Tensor) -> None:
    param, grad, exp_avg, exp_avg_sq = tensors
    g = grad if isinstance(grad_scale, float) and grad_scale == 1.0 else grad * grad_scale
    if maximize:
        g = -g
    if weight_decay != 0:
        param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size, bias_correction2_sqrt = _bias_corrected(step, lr, beta1, beta2)
    denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def _bias_corrected(step: int, lr: float, beta1: float, beta2: float) -> tuple[float, float]:
    """(lr / (1 - beta1**step), sqrt(1 - beta2**step)), in double precision as torch computes them."""
    return lr / (1 - beta1 ** step), (1 - beta2 ** step) ** 0.5


# ---------------------------------------------------------------------------------------------
# Public functions: the dispatch rule, then the Triton program or the reference.


def unscale_and_check_(grad: torch.Tensor, inv_scale: float, found_inf: torch.Tensor | None,
                       in_place: bool = True) -> None:
    """Set `found_inf` (0-dim float32, on grad's device) to 1 when some `grad * inv_scale`
    is inf or NaN (None: no check), and multiply the contiguous `grad` by `inv_scale` in
    place when `in_place` (else only read it). Triton or the reference by `use_triton`."""
    tensors = (grad,) if found_inf is None else (grad, found_inf)
    if not use_triton(*tensors) or not grad.numel():
        return unscale_and_check_reference(grad, inv_scale, found_inf, in_place)
    _contiguous(grad)
    flag = found_inf if found_inf is not None else grad
    _unscale_check[(triton.cdiv(grad.numel(), BLOCK),)](grad, flag, grad.numel(), inv_scale, IN_PLACE=in_place,
                                                        HAS_FLAG=found_inf is not None, BLOCK=BLOCK,
                                                        num_warps=_WARPS)
    return None


def adamw_step_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                maximize: bool = False, grad_scale: float | torch.Tensor = 1.0,
                found_inf: torch.Tensor | None = None) -> None:
    """One AdamW step, in place, of the contiguous `param` with its `grad` and moments (all
    the same number of elements; `step`: the step count after this step, >= 1). The
    gradient used is `grad * grad_scale` (a float, or a 0-dim tensor on the device); where
    the 0-dim `found_inf` is nonzero nothing is written. Triton or the reference by
    `use_triton` (module docstring)."""
    tensors = [param, grad, exp_avg, exp_avg_sq] + [t for t in (grad_scale, found_inf) if isinstance(t, torch.Tensor)]
    if not use_triton(*tensors) or not param.numel():
        return adamw_step_reference(param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
                                    eps=eps, weight_decay=weight_decay, maximize=maximize, grad_scale=grad_scale,
                                    found_inf=found_inf)
    for t in (param, grad, exp_avg, exp_avg_sq):
        _contiguous(t)
        if t.numel() != param.numel():
            raise ValueError(f"adamw_step_ takes equal-sized flat runs, got {t.numel()} and {param.numel()} elements")
    step_size, bias_correction2_sqrt = _bias_corrected(step, lr, beta1, beta2)
    scale_ptr = grad_scale if isinstance(grad_scale, torch.Tensor) else param
    flag = found_inf if found_inf is not None else param
    _adamw[(triton.cdiv(param.numel(), BLOCK),)](
        param, grad, exp_avg, exp_avg_sq, scale_ptr, flag, param.numel(),
        float(grad_scale) if not isinstance(grad_scale, torch.Tensor) else 1.0,
        1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, bias_correction2_sqrt, eps, -step_size,
        SCALE_PTR=isinstance(grad_scale, torch.Tensor), HAS_FLAG=found_inf is not None, MAXIMIZE=maximize,
        BLOCK=BLOCK, num_warps=_WARPS)
    return None


def _contiguous(t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"the fused AdamW kernels take contiguous tensors, got strides {t.stride()}")


# ---------------------------------------------------------------------------------------------
# Triton programs.

if triton is not None:

    @triton.jit
    def _unscale_check(G, FOUND_INF, n, inv_scale, IN_PLACE: tl.constexpr, HAS_FLAG: tl.constexpr,
                       BLOCK: tl.constexpr):
        """Elements [pid * BLOCK, +BLOCK) of G: G *= inv_scale (IN_PLACE); FOUND_INF = 1 where one is not finite."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32) * inv_scale
        if IN_PLACE:
            tl.store(G + offs, g.to(G.dtype.element_ty), mask=mask)
        if HAS_FLAG:
            bad = tl.max((~(tl.abs(g) <= 3.4028234663852886e38)).to(tl.int32), axis=0)  # inf, and NaN (compares false)
            tl.store(FOUND_INF, 1.0, mask=bad > 0)  # every program that finds one writes the same 1

    @triton.jit
    def _adamw(P, G, M, V, SCALE, FOUND_INF, n, grad_scale, decay, w1, beta2, w2, bc2_sqrt, eps, neg_step_size,
               SCALE_PTR: tl.constexpr, HAS_FLAG: tl.constexpr, MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr):
        """One AdamW step of elements [pid * BLOCK, +BLOCK), torch's ops in its order (module docstring)."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if HAS_FLAG:  # an overflow anywhere: no element is in range, nothing read, nothing written
            n = n * (tl.load(FOUND_INF) == 0).to(tl.int64)
        mask = offs < n
        g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
        if SCALE_PTR:
            g = g * tl.load(SCALE).to(tl.float32)
        else:
            g = g * grad_scale
        if MAXIMIZE:
            g = -g
        p = tl.load(P + offs, mask=mask, other=0.0).to(tl.float32) * decay
        m = tl.load(M + offs, mask=mask, other=0.0).to(tl.float32)
        v = tl.load(V + offs, mask=mask, other=0.0).to(tl.float32)
        m = tl.where(w1 < 0.5, m + w1 * (g - m), g - (g - m) * (1 - w1))  # torch's lerp
        v = v * beta2 + w2 * g * g
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p + neg_step_size * tl.div_rn(m, denom)
        tl.store(P + offs, p.to(P.dtype.element_ty), mask=mask)
        tl.store(M + offs, m.to(M.dtype.element_ty), mask=mask)
        tl.store(V + offs, v.to(V.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# The optimizer.


@dataclass(eq=False)
class _FlatState:
    """One param group's moments as two flat buffers, and its step counts as one CPU buffer
    (float32, or float64 under a float64 default dtype: torch's AdamW's); `views[i]`:
    parameter i's entries as torch's AdamW holds them."""

    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    steps: torch.Tensor
    starts: list[int]  # parameter i's first element in the flat buffers
    views: list[dict[str, torch.Tensor]] = field(default_factory=list)


class FusedAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update and state, stepped one run of contiguous parameters per
    kernel launch (module docstring). `step(found_inf=, grad_scales=)`: skip on the device
    where the 0-dim flag is set (the step counts are corrected after one host read, once
    every run is queued); multiply each group's gradients by its entry of `grad_scales`
    (floats or 0-dim device tensors) as they are loaded. Hyperparameters are read from the
    param groups at every step (LR schedulers set "lr")."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, *, amsgrad: bool = False, maximize: bool = False):
        self._flat: list[_FlatState] = []
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "amsgrad": amsgrad, "maximize": maximize})

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        _refuse_amsgrad(group)
        like = group["params"][0] if group["params"] else torch.empty(0)
        for p in group["params"]:
            if p.is_complex() or p.is_sparse or not p.is_contiguous():
                raise ValueError(f"FusedAdamW steps dense, contiguous, real parameters; got one of shape "
                                 f"{tuple(p.shape)}, dtype {p.dtype}, strides {p.stride()}; use torch.optim.AdamW")
            if (p.dtype, p.device) != (like.dtype, like.device):
                raise ValueError(f"FusedAdamW keeps one flat state per param group: its parameters need one dtype "
                                 f"and device, got {like.dtype} on {like.device} and {p.dtype} on {p.device}")
        starts, total = [], 0
        for p in group["params"]:
            starts.append(total)
            total += p.numel()
        step_dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # torch's
        flat = _FlatState(torch.zeros(total, dtype=like.dtype, device=like.device),
                          torch.zeros(total, dtype=like.dtype, device=like.device),
                          torch.zeros(len(starts), dtype=step_dtype), starts)
        for i, (p, start) in enumerate(zip(group["params"], starts)):
            flat.views.append({"step": flat.steps[i], "exp_avg": flat.exp_avg[start:start + p.numel()].view_as(p),
                               "exp_avg_sq": flat.exp_avg_sq[start:start + p.numel()].view_as(p)})
        self._flat.append(flat)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None, *, found_inf: torch.Tensor | None = None,
             grad_scales: list[float | torch.Tensor] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stepped: list[tuple[_FlatState, list[int]]] = []
        for gi, (group, flat) in enumerate(zip(self.param_groups, self._flat)):
            _refuse_amsgrad(group)
            params = group["params"]
            live = [i for i, p in enumerate(params) if p.grad is not None]
            for i, p in enumerate(params):
                if p.grad is not None or p in self.state:
                    self._adopt(p, flat, i)
            if not live:
                continue
            flat.steps[live] += 1
            stepped.append((flat, live))
            beta1, beta2 = group["betas"]
            hyper = {"lr": group["lr"], "beta1": beta1, "beta2": beta2, "eps": group["eps"],
                     "weight_decay": group["weight_decay"], "maximize": group["maximize"],
                     "grad_scale": 1.0 if grad_scales is None else grad_scales[gi], "found_inf": found_inf}
            steps = flat.steps.tolist()
            for i, j in _runs(params, live, steps):
                a = flat.starts[i]
                n = flat.starts[j - 1] + params[j - 1].numel() - a
                adamw_step_(_span(params[i], n), _span(_grad(params[i]), n), flat.exp_avg[a:a + n],
                            flat.exp_avg_sq[a:a + n], step=int(steps[i]), **hyper)
        if found_inf is not None and stepped and found_inf.item():  # read once every run is queued
            for flat, live in stepped:
                flat.steps[live] -= 1
        return loss

    def _adopt(self, p: torch.Tensor, flat: _FlatState, i: int) -> None:
        """Make p's state the views of the flat buffers, copying in what was put there from
        outside (a loaded state dict); a parameter stepping first starts at zero."""
        state, views = self.state[p], flat.views[i]
        for key in _KEYS:
            given = state.get(key)
            if given is views[key]:
                continue
            if given is None:
                views[key].zero_()
            else:
                views[key].copy_(torch.as_tensor(given))  # (an old state dict's step may be a float)
            state[key] = views[key]


def _refuse_amsgrad(group: dict[str, Any]) -> None:
    if group.get("amsgrad"):
        raise ValueError("FusedAdamW has no amsgrad (amsgrad=True); use torch.optim.AdamW(amsgrad=True), or "
                         "ZeroOptimizer(..., fused=False)")


def _runs(params: list[torch.Tensor], live: list[int], steps: list[float]) -> list[tuple[int, int]]:
    """[i, j) spans of consecutive parameters with a gradient and the same step count, each
    parameter (and its gradient) contiguous and starting where the previous one ends, within
    the first one's storage: each span is one flat run for one kernel launch. Pointer
    arithmetic on the host (no storage object per parameter: ZeroOptimizer has thousands)."""
    runs: list[tuple[int, int]] = []
    end_p = end_g = -1  # where the run's parameters and gradients end, in bytes
    for k in live:
        p, g = params[k], _grad(params[k])
        ptr_p, ptr_g, nbytes = p.data_ptr(), g.data_ptr(), p.numel() * p.element_size()
        if (runs and runs[-1][1] == k and steps[k] == steps[k - 1] and ptr_p == end_p and ptr_g == end_g
                and g.is_contiguous()):
            runs[-1] = (runs[-1][0], k + 1)
        else:
            runs.append((k, k + 1))
        end_p, end_g = ptr_p + nbytes, ptr_g + nbytes
        if not g.is_contiguous():
            end_g = -1
    return [piece for i, j in runs for piece in _within_storage(params, i, j)]


def _within_storage(params: list[torch.Tensor], i: int, j: int) -> list[tuple[int, int]]:
    """[i, j), or each parameter alone where the run would leave its first parameter's or first
    gradient's storage (adjacent allocations are not one tensor)."""
    if j - i == 1:
        return [(i, j)]
    first, last = params[i], params[j - 1]
    for a, b in ((first, last), (_grad(first), _grad(last))):
        storage = a.untyped_storage()
        if b.data_ptr() + b.numel() * b.element_size() > storage.data_ptr() + storage.nbytes():
            return [(k, k + 1) for k in range(i, j)]
    return [(i, j)]


def _grad(p: torch.Tensor) -> torch.Tensor:
    assert p.grad is not None  # a parameter of a run
    return p.grad


def _span(t: torch.Tensor, n: int) -> torch.Tensor:
    """The flat run of n elements of t's storage starting where t does (t itself, flat, when n
    is its size: a lone non-contiguous gradient is copied, it is only read)."""
    if n == t.numel():
        return t.reshape(-1)
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), (n,), (1,))
