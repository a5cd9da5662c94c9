"""Activation bytes per rank with and without sequence parallelism, against `pipekit.plan.memory`.

Run:  python benchmarks/sequence_parallel_memory.py    # ~2 min; --quick: a smoke run (writes nothing)

What is measured
----------------
For each model (GPT-2 and Llama, `tiny` flavour resized, float32, train mode)
and tp in {1, 2, 4}: one spawned gloo group of tp processes (1 intra-op thread
each, pp=1, dp=1), which builds the whole model as one stage twice,
`Topology(pp=1, tp=t, sequence_parallel=sp)` for sp off and on (same seed),
and runs ONE forward of one microbatch (`MICRO_BATCH` rows of `SEQ` tokens,
the same ids on every tp rank, as tp ranks see them) layer by layer, then
the loss, inside `torch.autograd.graph.saved_tensors_hooks`. Every tensor
autograd saves for backward is recorded; tensors are told apart by their
storage (`untyped_storage().data_ptr()`), a storage is counted once (its full
`nbytes()`) and charged to the first layer that saves it, and storages of
parameters (so parameters and views of them) are left out. Buffers (Llama's
rotary tables) and integer inputs (token ids) count. The loss's bytes are
charged to the head, as memplan folds them there. Also recorded: each
transformer block's output bytes, the message a pipeline stage ending after
that block would send (at SP on, the (B, T/tp, D) slice the p2p carries).
Per rank figures are the largest over the tp ranks (they are equal here).

Prediction. `pipekit.plan.memory.planned_activations(run, layers, rows, sp,
ac=False)` for the same config (`load_run(None, [model, tp, seq_len,
micro_batch overrides])`), i.e. what `pipekit plan --memory-budget-gb` uses:
the run's own layers built at its tp (a `FakeGroup(tp, 0)` as their tp group,
sequence parallel when on) on the meta device, one forward of one microbatch
under the same saved-tensor hooks (storages told apart by identity on meta),
the loss folded into the head (`memplan.meta_activations`). Only when the
layers cannot run on meta does it fall back to the planner's tp=1 profile
(`profiler.profile_layers(run, rows=MICRO_BATCH, reps=1)`) scaled per block
by Korthikanti et al. 2022's proportions (SP off: M * (10 + 24/t +
5as/(ht)) / (34 + 5as/h); SP on: M / t); the JSON's `memplan_source` says
which was used.

Korthikanti's coefficients are in 16-bit units with 1-byte dropout masks:
per layer sbh(10 + 24/t + 5as/(ht)) bytes without SP, sbh(34/t + 5as/(ht))
with SP. These models in fp32 have no dropout and use PyTorch's fused
causal attention (no (s, s) score matrix saved: q, k, v, the output and a
per-row log-sum-exp), so the fp32 count from the saved tensors themselves
is, per GPT-2 block, in bytes (4 bytes per element, f = 4h the MLP width):

    SP off:  sbh * 4 * (4 + (4 + 2f/h)/t) + 4abs/t   = sbh(16 + 48/t) + 4abs/t
    SP on:   sbh * 4 * (2 + 2 + 4 + 2f/h)/t + 4abs/t    = sbh * 64/t + 4abs/t

(replicated without SP: both norms' inputs and the two tp-region inputs,
QKV's and fc1's; with SP all four are split: the QKV and fc1 linears save
their input's sequence slice and all-gather it again in backward,
`pipekit.layers.parallel.sequence_parallel_linears`). No such count is given
for Llama (its RMSNorm, rotary and SwiGLU save more than the q, k, v, gate and
up tensors alone; the table says n/a).

The script prints measured / memplan and measured / this count; the target is
measured / memplan within 10%.

Not measured: GPUs, bf16, peak allocator memory (only what autograd keeps for
backward; temporaries freed during the forward and the backward's own
buffers are not), pp > 1 (the message size is a block's output, not a timed
send), activation checkpointing, MoE. The processes share this machine's
cores with whatever else runs on it (load average reported; memory figures
do not depend on it).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import pipekit
from pipekit.config import load_run
from pipekit.layers import TransformerBlock
from pipekit.models import get_model, model_loss, model_specs
from pipekit.plan.memory import BLOCK, planned_activations, tp_fraction
from pipekit.plan.profiler import profile_layers
from pipekit.testing import run_distributed
from pipeline_overhead import load_average, machine, table

SEED = 0
RESULTS = Path(__file__).parent / "results"
TPS = (1, 2, 4)
TARGET = 0.10  # measured within 10% of memplan
MODELS = {
    "gpt2": dict(n_layers=2, dim=256, n_heads=8, max_seq_len=512),
    "llama": dict(n_layers=2, dim=256, n_heads=8, n_kv_heads=4, hidden=704, max_seq_len=512),
}
SHAPE = dict(micro_batch=2, seq=512)
QUICK_MODELS = {
    "gpt2": dict(n_layers=2, dim=64, n_heads=4, max_seq_len=64),
    "llama": dict(n_layers=2, dim=64, n_heads=4, n_kv_heads=4, hidden=128, max_seq_len=64),
}
QUICK_SHAPE = dict(micro_batch=2, seq=64)


# ---- measuring (in a worker) ---------------------------------------------------
class SavedStorages:
    """The storages autograd saves while active, each counted once, parameters' left out."""

    def __init__(self, skip: set[int]):
        self.skip, self.seen = skip, set()
        self.bytes = 0

    def hooks(self):
        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key not in self.skip and key not in self.seen:
                self.seen.add(key)
                self.bytes += storage.nbytes()
            return t
        return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

    def take(self) -> int:
        """Bytes counted since the last take."""
        n, self.bytes = self.bytes, 0
        return n


