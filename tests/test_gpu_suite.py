"""benchmarks/gpu_suite.py without a GPU: `--cpu-smoke` runs every section's code at tiny sizes on
the CPU (Triton in its interpreter) and writes a report with every section; without CUDA and
without --cpu-smoke it says so in one line and exits 2. Its CUDA lines run only on a GPU."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"


def test_cpu_smoke_writes_every_section(tmp_path):
    out = tmp_path / "suite.md"
    done = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = out.read_text()
    assert report in done.stdout  # the same report on stdout
    for heading in ("# pipekit GPU suite", "## checks", "## kernels", "## end_to_end"):
        assert heading in report, heading
    assert "the section stopped" not in report and "error:" not in report, report
    # every kernel and CUDA check has a row; on the CPU all pass (the MoE Triton gemm may be absent: SKIP)
    for check in ("rms_norm float32", "rms_norm + residual float32", "layer_norm + residual float32",
                  "apply_rotary float32", "swiglu float32", "geglu float32", "linear_cross_entropy float32",
                  "moe triton gemm float32", "NCCL path at world size 1", "torch._grouped_mm vs the loop gemm",
                  "fp16 + ZeroOptimizer + LossScaler", "torch.compile of a Llama block", "fused adamw float32"):
        assert f"| {check}" in report, check
    assert "| FAIL |" not in report, report
    for kernel in ("rms_norm", "layer_norm", "apply_rotary", "swiglu", "geglu", "linear_cross_entropy", "adamw"):
        assert f"| {kernel} | " in report.split("## kernels")[1].split("## end_to_end")[0], kernel
    e2e = report.split("## end_to_end")[1]
    for row in ("| GPT-2 tiny | fp32 | plain |", "| GPT-2 tiny | fp32 | pipekit |", "| GPT-2 tiny | fp32+kernels |",
                "| Mixtral-style tiny | fp32 | pipekit |", "| Mixtral-style tiny | fp32+kernels |"):
        assert row in e2e, row


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: the suite would run")
def test_without_cuda_it_says_so_and_exits_2(tmp_path):
    out = tmp_path / "suite.md"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout.strip().count("\n") == 0 and "no CUDA device" in done.stdout
    assert not out.exists()
