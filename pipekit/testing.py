"""Test helpers: N spawned gloo processes inside pytest, and the one-process oracle.

`run_distributed(fn, world_size, *args)` (from `pipekit.spawn`, where the
planner finds it too) runs `fn` on `world_size` gloo ranks and returns each
rank's result; see that module for its `init` modes and timeouts.

`reference_model(specs, seed)` builds a whole spec list as one plain
`nn.Sequential` without tensor parallelism — what every layout is compared
against — and `reference_name` maps PipelineModule names onto it.
`Reference` is that model trained beside a layout: the one-process half of every
parity test (the whole batch, the same optimizer, the same clipping) and the
worst difference seen so far of each thing compared. `in_float64` runs a
(worker) function under float64, as the parity suites do.

`HostReads` counts the host's reads of tensor values (`.item()`, `.tolist()`,
`bool(t)`, ...: on a GPU each waits for the device), by pipekit call site:
tests/test_host_sync.py and benchmarks/moe_dispatch.py use it.
"""

from __future__ import annotations

import collections
import functools
import math
import traceback
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from .layers.parallel import FakeGroup  # tests have always found it here
from .spawn import INITS, run_distributed
from .spec import LayerSpec, TiedLayerSpec, tied_first_index

__all__ = ["INITS", "FakeGroup", "HostReads", "Reference", "in_float64", "reference_model", "reference_name",
           "reference_slice", "run_distributed"]


class _Tied(nn.Module):
    def __init__(self, module: nn.Module, forward_fn):
        super().__init__()
        self.module, self.forward_fn = module, forward_fn

    def forward(self, x):
        return self.forward_fn(self.module, x) if self.forward_fn else self.module(x)


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def reference_model(specs: list, seed: int, device: str | torch.device | None = None) -> nn.Sequential:
    """The whole spec list as one nn.Sequential (no tensor parallelism), tied layers sharing one
    module, each layer built on `device` (None: the CPU)."""
    tied: dict[str, nn.Module] = {}
    mods: list[nn.Module] = []
    for i, spec in enumerate(specs):
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build(seed=seed, index=i, device=device)
            mods.append(_Tied(tied[spec.key], spec.forward_fn))
        elif isinstance(spec, LayerSpec):
            mods.append(spec.build(seed=seed, index=i, device=device))
        else:
            mods.append(_Fn(spec))
    return nn.Sequential(*mods)


def reference_name(name: str, specs: list) -> str:
    """Map a PipelineModule parameter name to the nn.Sequential one."""
    head, key, rest = name.split(".", 2)
    if head == "layers":
        return f"{key}.{rest}"
    return f"{tied_first_index(specs)[key]}.module.{rest}"


def reference_slice(full: torch.Tensor, p: torch.Tensor, topo) -> torch.Tensor:
    """The part of a single-process tensor that local parameter `p` holds: an expert tensor's
    ep shard (along `p.ep_shard_dim`), then its tp shard (along `p.tp_shard_dim`), or the
    whole tensor for a replicated parameter."""
    ep_dim = getattr(p, "ep_shard_dim", None) if getattr(p, "expert_parallel", False) else None
    if ep_dim is not None:
        full = full.chunk(topo.ep, dim=ep_dim)[topo.ep_rank]
    dim = getattr(p, "tp_shard_dim", None)
    return full if dim is None else full.chunk(topo.tp, dim=dim)[topo.tp_rank]


def in_float64(fn):
    """`fn` run with torch's default dtype float64, restored after (`pipekit.precision.default_dtype`).
    For the module-level worker functions of the float64 parity suites: the wrapper keeps `fn`'s
    name, so `run_distributed` still pickles it by name. In the test process itself the
    `float64` fixture of tests/conftest.py does the same for a test."""
    from .precision import default_dtype

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with default_dtype(torch.float64):
            return fn(*args, **kwargs)
    return run