def measure(family: str, model: dict, shape: dict, sp: bool) -> dict:
    """One forward (and the loss) of one microbatch through the whole model as one stage:
    saved bytes per layer, each block's output bytes."""
    cfg = get_model(family, "tiny", **model)
    specs = model_specs(cfg)
    topo = pipekit.Topology(pp=1, tp=dist.get_world_size(), sequence_parallel=sp)
    module = pipekit.PipelineModule(specs, loss_fn=model_loss(cfg), topology=topo, seed=SEED)
    module.train()
    ids = torch.randint(0, cfg.vocab_size, (shape["micro_batch"], shape["seq"] + 1),
                        generator=torch.Generator().manual_seed(SEED + 1))
    x, labels = ids[:, :-1], ids[:, 1:]
    counter = SavedStorages({p.untyped_storage().data_ptr() for p in module.parameters()})
    layers = []
    with counter.hooks():
        out = x
        for i in range(len(specs)):
            layer = module.layer(i)
            out = module.run_layer(i, out)
            layers.append({"name": type(layer).__name__, "saved": counter.take(),
                           "out": out.numel() * out.element_size(), "out_shape": list(out.shape),
                           "block": isinstance(layer, TransformerBlock)})
        loss = module.loss_fn(out, labels)
        layers[-1]["saved"] += counter.take()  # the loss, charged to the head as memplan does
    del loss, out
    return {"layers": layers}


def worker(models: dict, shape: dict) -> dict:
    torch.set_num_threads(1)
    return {f"{family}/sp={sp}": measure(family, model, shape, sp)
            for family, model in models.items() for sp in ((False, True) if dist.get_world_size() > 1 else (False,))}


# ---- predicting (in this process) --------------------------------------------------
def overrides(family: str, model: dict, shape: dict, tp: int) -> list[str]:
    out = [f"model.family={family}", "model.flavour=tiny", f"parallel.tp={tp}", f"train.seq_len={shape['seq']}",
           f"train.micro_batch={shape['micro_batch']}", "train.dtype=float32", "schedule.microbatches=1",
           "data.source=synthetic"]
    return out + [f"model.{k}={v}" for k, v in model.items()]


