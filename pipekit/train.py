"""The training loop behind `pipekit train`: one worker's view.

Every worker builds the topology, its own stage(s) of the model and the
engine, then runs `train.steps` optimizer steps on its data-parallel slice of
each global batch. Rank 0 logs the loss and throughput, and writes one JSON
line per logged step to `out_dir/metrics.jsonl` when `out_dir` is set.
"""

from __future__ import annotations

import json
import os
import time

import torch

from .config import Config, model_specs
from .engine import PipelineEngine
from .models.toy import lm_loss, synthetic_batches
from .pipeline import PipelineModule
from .topology import Topology, init_distributed


def _dp_slices(cfg: Config, topo: Topology):
    """This dp rank's share of each global batch, so every layout sees the same data."""
    shard = cfg.train.global_batch // topo.dp
    mine = slice(topo.dp_rank * shard, (topo.dp_rank + 1) * shard)
    for tokens, labels in synthetic_batches(cfg.model.vocab, cfg.train.global_batch, cfg.train.seq_len, seed=cfg.train.seed):
        yield tokens[mine], labels[mine]


def build(cfg: Config, topo: Topology) -> PipelineEngine:
    module = PipelineModule(
        model_specs(cfg.model),
        loss_fn=lm_loss,
        topology=topo,
        partition=cfg.schedule.partition,
        seed=cfg.train.seed,
        chunks_per_rank=cfg.schedule.chunks_per_rank,
        activation_checkpoint_interval=cfg.schedule.activation_checkpoint_interval,
    )
    opt = torch.optim.AdamW(module.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    return PipelineEngine(module, optimizer=opt, schedule=cfg.schedule.name, num_microbatches=cfg.schedule.microbatches)


def train(cfg: Config) -> dict:
    """Run the whole job on this worker; returns a summary (the same on every rank)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 or cfg.world_size > 1:
        init_distributed()
    torch.set_default_dtype(getattr(torch, cfg.train.dtype))
    topo = Topology(pp=cfg.parallel.pp, dp=cfg.parallel.dp)
    engine = build(cfg, topo)
    data = _dp_slices(cfg, topo)
    log = _Logger(cfg, topo.rank == 0)
    tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
    losses, start = [], time.perf_counter()
    for step in range(1, cfg.train.steps + 1):
        losses.append(engine.train_batch(data))
        if step % cfg.train.log_every == 0 or step in (1, cfg.train.steps):
            elapsed = time.perf_counter() - start
            log.step(step, losses[-1], tokens_per_step * step / elapsed)
    elapsed = time.perf_counter() - start
    summary = {
        "steps": cfg.train.steps,
        "first_loss": losses[0],
        "final_loss": losses[-1],
        "tokens_per_s": tokens_per_step * cfg.train.steps / elapsed,
        "seconds": elapsed,
        "pp": topo.pp,
        "dp": topo.dp,
        "schedule": cfg.schedule.name,
    }
    log.done(summary)
    return summary


class _Logger:
    def __init__(self, cfg: Config, active: bool):
        self.cfg, self.active, self.file = cfg, active, None
        if active and cfg.out_dir:
            os.makedirs(cfg.out_dir, exist_ok=True)
            self.file = open(os.path.join(cfg.out_dir, "metrics.jsonl"), "w")

    def step(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.active:
            return
        print(f"step {step:5d}/{self.cfg.train.steps}  loss {loss:.4f}  {tokens_per_s:,.0f} tokens/s", flush=True)
        if self.file:
            self.file.write(json.dumps({"step": step, "loss": loss, "tokens_per_s": tokens_per_s}) + "\n")
            self.file.flush()

    def done(self, summary: dict) -> None:
        if not self.active:
            return
        print(
            f"done: {summary['steps']} steps at pp={summary['pp']} dp={summary['dp']} ({summary['schedule']}), "
            f"loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f}, "
            f"{summary['tokens_per_s']:,.0f} tokens/s, {summary['seconds']:.1f} s",
            flush=True,
        )
        if self.file:
            self.file.write(json.dumps({"summary": summary}) + "\n")
            self.file.close()
