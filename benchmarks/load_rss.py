"""Peak host memory per rank while starting a run from Hugging Face weights (`model.init`), pp=4 against pp=1.

    python benchmarks/load_rss.py [--dim 1024] [--layers 8] [--vocab 32000] [--shard-mb 100]

What is measured: a Llama saved by transformers (random weights from a config, float32,
sharded safetensors of `--shard-mb` each; about 0.7 GB with the defaults) is the
`model.init` of a `pipekit train` run, built as `pipekit.run.loop.build` builds it (the
stage's layers, then `load_pretrained`: each rank reads only the tensors of its own
stages and shards, a block at a time). Each rank records its resident memory (VmRSS)
before building its module, after, and its peak (VmHWM) once `load_pretrained` returns;
"peak" is the peak less the memory before the module: what building and loading its
part of the model took. It is set against the bytes of the
parameters that rank holds (its shard). pp=4 runs 4 gloo processes, pp=1 one.

Target (issue 23): a rank's peak while loading <= 1.3x its shard's bytes. Limits: one
CPU machine, one model; the run's other memory (gradient buckets, optimizer state,
activations) comes after loading and is not counted; file pages read through the mmap count in VmRSS, as they should.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def save_model(path: str, dim: int, layers: int, vocab: int, shard_mb: int) -> int:
    """The Hugging Face Llama `model.init` reads; returns its parameter bytes."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=int(dim * 8 / 3) // 64 * 64,
                                   num_hidden_layers=layers, num_attention_heads=dim // 64,
                                   num_key_value_heads=dim // 128, max_position_embeddings=512,
                                   tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(cfg)
    model.save_pretrained(path, max_shard_size=f"{shard_mb}MB")
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    return nbytes


def measure(path: str, pp: int, tp: int = 1) -> dict:
    """On each rank: build the run's module (`pipekit.run.loop.build_module`, as `build` does) and
    load `path` into it (`load_pretrained`), reporting resident memory around each."""
    from pipekit.config import load_run
    from pipekit.interchange import load_pretrained
    from pipekit.run.loop import build_module
    from pipekit.topology import Topology

    run = load_run(None, [f"model.init={path}", f"parallel.pp={pp}", f"parallel.tp={tp}", "train.dtype=float32",
                          "train.device=cpu",
                          "train.seq_len=64", "train.micro_batch=1", f"schedule.microbatches={max(pp, 1)}"])
    topo = Topology(pp=pp, tp=tp, device="cpu") if pp * tp > 1 else Topology(alone=True)
    before = _status_kb("VmRSS")
    module = build_module(run, topo)
    built = _status_kb("VmRSS")
    load_pretrained(module, path)
    peak = _status_kb("VmHWM")
    shard = sum(p.numel() * p.element_size() for p in module.parameters())
    return {"rss_before_mib": before / 1024, "module_mib": (built - before) / 1024,
            "load_peak_mib": (peak - before) / 1024, "load_extra_mib": (peak - built) / 1024,
            "shard_mib": shard / 2**20, "ratio": (peak - before) * 1024 / shard}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard-mb", type=int, default=100)
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "load_rss.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    from pipekit.testing import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "llama")
        nbytes = save_model(path, args.dim, args.layers, args.vocab, args.shard_mb)
        rows = {"pp=1 (one process)": [run_distributed(measure, 1, path, 1, timeout=900)[0]],
                "pp=4 (4 gloo processes)": run_distributed(measure, 4, path, 4, timeout=900),
                "pp=2 x tp=2 (4 processes)": run_distributed(measure, 4, path, 2, 2, timeout=900)}
    result = {
        "command": "python benchmarks/load_rss.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}",
        "args": vars(args), "model_mib": nbytes / 2**20, "rows": rows,
        "worst_ratio": max(r["ratio"] for rs in rows.values() for r in rs),
    }
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(result, fh, indent=1)
    print(f"model {nbytes / 2**20:.0f} MiB (float32, sharded safetensors)")
    print(f"{'layout':26} {'rank':>4} {'shard MiB':>10} {'module MiB':>11} {'peak MiB':>9} {'peak / shard':>13}")
    for name, rs in rows.items():
        for rank, r in enumerate(rs):
            print(f"{name:26} {rank:>4} {r['shard_mib']:>10.1f} {r['module_mib']:>11.1f} {r['load_peak_mib']:>9.1f} "
                  f"{r['ratio']:>13.2f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