def predictions(family: str, model: dict, shape: dict) -> dict:
    """memplan's per-layer held bytes (one microbatch, ac off) for each (tp, sp)."""
    base = load_run(None, overrides(family, model, shape, 1))
    layers = profile_layers(base, rows=shape["micro_batch"], reps=1).at(shape["micro_batch"])
    out = {}
    for tp in TPS:
        run = load_run(None, overrides(family, model, shape, tp))
        for sp in ((False, True) if tp > 1 else (False,)):
            held, _, source = planned_activations(run, layers, shape["micro_batch"], sp, False)
            out[(tp, sp)] = {"held": held, "names": [c.name for c in layers], "fraction": tp_fraction(run, sp),
                             "source": source,
                             "tp1_saved": [c.saved_bytes for c in layers], "tp1_out": [c.out_bytes for c in layers]}
    return out


def count_block(family: str, model: dict, shape: dict, tp: int, sp: bool) -> float | None:
    """The fp32 count of the module docstring for one GPT-2 block (None for other models)."""
    s, b, h, a = shape["seq"], shape["micro_batch"], model["dim"], model["n_heads"]
    if family != "gpt2":
        return None
    lse = 4 * a * b * s / tp
    split = 4 + 2 * 4  # q, k, v, attention output; fc1 output and GELU output (f = 4h)
    if sp:
        return s * b * h * 4 * (4 + split) / tp + lse
    return s * b * h * 4 * (4 + split / tp) + lse


# ---- rows and report -------------------------------------------------------------------
def rows_for(family: str, model: dict, shape: dict, per_tp: dict, pred: dict) -> list[dict]:
    rows = []
    for tp in TPS:
        for sp in ((False, True) if tp > 1 else (False,)):
            ranks = [r[f"{family}/sp={sp}"]["layers"] for r in per_tp[tp]]
            layers = max(ranks, key=lambda ls: sum(layer["saved"] for layer in ls))
            p = pred[(tp, sp)]
            blocks = [i for i, layer in enumerate(layers) if layer["block"]]
            block_saved = [layers[i]["saved"] for i in blocks]
            block_pred = [p["held"][i] for i in blocks]
            assert all(p["names"][i] == BLOCK for i in blocks), (p["names"], blocks)
            total, total_pred = sum(layer["saved"] for layer in layers), sum(p["held"])
            msg = layers[blocks[0]]["out"]
            msg_pred = p["tp1_out"][blocks[0]] / (tp if sp else 1)
            rows.append({"model": family, "tp": tp, "sp": sp, "seq": shape["seq"], "micro_batch": shape["micro_batch"],
                         **{f"model_{k}": v for k, v in model.items()},
                         "layers": [{"name": layer["name"], "saved_bytes": layer["saved"], "memplan_bytes": held}
                                    for layer, held in zip(layers, p["held"])],
                         "block_saved_bytes": block_saved, "block_memplan_bytes": block_pred,
                         "block_count_bytes": count_block(family, model, shape, tp, sp),
                         "memplan_block_fraction": p["fraction"], "memplan_source": p["source"],
                         "per_rank_total_saved_bytes": [sum(layer["saved"] for layer in ls) for ls in ranks],
                         "total_saved_bytes": total, "total_memplan_bytes": total_pred,
                         "block_ratio": block_saved[0] / block_pred[0], "total_ratio": total / total_pred,
                         "message_bytes": msg, "message_shape": layers[blocks[0]]["out_shape"],
                         "message_memplan_bytes": msg_pred})
    for r in rows:  # SP on against off at the same tp
        off = next(o for o in rows if o["model"] == r["model"] and o["tp"] == r["tp"] and not o["sp"])
        r["block_vs_sp_off"] = r["block_saved_bytes"][0] / off["block_saved_bytes"][0]
        r["total_vs_sp_off"] = r["total_saved_bytes"] / off["total_saved_bytes"]
        r["message_vs_sp_off"] = r["message_bytes"] / off["message_bytes"]
    return rows


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def _ratio(x: float) -> str:
    return f"{x:.3f}" + ("" if abs(x - 1) <= TARGET else " **miss**")