class Reference:
    """The one-process model a layout is compared against, trained beside it.

    `Reference(specs, loss_fn, optimizer, seed=..., clip=None)` builds `specs` as one
    `nn.Sequential` (`reference_model`) and `optimizer(parameters)` over its parameters
    (and `loss_fn`'s, when the loss has some). `step(batch)` is one plain step on the
    whole `(inputs, labels)` batch: zero_grad, loss, backward, `clip_grad_norm_(clip)`
    when `clip` is set (the norm in `grad_norm`), optimizer step; it returns the loss
    (`loss(batch)`: the same without a gradient or a step).
    `train_beside(engine, batch)` also trains `engine` on this dp rank's `rows` of the
    batch and records how far its loss (and, with `clip`, its clipping norm) is from the
    reference's; `eval_beside` does the same for `eval_batch` ("eval_loss").

    `compare(module_or_tensors, topo)` records the worst difference of every local
    weight (and gradient) from the reference's: a tp / ep shard against its slice
    (`reference_slice`), a ZeRO-3 DTensor gathered first, a tensor whose shape differs
    as `inf`. `worst` maps what was compared to the worst difference so far, `where`
    names the tensor it was seen on. A NaN difference is kept (it never compares
    below a tolerance), where `max(worst, nan)` would forget it. It is test scaffolding
    on the CPU: it communicates only where `engine` or a DTensor's `full_tensor` does.
    """

    def __init__(self, specs: list, loss_fn: Callable, optimizer: Callable, *, seed: int,
                 clip: float | None = None):
        self.specs, self.loss_fn, self.clip = specs, loss_fn, clip
        self.model = reference_model(specs, seed)
        self.parameters = [*self.model.parameters()]
        if isinstance(loss_fn, nn.Module):
            self.parameters += list(loss_fn.parameters())
        self.optimizer = optimizer(self.parameters)
        self.grad_norm: float | None = None
        self.worst: dict[str, float] = {}
        self.where: dict[str, str] = {}
        self._params = dict(self.model.named_parameters())
        self._state = self.model.state_dict()

    @staticmethod
    def rows(batch: tuple, topo) -> tuple:
        """This data replica's rows of every tensor in `batch` (its `data_rank`-th of `data_dp`
        equal parts; the cp ranks of a replica read the same rows)."""
        dp, rank = topo.data_dp, topo.data_rank
        return tuple(t[rank * len(t) // dp:(rank + 1) * len(t) // dp] for t in batch)

    def step(self, batch: tuple) -> float:
        """One optimizer step of the reference on the whole batch; its loss."""
        x, y = batch
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.model(x), y)
        loss.backward()
        if self.clip is not None:
            self.grad_norm = torch.nn.utils.clip_grad_norm_(self.parameters, self.clip).item()
        self.optimizer.step()
        return loss.item()

    def loss(self, batch: tuple) -> float:
        """The reference's loss on `batch`, without a gradient."""
        x, y = batch
        with torch.no_grad():
            return self.loss_fn(self.model(x), y).item()

    def train_beside(self, engine, batch: tuple) -> float:
        """`engine.train_batch` on this dp rank's rows, `step` on the whole batch; records
        "loss" (and "grad_norm" with `clip`). Returns the engine's loss."""
        loss = engine.train_batch(iter([self.rows(batch, engine.module.topology)]), reduce_loss=True)
        self.record("loss", abs(loss - self.step(batch)))
        if self.clip is not None:
            self.record("grad_norm", abs(engine.last_grad_norm - self.grad_norm))
        return loss

    def eval_beside(self, engine, batch: tuple) -> float:
        """`engine.eval_batch` on this dp rank's rows against `loss` on the whole batch ("eval_loss")."""
        loss = engine.eval_batch(iter([self.rows(batch, engine.module.topology)]), reduce_loss=True)
        self.record("eval_loss", abs(loss - self.loss(batch)))
        return loss

    def record(self, what: str, diff: float, where: str = "") -> None:
        """Keep `diff` under `what` if it is the worst so far (NaN is the worst of all)."""
        old = self.worst.get(what)
        if old is None or math.isnan(diff) or diff > old:  # (diff > nan is False: a NaN stays)
            self.worst[what], self.where[what] = diff, where

    def tensor(self, name: str) -> torch.Tensor:
        """The reference's tensor (a parameter, else a buffer) for a PipelineModule name."""
        ref_name = reference_name(name, self.specs)
        return self._params[ref_name] if ref_name in self._params else self._state[ref_name]

    def compare(self, named: nn.Module | Mapping | Iterable, topo=None, *, grads: bool = True,
                what: str = "weight") -> float:
        """Record the worst difference of each local tensor from the reference's under `what`
        (and of its gradient under "grad", with `grads`); return this call's worst weight
        difference. `named`: a module (its named parameters), a state dict (weights only:
        tensors carry no gradients) or (name, tensor) pairs."""
        if isinstance(named, nn.Module):
            pairs = list(named.named_parameters())
        elif isinstance(named, Mapping):
            pairs, grads = list(named.items()), False
        else:
            pairs = list(named)
        worst = 0.0
        for name, p in pairs:
            r = self.tensor(name)
            diff = _diff(_local(p), reference_slice(r.detach(), p, topo))
            self.record(what, diff, name)
            worst = diff if math.isnan(diff) or diff > worst else worst
            if grads:
                want = None if r.grad is None else reference_slice(r.grad, p, topo)
                self.record("grad", _diff(_local(p.grad), want), name)
        return worst


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor's values here: a DTensor (ZeRO-3) gathered whole, anything else detached."""
    from torch.distributed.tensor import DTensor

    if t is None:
        return None
    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def _diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """The largest absolute difference; inf for tensors of other shapes or a tensor against
    None (a gradient on one side only), 0.0 for two Nones or empty tensors."""
    if a is None or b is None:
        return 0.0 if a is b else math.inf
    if a.shape != b.shape:
        return math.inf
    return (a - b).abs().max().item() if a.numel() else 0.0


class HostReads:
    """Wraps the Tensor methods that read a value on the host (`READS`) in this process and
    counts their calls while `on`, keyed "method at file:function" by the innermost pipekit
    frame. `restore()` puts the real methods back. What it cannot see: reads inside torch's
    own C++ (a boolean-mask index, `nonzero`, CUDA's `bincount`), so code that means to be
    sync-free avoids those by construction."""

    READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "cpu", "numpy")

    def __init__(self):
        self.on, self.sites = False, collections.Counter()
        self._real = {name: getattr(torch.Tensor, name) for name in self.READS}
        for name, real in self._real.items():
            setattr(torch.Tensor, name, self._wrap(name, real))

    def _wrap(self, name, real):
        def read(t, *args, **kwargs):
            if self.on:
                self.on = False  # a read inside a read (tolist -> item) counts once
                try:
                    self.sites[f"{name} at {_pipekit_site()}"] += 1
                finally:
                    self.on = True
            return real(t, *args, **kwargs)
        return read

    def total(self) -> int:
        return sum(self.sites.values())

    def restore(self) -> None:
        for name, real in self._real.items():
            setattr(torch.Tensor, name, real)


def _pipekit_site() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "/pipekit/" in f.filename.replace("\\", "/")]
    return f"{frames[-1].filename.rsplit('/', 1)[-1]}:{frames[-1].name}" if frames else "?"


# ---- a tokenizer for chat tests ------------------------------------------------------
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")  # ChatML


def chatml_tokenizer(path, texts: list[str], vocab_size: int) -> int:
    """A small byte-level BPE with ChatML specials, trained offline on `texts` and saved as
    `path`/tokenizer.json (the caller writes tokenizer_config.json: `CHAT_TEMPLATE` and what
    else it needs); its vocabulary size. Needs the `tokenizers` package."""
    import tokenizers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["[UNK]", "<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(str(path / "tokenizer.json"))
    return tok.get_vocab_size()
