"""PEFT's form of pipekit's adapters: `to_peft` gives the tensors and the adapter_config.json
that `peft.PeftModel.from_pretrained(transformers_model, dir)` loads onto the Hugging Face
model (files are written by `pipekit.interchange.save_peft_adapter`).

pipekit's LoRA already holds PEFT's factors under PEFT's names (`pipekit.layers.lora`): A
(r, in), B (out, r), DoRA's magnitude m (out,). So an adapter on a linear that is one HF
module under another name is renamed alone: `layers.3.attn.q.lora.lora_A.weight` ->
`base_model.model.model.layers.2.self_attn.q_proj.lora_A.weight`, the HF name from the
family's adapter (`StateDictAdapter.renamed`). PEFT keeps A and B as nn.Linear factors on a
Conv1D too (only the base weight is transposed, `fan_in_fan_out`), so GPT-2's c_proj and
c_fc take theirs unchanged. The untied head's B and m lose their padded vocabulary rows.

Fused modules (GPT-2's q, k, v in one `c_attn`, `StateDictAdapter.fused`) carry one LoRA of
rank k * r over the k adapted parts, exactly: A' = [A_q; A_k; A_v] (k*r, in) and B' block-
diagonal (3D, k*r), B_j in part j's rows and columns, so s B' A' stacks the parts' own
s B_j A_j (zero rows for a part without adapter); its alpha is k * alpha (PEFT's
`rank_pattern` / `alpha_pattern`), so the scale alpha / r stays. DoRA's row norms are per
row, so m' = [m_q; m_k; m_v] with ||W_j||_row for a part without adapter (its g is 1). In
training PEFT draws one dropout mask for the fused module where pipekit draws one per part;
without dropout (and at inference) the two compute the same.

Refused in one line: MoE expert adapters (`ExpertLoRA`: PEFT's per-parameter LoRA on the
fused expert tensors is another factorisation) and a linear with no HF module.
"""

from __future__ import annotations

import torch

from .hf import hf_adapter, vocab_tensor_names

_A, _B, _M = ".lora.lora_A.weight", ".lora.lora_B.weight", ".lora.lora_magnitude_vector"
PREFIX = "base_model.model."  # PEFT's prefix of the model's own module names


def to_peft(family: str, cfg, sd: dict[str, torch.Tensor], rank: int, alpha: float,
            dropout: float = 0.0) -> tuple[dict[str, torch.Tensor], dict]:
    """(PEFT's adapter tensors, its adapter_config.json as a dict) of the adapters in `sd`, a
    pipekit full state dict (every tensor whole, stable names, base weights included: a fused
    DoRA module needs them). DoRA is read from the tensors (their magnitudes); `rank`, `alpha`
    and `dropout` are the run's model.lora. No base weights are given."""
    bases = sorted(k[: -len(_A)] for k in sd if k.endswith(_A))
    other = sorted(k for k in sd if ".lora." in k and not k.endswith((_A, _B, _M)))
    if other:
        raise ValueError(f"{other[0]} is an MoE expert adapter, which has no PEFT form here (PEFT adapts the fused "
                         "expert tensors with other factors); export the model merged (--to-hf) instead")
    if not bases:
        raise ValueError("the model holds no LoRA adapters (no .lora. tensors): --to-peft exports adapters; "
                         "export the whole model with --to-hf")
    for b in bases:
        if sd[b + _A].shape[0] != rank:
            raise ValueError(f"{b}'s adapter has rank {sd[b + _A].shape[0]}, but its settings say "
                             f"model.lora.rank={rank}")
    dora = {b + _M in sd for b in bases}
    if len(dora) > 1:
        raise ValueError("some adapters are DoRA (with a magnitude vector) and some are not; PEFT's "
                         "use_dora is one setting for the whole adapter")
    adapter = hf_adapter(cfg, family)
    renamed, fused = adapter.renamed({}), adapter.fused()
    vocab = set(vocab_tensor_names(cfg))
    out: dict[str, torch.Tensor] = {}
    modules: dict[str, bool] = {}  # the adapted HF modules: Conv1D (transposed) or not
    parts: dict[str, dict[int, str]] = {}  # a fused HF module's adapted parts: chunk -> pipekit layer
    for b in bases:
        w = b + ".weight"
        if w in renamed:
            theirs, conv = renamed[w]
            module = PREFIX + theirs.removesuffix(".weight")
            rows = cfg.vocab_size if w in vocab else None  # the padded vocabulary's rows go
            out[module + ".lora_A.weight"] = sd[b + _A]
            out[module + ".lora_B.weight"] = sd[b + _B][:rows]
            if b + _M in sd:
                out[module + ".lora_magnitude_vector"] = sd[b + _M][:rows]
            modules[theirs.removesuffix(".weight")] = conv
        elif w in fused:
            theirs, conv, j, _ = fused[w]
            parts.setdefault(theirs, {})[j] = b
            modules[theirs.removesuffix(".weight")] = conv
        else:
            raise ValueError(f"{b} has no Hugging Face module to carry its adapter in the {family} model")
    patterns: dict[str, int] = {}
    for theirs, adapted in parts.items():
        module = theirs.removesuffix(".weight")
        out.update({PREFIX + module + k: v for k, v in _fused_factors(sd, fused, theirs, adapted).items()})
        if len(adapted) > 1:
            patterns[module] = len(adapted)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": dropout,
        "target_modules": _targets(set(modules), _hf_modules(renamed, fused)), "use_dora": dora.pop(),
        "bias": "none", "fan_in_fan_out": any(modules.values()), "rank_pattern": {m: k * rank for m, k in
                                                                                  patterns.items()},
        "alpha_pattern": {m: k * alpha for m, k in patterns.items()}, "modules_to_save": None,
        "init_lora_weights": True, "use_rslora": False, "lora_bias": False, "inference_mode": True,
    }
    return out, config


