"""What a run reports: rank 0's progress bar, `metrics.jsonl`, TensorBoard events and
summary table (`Logger`), the MFU figures behind them, and the per-step MoE load summary.

MFU = tokens/s x training FLOPs per token / (peak FLOP/s per device x devices).
FLOPs per token come from the model zoo (`pipekit.models.flops_per_token`: 6N plus
attention); the peak from `logging.peak_tflops`, a table of GPU data-sheet figures, or,
on the CPU, one core's measured matmul rate. Limits: the GPU table holds dense peaks of
the cards named in it (another card reports MFU as n/a); float64 is not modelled.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from ..atomic import naming_the_file, write_atomic
from ..config import Run
from ..engine import PipelineEngine
from ..models import flops_per_token as zoo_flops_per_token
from ..spec import TiedLayerSpec, count_parameters
from ..topology import Topology

# ---- throughput figures ----------------------------------------------------
# Dense (not 2:4-sparse) tensor-core peaks of one GPU in TFLOP/s, from NVIDIA's data sheets:
# (bf16/fp16, tf32). Matched in order as whole words of torch.cuda.get_device_name, so
# "H100 PCIe" comes before "H100" (SXM), and "A10" does not match "A100". V100 has no bf16
# or tf32 tensor cores: its figures are fp16 and plain fp32.
_GPU_PEAK_TFLOPS = (
    ("B200", 2250.0, 1100.0),
    ("GH200", 989.0, 494.0),
    ("H200", 989.0, 494.0),
    ("H100 PCIe", 756.0, 378.0),
    ("H100", 989.0, 494.0),
    ("H800", 989.0, 494.0),
    ("A100", 312.0, 156.0),
    ("A800", 312.0, 156.0),
    ("L40S", 362.0, 183.0),
    ("L4", 121.0, 60.0),
    ("A10", 125.0, 62.5),
    ("V100", 125.0, 15.7),
)


def peak_flops_per_device(run: Run, topo: Topology) -> tuple[float | None, str]:
    """(Dense peak FLOP/s of one device, how it was found), for MFU.

    In order: `logging.peak_tflops`; on CUDA, the card's figure for `train.precision`
    (bf16/fp16: tensor-core dense peak; fp32: the TF32 dense peak, which matmuls reach
    only with TF32 enabled, torch.set_float32_matmul_precision("high"); float64 is not
    modelled), or None for a card not in the table (MFU is then reported as n/a); on the
    CPU, measured once per run by `_measured_cpu_peak` (collective: every rank calls it).
    """
    if run.config.logging.peak_tflops:
        return run.config.logging.peak_tflops * 1e12, "logging.peak_tflops"
    if topo.device.type == "cuda":
        return _gpu_peak(torch.cuda.get_device_name(topo.device), run.precision.name)
    return _measured_cpu_peak(topo), "measured on rank 0: the fastest of ~1 s of single-thread fp32 512x512 matmuls"


def _gpu_peak(name: str, precision: str) -> tuple[float | None, str]:
    """The table's peak of the GPU called `name` at `precision`, or None naming the card."""
    for key, half, tf32 in _GPU_PEAK_TFLOPS:
        if re.search(rf"\b{key}\b", name):
            kind = "tf32" if precision == "fp32" else precision
            return (tf32 if precision == "fp32" else half) * 1e12, f"{name}, {kind} dense (data sheet)"
    return None, f"unknown GPU {name!r}: set logging.peak_tflops for MFU"


_PEAK_PROBE = ("import sys, torch; torch.set_num_threads(1); from pipekit.run.metrics import _fastest_matmul; "
               "print(_fastest_matmul(float(sys.argv[2]), int(sys.argv[1])))")


def _single_thread_matmul_flops(seconds: float, n: int) -> float:
    """The fastest single-thread n x n fp32 matmul. Measured here when this process runs one
    intra-op thread (every worker under torchrun); otherwise in a child process (bounded by a
    timeout), since switching this process's thread count to 1 and back was measured to slow
    the training after it by ~10% (the intra-op pool is rebuilt)."""
    if torch.get_num_threads() == 1:
        return _fastest_matmul(seconds, n)
    try:
        out = subprocess.run([sys.executable, "-c", _PEAK_PROBE, str(n), str(seconds)], capture_output=True,
                             text=True, check=True, timeout=60 + seconds, env={**os.environ, "OMP_NUM_THREADS": "1"})
        return float(out.stdout.split()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError):
        return _fastest_matmul(seconds, n) / torch.get_num_threads()  # rough: this process's threads share it


