"""benchmarks/gpu_suite.py without a GPU: `--cpu-smoke` runs every section's code at tiny sizes on
the CPU (Triton in its interpreter) and writes a report with every section; the report is on disk
row by row, so a run killed part-way leaves what it finished; with no time budget every row says
it was skipped; without CUDA and without --cpu-smoke it says so in one line and exits 2. Its CUDA
lines run only on a GPU.

Timeouts catch hangs, not slowness: the smoke run takes ~35 s on a quiet 2-core VM, and a loaded
machine (load average 17) once took over 240 s, so the limits are 900 s."""

from __future__ import annotations

import pathlib
import signal
import subprocess
import sys
import time

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"
HANG_S = 900
CHECKS = ("rms_norm float32", "rms_norm + residual float32", "layer_norm + residual float32",
          "apply_rotary float32", "swiglu float32", "geglu float32", "linear_cross_entropy float32",
          "moe triton gemm float32", "NCCL path at world size 1", "torch._grouped_mm vs the loop gemm",
          "fp16 + ZeroOptimizer + LossScaler", "torch.compile of a Llama block", "fused adamw float32",
          "schedule.overlap on side streams vs off (MoE, 1F1B)")
SECTIONS = ("## checks", "## end_to_end", "## offload", "## finetune", "## kernels")


def smoke(out: pathlib.Path, *extra: str) -> list[str]:
    return [sys.executable, str(SCRIPT), "--cpu-smoke", "--out", str(out), *extra]


def test_cpu_smoke_writes_every_section(tmp_path):
    out = tmp_path / "suite.md"
    done = subprocess.run(smoke(out), capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    report = out.read_text()
    assert report in done.stdout  # the same report on stdout
    assert "# pipekit GPU suite" in report and [h for h in SECTIONS if h in report] == list(SECTIONS)
    assert [report.index(h) for h in SECTIONS] == sorted(report.index(h) for h in SECTIONS)  # in the run's order
    assert "the section stopped" not in report and "error:" not in report and "time budget" not in report, report
    # every kernel and CUDA check has a row; on the CPU all pass (the MoE Triton gemm may be absent: SKIP)
    for check in CHECKS:
        assert f"| {check}" in report, check
    assert "| FAIL |" not in report, report
    kernels = report.split("## kernels")[1]
    for kernel in ("rms_norm", "layer_norm", "apply_rotary", "swiglu", "geglu", "linear_cross_entropy", "adamw"):
        assert f"| {kernel} | " in kernels, kernel
    assert "linear_cross_entropy peak memory, pipekit / torch eager:" in kernels
    e2e = report.split("## end_to_end")[1].split("## offload")[0]
    for row in ("| GPT-2 tiny | fp32 | plain |", "| GPT-2 tiny | fp32 | pipekit |", "| GPT-2 tiny | fp32+kernels |",
                "| Mixtral-style tiny | fp32 | pipekit |", "| Mixtral-style tiny | fp32+kernels |"):
        assert row in e2e, row
    assert "nanoGPT" in e2e and "F.cross_entropy" in e2e  # the plain loop says what it is
    offload = report.split("## offload")[1].split("## finetune")[0]
    for kind in ("none", "cpu"):
        assert f"\n| {kind} | " in offload and f"| {kind} | error" not in offload, offload
    finetune = report.split("## finetune")[1].split("## kernels")[0]
    for name in ("full", "LoRA-16"):
        assert f"\n| {name} | " in finetune and f"| {name} | error" not in finetune, finetune
    trained = [int(line.split("|")[2].split("/")[0].replace(",", "")) for line in finetune.splitlines()
               if line.startswith(("| full |", "| LoRA-16 |"))]
    assert len(trained) == 2 and 0 < trained[1] < trained[0] / 2, trained  # the adapters alone train


def test_a_killed_run_leaves_every_row_it_finished(tmp_path):
    """Killed (SIGKILL) once its first end-to-end row is in the file: the header, every check and
    that row are there, each line whole; what had not run yet is not."""
    out = tmp_path / "suite.md"
    proc = subprocess.Popen(smoke(out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + HANG_S
        while "| GPT-2 tiny | fp32 | plain |" not in (out.read_text() if out.exists() else ""):
            assert proc.poll() is None, f"the run ended before it was killed: {proc.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "no end-to-end row within the hang limit"
            time.sleep(0.2)
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)
    report = out.read_text()
    assert report.startswith("# pipekit GPU suite")
    for check in CHECKS:
        assert f"| {check}" in report, check
    assert "## end_to_end" in report and "| GPT-2 tiny | fp32 | plain | " in report
    assert "## kernels" not in report and "Total" not in report
    table_lines = [line for line in report.splitlines() if line.startswith("|")]
    assert all(line.endswith("|") for line in table_lines), table_lines  # no half-written row


def test_with_no_time_left_every_row_says_it_was_skipped(tmp_path):
    out = tmp_path / "suite.md"
    done = subprocess.run(smoke(out, "--budget-s", "0"), capture_output=True, text=True, timeout=HANG_S)
    assert done.returncode == 0, done.stderr[-3000:]
    report = out.read_text()
    for heading in SECTIONS:
        section = report.split(heading)[1].split("\n## ")[0]
        assert "skipped: the section's time budget is spent" in section, (heading, section)
    assert "| PASS |" not in report and "tokens/s" in report  # nothing ran; the tables are still there


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible: the suite would run")
def test_without_cuda_it_says_so_and_exits_2(tmp_path):
    out = tmp_path / "suite.md"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout.strip().count("\n") == 0 and "no CUDA device" in done.stdout
    assert not out.exists()