def _fused_factors(sd: dict, fused: dict, theirs: str, adapted: dict[int, str]) -> dict[str, torch.Tensor]:
    """One LoRA (and DoRA magnitude) on the fused HF tensor `theirs` from its adapted parts
    (`adapted`: chunk j -> pipekit layer), as the module docstring derives it."""
    chunks = {j: ours for ours, (t, _, j, _) in fused.items() if t == theirs}  # chunk -> pipekit weight
    weights = [sd[chunks[j]] for j in sorted(chunks)]
    a = torch.cat([sd[adapted[j] + _A] for j in sorted(adapted)])  # (k*r, in)
    r = a.shape[0] // len(adapted)
    rows = [w.shape[0] for w in weights]
    b = a.new_zeros(sum(rows), a.shape[0])  # (out, k*r), block-diagonal
    for slot, j in enumerate(sorted(adapted)):
        start = sum(rows[:j])
        b[start:start + rows[j], slot * r:(slot + 1) * r] = sd[adapted[j] + _B]
    out = {".lora_A.weight": a, ".lora_B.weight": b}
    if any(name + _M in sd for name in adapted.values()):
        m = [sd[adapted[j] + _M] if j in adapted else w.double().norm(dim=1).to(a.dtype)
             for j, w in enumerate(weights)]  # ||W_j||_row: g = 1 where no adapter
        out[".lora_magnitude_vector"] = torch.cat(m)
    return out


def _hf_modules(renamed: dict, fused: dict) -> set[str]:
    """Every HF module that holds a weight in the model."""
    names = [t for t, _ in renamed.values()] + [t for t, *_ in fused.values()]
    return {n.removesuffix(".weight") for n in names if n.endswith(".weight")}


def _targets(adapted: set[str], every: set[str]) -> list[str]:
    """PEFT's target_modules for the modules `adapted`: a module's last name (`q_proj`) where
    that names exactly the adapted ones among `every` module of the model (PEFT matches a name
    and every `.name` ending), else their full names."""
    out = set()
    for module in adapted:
        short = module.rsplit(".", 1)[-1]
        if {m for m in every if m == short or m.endswith("." + short)} <= adapted:
            out.add(short)
        else:
            out.add(module)
    return sorted(out)
