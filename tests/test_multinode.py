"""Two torchrun "nodes" on this machine train one pp=2 x dp=2 job together.

This is the multi-node command of the README, run for real: two launchers
with `--nnodes 2` meet through the c10d rendezvous on 127.0.0.1, and each
starts two workers running `pipekit train` (which, under torchrun, just runs).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_train_one_job(tmp_path):
    port = _free_port()
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"pipekit-{port}",
        "-m", "pipekit.cli", "train", str(ROOT / "configs/toy.yaml"),
        "parallel.pp=2", "parallel.dp=2", "train.steps=3", "model.dim=16", "data.val_every=0",
        "logging.progress=false", "logging.log_every=1", f"logging.out_dir={out}",
    ]
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    try:
        logs = [node.communicate(timeout=240)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    for node, log in zip(nodes, logs):
        assert node.returncode == 0, log
    summary = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["summary"]
    assert (summary["pp"], summary["dp"], summary["steps"]) == (2, 2, 3)
    assert any("pp=2 dp=2 tp=1" in log for log in logs)