def _fastest_matmul(seconds: float, n: int) -> float:
    a, b = torch.randn(n, n, dtype=torch.float32), torch.randn(n, n, dtype=torch.float32)
    a @ b  # warm-up: first-call set-up is not compute
    best, start = math.inf, time.perf_counter()
    while time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def _measured_cpu_peak(topo: Topology, seconds: float = 1.0, n: int = 512) -> float:
    """Single-thread fp32 FLOP/s of one core, measured by rank 0 while the other ranks wait
    at a barrier and then receive it (collective on the default group when there is one).

    Each n x n matmul is timed alone for `seconds`, and the fastest counts: other processes
    and a busy SMT sibling only ever slow a matmul down, so the fastest of ~100 is steady
    from run to run where a median follows the machine's load (on the 2-core development VM
    under load 4: best 61-74 GFLOP/s over six rounds, median 18-28). Limit: a core that is
    never free during the whole second is measured low.
    """
    grouped = topo.world_size > 1 and dist.is_initialized()
    if grouped:
        dist.barrier()
    peak = [0.0]
    if topo.rank == 0:
        peak[0] = _single_thread_matmul_flops(seconds, n)
    if grouped:
        dist.broadcast_object_list(peak, src=0)
    return peak[0]


def flops_per_token(model_cfg, seq_len: int, n_params: int) -> float:
    """The zoo's training FLOPs per token, or 6 x parameters for a model it cannot count."""
    try:
        return zoo_flops_per_token(model_cfg, seq_len)
    except (ImportError, TypeError, ValueError, AttributeError):
        return 6.0 * n_params


def moe_summary(topo: Topology, local: dict) -> dict | None:
    """Per MoE layer, over every rank's tokens of the step: tokens per expert, the max and
    mean load (token-slots per expert) and their ratio, dropped token-slots, and the mean
    aux and z losses; on rank 0 (None elsewhere). Collective (one all_gather_object)."""
    mine = {k: (v.tolist(), n) for k, (v, n) in local.items()} if topo.tp_rank == 0 else {}  # tp: replicas
    everyone = [mine]
    if topo.world_size > 1 and dist.is_initialized():
        gathered: list[Any] = [None] * topo.world_size  # each rank's dict, unpickled
        dist.all_gather_object(gathered, mine)
        everyone = gathered
    if topo.rank != 0:
        return None
    layers: dict[str, dict] = {}
    for part in everyone:
        for name, (value, n) in part.items():
            layer, key = name.rsplit("/", 1)
            d = layers.setdefault(layer, {"tokens": None, "dropped": 0.0, "aux": [0.0, 0], "z": [0.0, 0]})
            if key == "tokens_per_expert":
                d["tokens"] = value if d["tokens"] is None else [a + b for a, b in zip(d["tokens"], value)]
            elif key == "dropped":
                d["dropped"] += value
            elif key in ("aux_loss", "z_loss"):
                d[key[0] if key == "z_loss" else "aux"][0] += value
                d[key[0] if key == "z_loss" else "aux"][1] += n
    out = {}
    for layer, d in sorted(layers.items(), key=lambda kv: int(kv[0].rsplit("/", 1)[-1]) if kv[0][-1].isdigit() else 0):
        tokens = d["tokens"] or [0.0]
        mean = sum(tokens) / len(tokens)
        out[layer] = {"tokens_per_expert": [int(t) for t in tokens], "max_load": max(tokens), "mean_load": mean,
                      "imbalance": max(tokens) / mean if mean else None, "dropped": int(d["dropped"]),
                      "aux_loss": d["aux"][0] / d["aux"][1] if d["aux"][1] else None,
                      "z_loss": d["z"][0] / d["z"][1] if d["z"][1] else None}
    return out