def report(rows: list[dict], models: dict, shape: dict, info: dict, command: str) -> str:
    body = [[r["model"], r["tp"], "on" if r["sp"] else "off", _mb(r["block_saved_bytes"][0]),
             _mb(r["block_memplan_bytes"][0]), _ratio(r["block_ratio"]),
             "n/a" if r["block_count_bytes"] is None else f"{r['block_saved_bytes'][0] / r['block_count_bytes']:.3f}",
             f"{r['block_vs_sp_off']:.3f}", _mb(r["total_saved_bytes"]), _mb(r["total_memplan_bytes"]),
             _ratio(r["total_ratio"]), f"{r['total_vs_sp_off']:.3f}", _mb(r["message_bytes"]),
             f"{r['message_bytes'] / r['message_memplan_bytes']:.3f}"] for r in rows]
    shapes = "; ".join(f"{f}: " + ", ".join(f"{k}={v}" for k, v in m.items()) for f, m in models.items())
    misses = [f"- {r['model']} tp={r['tp']} SP {'on' if r['sp'] else 'off'}: per block measured / memplan "
              f"{r['block_ratio']:.3f}, whole stage {r['total_ratio']:.3f}"
              for r in rows if abs(r["block_ratio"] - 1) > TARGET or abs(r["total_ratio"] - 1) > TARGET]
    return "\n\n".join([
        f"Machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}, gloo, 1 thread per rank; "
        f"1-min load average {info['load_average_before']:.2f} before, {info['load_average_after']:.2f} after "
        f"(memory figures do not depend on it). Command: `{command}`",
        f"Models (tiny flavour, float32, train mode): {shapes}. One microbatch of {shape['micro_batch']} x "
        f"{shape['seq']} tokens, whole model as one stage (pp=1), tp ranks spawned over gloo. MB = 10^6 bytes per "
        "rank (largest tp rank). Saved = storages autograd keeps for backward, parameters left out; memplan = "
        "`planned_activations(run, profile, rows, sp, ac=False)` (the meta count); count = the docstring's "
        "fp32 per-block count; message = one block's output (a stage boundary's p2p message).",
        table(["model", "tp", "SP", "block MB", "memplan MB", "measured / memplan", "measured / count",
               "block SP on / off", "stage MB", "memplan MB", "measured / memplan", "stage SP on / off",
               "message MB", "message / memplan"], body),
        "Outside the 10% target:\n" + ("\n".join(misses) if misses else "- none"),
    ])


def parse_args(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke mode: small shapes, seconds, writes nothing")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for sequence_parallel_memory.json and .md")
    a = p.parse_args(argv)
    return {"quick": a.quick, "out": a.out, "command": " ".join(["python", *sys.argv])}


def main(argv=None) -> None:
    cfg = parse_args(argv)
    models, shape = (QUICK_MODELS, QUICK_SHAPE) if cfg["quick"] else (MODELS, SHAPE)
    started, load_before = time.perf_counter(), load_average()
    per_tp = {tp: run_distributed(worker, tp, models, shape, timeout=600, op_timeout=300) for tp in TPS}
    rows = [r for family, model in models.items()
            for r in rows_for(family, model, shape, per_tp, predictions(family, model, shape))]
    info = {**machine(), "threads_per_rank": 1, "load_average_before": load_before,
            "load_average_after": load_average(), "seconds": time.perf_counter() - started}
    text = report(rows, models, shape, info, cfg["command"])
    print(text)
    if not cfg["quick"]:
        cfg["out"].mkdir(parents=True, exist_ok=True)
        (cfg["out"] / "sequence_parallel_memory.json").write_text(
            json.dumps({"rows": rows, "machine": info, "command": cfg["command"], "models": models,
                        "shape": shape}, indent=1))
        (cfg["out"] / "sequence_parallel_memory.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