class Logger:
    """Rank 0's progress bar, metrics.jsonl, TensorBoard events and summary table."""

    def __init__(self, run: Run, topo: Topology, engine: PipelineEngine, notice: str | None = None,
                 start_step: int = 0, continues: bool = True):
        cfg = run.config
        self.run, self.cfg, self.engine, self.active = run, cfg, engine, topo.rank == 0
        self.start_step = start_step  # steps done before this process started (a resumed run)
        self.continues = continues  # the run whose metrics.jsonl is in out_dir (not another run's checkpoint)
        self.device, self.notice = topo.device.type, notice
        self.tokens_per_step = run.global_batch * cfg.train.seq_len
        n_params = _count_params(engine)
        self.flops_per_token = flops_per_token(run.model, cfg.train.seq_len, n_params)
        self.device_peak, self.peak_source = peak_flops_per_device(run, topo)
        self.devices = _devices(topo)
        self.peak = self.device_peak * self.devices if self.device_peak else None
        self.n_params = n_params
        self.history: list[dict] = []
        self.idle_said: set[str] = set()  # MoE layers whose idle experts were said
        self.earlier: list[dict] = []  # the records of this run's earlier attempts (restarts, resumes) it keeps
        self.metrics_path = ""
        self.start = time.perf_counter()
        self.bar = self.file = self.tb = None
        if self.active:
            self._open()

    def _open(self) -> None:
        out = self.cfg.logging.out_dir
        if out:
            os.makedirs(out, exist_ok=True)
            self.metrics_path = os.path.join(out, "metrics.jsonl")
            self.file, self.earlier = _metrics_file(self.metrics_path, self.start_step if self.continues else 0)
            if self.cfg.logging.tensorboard:
                self.tb = _tensorboard(out)
        if self.cfg.logging.progress:
            self.bar = tqdm(total=self.cfg.train.steps, desc="train", unit="step", dynamic_ncols=True)
        p = self.cfg.parallel
        self._print(f"{self.cfg.model.family}/{self.cfg.model.flavour}: {self.n_params / 1e6:.2f} M parameters, "
                    f"pp={p.pp} dp={p.dp} tp={p.tp}{f' ep={p.ep}' if p.ep > 1 else ''}, "
                    f"schedule {self.run.schedule.name}, "
                    f"{self.tokens_per_step:,} tokens per step, on {self.device}")
        nowhere = (None if self.cfg.logging.out_dir else
                   "logging.out_dir is not set: no metrics.jsonl, checkpoints or model.pt will be written "
                   "(set logging.out_dir=runs/NAME to keep them)")
        for line in (self.notice, nowhere, None if self.peak else f"MFU: {self.peak_source}"):
            if line:
                self._print(line)

    def _print(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def _say_idle_experts(self, step: int, moe: dict) -> None:
        """Once per MoE layer, the first logged step in which some of its experts got no token
        (their weights do not train while that lasts; metrics.jsonl has the counts each step)."""
        for layer, m in moe.items():
            idle = [i for i, t in enumerate(m["tokens_per_expert"]) if t == 0]
            if idle and layer not in self.idle_said:
                self.idle_said.add(layer)
                shown = ", ".join(map(str, idle[:8])) + (f" and {len(idle) - 8} more" if len(idle) > 8 else "")
                self.say(f"pipekit: {layer}: expert{'s' if len(idle) > 1 else ''} {shown} of "
                         f"{len(m['tokens_per_expert'])} got no tokens at step {step} (they do not train while "
                         f"that lasts; model.aux_loss_coef spreads the load; tokens_per_expert in metrics.jsonl "
                         f"each logged step)")

    def say(self, text: str) -> None:
        """Print a line from rank 0 (above the progress bar), nothing elsewhere."""
        if self.active:
            self._print(text)

    def saved(self, step: int, path: str, seconds: float) -> None:
        """Say where the checkpoint of `step` went and how long saving it took."""
        self.say(f"pipekit: saved the checkpoint of step {step} to {path} in {seconds:.2f} s")

    @contextlib.contextmanager
    def paused(self):
        """Leave the time spent inside (validation) out of the training throughput."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.start += time.perf_counter() - start

    def logged(self, step: int, val: float | None) -> bool:
        """Whether step `step` is written out (the same answer on every rank)."""
        return step % self.cfg.logging.log_every == 0 or val is not None or step in (1, self.cfg.train.steps)

    def step(self, step: int, loss: float, lr: float, val: float | None, moe: dict | None = None) -> None:
        elapsed = time.perf_counter() - self.start  # training time only
        tps = self.tokens_per_step * (step - self.start_step) / elapsed
        optimizer = self.engine.optimizer
        assert optimizer is not None  # a training engine has one
        rec: dict[str, Any] = {"step": step, "loss": loss, "lr": lr,
               "grad_norm": self.engine.last_grad_norm, "tokens_per_s": tps,
               "skipped": self.engine.last_step_skipped, "loss_scale": optimizer.loss_scale,
               "mfu": tps * self.flops_per_token / self.peak if self.peak else None, "elapsed_s": elapsed}
        if val is not None:
            rec["val_loss"] = val
        if moe:
            rec["moe"] = moe
            self._say_idle_experts(step, moe)
        self.history.append(rec)
        if not self.active:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tps:,.0f}", mfu=_percent(rec["mfu"]))
        skip = self.engine.last_skip
        if skip is not None:
            self._print(skip.line(step))
        if self.logged(step, val) or rec["skipped"]:
            self._record(rec)

    def _record(self, rec: dict) -> None:
        val = f"  val {rec['val_loss']:.4f}" if "val_loss" in rec else ""
        if self.bar is None or not self.bar.disable:
            self._print(f"step {rec['step']:5d}  loss {rec['loss']:.4f}{val}  lr {rec['lr']:.2e}  "
                        f"{rec['tokens_per_s']:,.0f} tok/s  mfu {_percent(rec['mfu'])}{_moe_text(rec.get('moe'))}")
        if self.file:
            with naming_the_file(self.metrics_path):
                self.file.write(json.dumps(rec) + "\n")
                self.file.flush()
        if self.tb:
            for key in ("loss", "val_loss", "lr", "grad_norm", "tokens_per_s", "mfu"):
                if rec.get(key) is not None:
                    self.tb.add_scalar(f"train/{key}", rec[key], rec["step"])
            for layer, m in (rec.get("moe") or {}).items():
                for key in ("imbalance", "dropped", "aux_loss", "z_loss"):
                    if m.get(key) is not None:
                        self.tb.add_scalar(f"{layer}/{key}", m[key], rec["step"])

    def stopped(self, step: int, why: str, path: str | None) -> None:
        """Say, in one line, where an interrupted run stopped and how to continue it."""
        if self.active:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
            where = (f"checkpoint saved to {path}; continue with train.resume=auto" if path
                     else "no checkpoint saved (no logging.out_dir or checkpoint.dir)")
            print(f"pipekit: stopped after step {step} on {why}: {where}", flush=True)

    def finish(self) -> dict:
        h, before = self.history, self.earlier
        vals = [r["val_loss"] for r in before + h if "val_loss" in r]
        attempts = _attempts(before)
        steps = len(h) + (self.start_step if before else 0)
        summary = {
            "steps": steps, "steps_this_attempt": len(h), "attempts": len(attempts) + 1,
            "seconds": sum(a[-1]["elapsed_s"] for a in attempts) + h[-1]["elapsed_s"],
            "tokens": self.tokens_per_step * steps, "first_loss": (before or h)[0]["loss"],
            "final_loss": h[-1]["loss"], "final_val_loss": vals[-1] if vals else None,
            "tokens_per_s": h[-1]["tokens_per_s"], "mfu": h[-1]["mfu"], "params": self.n_params,
            "peak_flops_per_device": self.device_peak, "peak_source": self.peak_source, "devices": self.devices,
            "pp": self.cfg.parallel.pp, "dp": self.cfg.parallel.dp, "tp": self.cfg.parallel.tp,
            "ep": self.cfg.parallel.ep,
            "schedule": self.run.schedule.name, "skipped_steps": sum(bool(r.get("skipped")) for r in before + h),
            "precision": self.run.precision.name, "zero_stage": self.cfg.optimizer.zero_stage,
        }
        if self.active:
            if self.bar is not None:
                self.bar.close()
            print(summary_table(summary), flush=True)
            if self.file:
                with naming_the_file(self.metrics_path):
                    self.file.write(json.dumps({"summary": summary}) + "\n")
                    self.file.close()
            if self.tb:
                self.tb.close()
        return summary


def _moe_text(moe: dict | None) -> str:
    """"  moe load max/mean 1.42 (moe/3), dropped 0" for the log line ("" without MoE layers)."""
    if not moe:
        return ""
    worst = max(moe, key=lambda k: moe[k]["imbalance"] or 0.0)
    dropped = sum(m["dropped"] for m in moe.values())
    return f"  moe load max/mean {moe[worst]['imbalance'] or 0:.2f} ({worst}), dropped {dropped}"


def _attempts(records: list[dict]) -> list[list[dict]]:
    """Records of earlier attempts split where one ended: its clock (elapsed_s) starts over."""
    found: list[list[dict]] = []
    for rec in records:
        if not found or rec.get("elapsed_s", 0.0) < found[-1][-1].get("elapsed_s", 0.0):
            found.append([])
        found[-1].append(rec)
    return found


def _metrics_file(path: str, start_step: int) -> tuple[Any, list[dict]]:
    """metrics.jsonl opened for this run, and the records it keeps: a fresh run starts it
    empty; a resumed run keeps the records of the steps before `start_step` (dropping later
    ones and any summary, which the interrupted run may have written) and appends."""
    if start_step == 0 or not os.path.exists(path):
        return open(path, "w"), []
    kept, records = [], []
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            if "step" in rec and rec["step"] <= start_step:
                kept.append(line if line.endswith("\n") else line + "\n")
                records.append(rec)
    write_atomic(path, "".join(kept))
    return open(path, "a"), records


def summary_table(s: dict) -> str:
    ep = f" ep={s['ep']}" if s.get("ep", 1) > 1 else ""
    rows = [
        ("layout", f"pp={s['pp']} dp={s['dp']} tp={s['tp']}{ep} ({s['schedule']})"),
        ("precision", f"{s['precision']}, ZeRO stage {s['zero_stage']}"
                      + (f", {s['skipped_steps']} steps skipped (not finite)" if s["skipped_steps"] else "")),
        ("parameters", f"{s['params'] / 1e6:.2f} M"),
        ("steps", f"{s['steps']} ({s['tokens']:,} tokens)" + (
            f", in {s['attempts']} attempts ({s['steps_this_attempt']} in this one)" if s.get("attempts", 1) > 1
            else "")),
        ("time", f"{s['seconds']:.1f} s training (validation not counted)"),
        ("train loss", f"{s['first_loss']:.4f} -> {s['final_loss']:.4f}"),
        ("val loss", "-" if s["final_val_loss"] is None else f"{s['final_val_loss']:.4f}"),
        ("throughput", f"{s['tokens_per_s']:,.0f} tokens/s"),
        ("peak", _peak_text(s)),
        ("MFU", _percent(s["mfu"])),
    ]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 40)
    return "\n".join([line, *(f"{k:<{width}}  {v}" for k, v in rows), line])


def _count_params(engine: PipelineEngine) -> int:
    """Parameters of the whole model (tied ones once), from the layout-free spec list."""
    seen, total = set(), 0
    for spec in engine.module.specs:
        if isinstance(spec, TiedLayerSpec):
            if spec.key in seen:
                continue
            seen.add(spec.key)
        total += count_parameters(spec)
    return total


def _devices(topo: Topology) -> int:
    """Devices the job computes on: one GPU per rank; on the CPU, the cores its ranks' threads
    can occupy (min(ranks x torch threads, cores)), since the CPU peak is one core's."""
    if topo.device.type == "cuda":
        return topo.world_size
    return min(topo.world_size * torch.get_num_threads(), os.cpu_count() or 1)


def _percent(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def _peak_text(s: dict) -> str:
    """The summary's peak row: the per-device figure, the device count, and where it came from."""
    peak = s.get("peak_flops_per_device")
    if not peak:
        return f"n/a ({s.get('peak_source')})"
    figure = f"{peak / 1e12:,.1f} TFLOP/s" if peak >= 1e12 else f"{peak / 1e9:,.1f} GFLOP/s"
    return f"{figure} per device x {s['devices']} ({s['peak_source']})"


def _tensorboard(out_dir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(os.path.join(out_dir, "tb"))
