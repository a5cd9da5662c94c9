"""Device placement: one GPU per worker or none, decided before any worker starts.

Every test fakes the number of visible GPUs (torch.cuda.is_available and
device_count), so it behaves the same on a GPU machine and on a CPU-only one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from pipekit.cli import main
from pipekit.config import ConfigError, load_config
from pipekit.run.env import auto_device_text
from pipekit.run.metrics import _gpu_peak, _measured_cpu_peak, _peak_text
from pipekit.topology import Topology, init_distributed, resolve_device

ROOT = Path(__file__).resolve().parents[1]
GPT2_TINY = str(ROOT / "configs/gpt2_tiny.yaml")  # pp=2: two local workers
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture
def fake_gpus(monkeypatch):
    """Set how many GPUs torch reports; outside torchrun (no RANK, WORLD_SIZE, LOCAL_WORLD_SIZE)."""
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)

    def fake(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    fake(0)
    return fake


# ---- resolve_device: a table over GPUs x local workers ------------------------
# What auto picks for (visible GPUs, local workers): CUDA only with a GPU per worker.
AUTO = {
    (0, 1): "cpu", (0, 2): "cpu", (0, 8): "cpu",
    (1, 1): "cuda", (1, 2): "cpu", (1, 8): "cpu",
    (2, 1): "cuda", (2, 2): "cuda", (2, 8): "cpu",
    (8, 1): "cuda", (8, 2): "cuda", (8, 8): "cuda",
}


@pytest.mark.parametrize("gpus, workers", sorted(AUTO))
def test_auto_takes_cuda_only_with_a_gpu_per_local_worker(gpus, workers):
    device, reason = resolve_device("auto", workers, gpus)
    assert device == AUTO[gpus, workers]
    assert "\n" not in reason and reason.startswith("auto:")
    if device == "cpu" and gpus:
        assert f"{gpus} GPU" in reason and f"{workers} local worker" in reason
        assert "train.device=cpu to silence this" in reason
    if gpus == 0:
        assert "no CUDA device" in reason


@pytest.mark.parametrize("gpus, workers", sorted(AUTO))
def test_cpu_is_always_the_cpu(gpus, workers):
    assert resolve_device("cpu", workers, gpus)[0] == "cpu"


@pytest.mark.parametrize("gpus, workers", sorted(AUTO))
def test_cuda_with_too_few_gpus_names_both_counts_and_the_ways_out(gpus, workers):
    if AUTO[gpus, workers] == "cuda":
        assert resolve_device("cuda", workers, gpus)[0] == "cuda"
        return
    with pytest.raises(ValueError) as e:
        resolve_device("cuda", workers, gpus)
    message = str(e.value)
    assert f"{gpus} GPU" in message and f"{workers} local worker" in message and "train.device=cpu" in message
    if gpus:
        assert f"run at most {gpus} worker" in message and "more nodes" in message


def test_unknown_device_names_it_and_the_valid_ones():
    with pytest.raises(ValueError, match=r"'gpu' is not one of \['auto', 'cpu', 'cuda'\]"):
        resolve_device("gpu", 1, 0)
    with pytest.raises(ValueError, match="local_workers must be >= 1, got 0"):
        resolve_device("auto", 0, 1)


def test_gpus_are_counted_from_torch_when_not_given(fake_gpus):
    fake_gpus(2)
    assert resolve_device("auto", 2)[0] == "cuda"
    assert resolve_device("auto", 3)[0] == "cpu"
    fake_gpus(0)
    assert resolve_device("auto", 1) == ("cpu", "auto: no CUDA device visible; using the CPU with gloo")


# ---- config: train.device=cuda is checked before any worker starts --------------
def test_config_rejects_cuda_with_too_few_gpus(fake_gpus):
    fake_gpus(1)
    with pytest.raises(ConfigError, match="train.device=cuda needs a GPU per local worker, but 1 GPU visible "
                                          "for 2 local workers"):
        load_config(GPT2_TINY, ["train.device=cuda"])
    load_config(GPT2_TINY, ["train.device=auto"])  # auto falls back instead
    load_config(GPT2_TINY, ["train.device=cuda", "parallel.pp=1"])


def test_config_counts_the_workers_of_this_node_under_torchrun(fake_gpus, monkeypatch):
    fake_gpus(2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # pp=2 x dp=2 over two nodes: two workers here
    load_config(GPT2_TINY, ["train.device=cuda", "parallel.dp=2"])
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ConfigError, match="2 GPUs visible for 4 local workers"):
        load_config(GPT2_TINY, ["train.device=cuda", "parallel.dp=2"])


# ---- the command ------------------------------------------------------------------
def test_train_with_cuda_and_no_gpu_exits_2_with_one_line(fake_gpus, monkeypatch, capsys):
    monkeypatch.setattr("pipekit.run.launch.launch", lambda *a: pytest.fail("launched workers"))
    assert main(["train", GPT2_TINY, "train.device=cuda"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1
    assert err.startswith("pipekit train: train.device=cuda needs a GPU per local worker, but 0 GPUs visible "
                          "for 2 local workers")


@pytest.mark.parametrize("gpus, device", [(0, "cpu"), (1, "cpu"), (2, "cuda")])
def test_launched_workers_get_the_launchers_device(fake_gpus, monkeypatch, capsys, gpus, device, tmp_path):
    """Under auto -> cpu with a GPU visible, workers must not resolve again (set_device would fail)."""
    fake_gpus(gpus)
    launched = []
    monkeypatch.setattr("pipekit.run.launch.launch", lambda nproc, argv, **kw: launched.append((nproc, argv)) or 0)
    assert main(["train", GPT2_TINY, "train.device=auto", f"logging.out_dir={tmp_path}"]) == 0
    (nproc, argv), = launched
    assert nproc == 2 and argv[-1] == f"train.device={device}"
    said = [line for line in capsys.readouterr().err.splitlines() if "notice: train.device=auto" in line]
    assert len(said) == (device == "cpu")
    if gpus == 1:
        assert "1 GPU is visible for 2 local workers (one each is needed), so this run trains on the CPU" in said[0]


def test_env_says_what_auto_picks(fake_gpus, capsys):
    assert main(["env"]) == 0
    assert "train.device=auto picks" in capsys.readouterr().out
    assert auto_device_text(0) == "cpu with gloo (no CUDA device visible)"
    assert "cuda with NCCL for up to 4 workers per node" in auto_device_text(4)


# ---- Topology and init_distributed in one plain process -------------------------------
@pytest.fixture
def plain_process(fake_gpus):
    if dist.is_initialized():
        pytest.skip("a process group is up in this pytest process")
    return fake_gpus


def test_plain_topology_on_cpu(plain_process):
    assert Topology(device="cpu").device == torch.device("cpu")
    assert Topology(device_type="cpu").device == torch.device("cpu")  # the older name
    assert Topology().device == torch.device("cpu")  # the library default
    assert Topology(device="auto").device == torch.device("cpu")  # no GPU visible


def test_plain_topology_takes_its_gpu_when_auto_resolves_to_cuda(plain_process, monkeypatch):
    plain_process(1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert Topology(device="auto").device == torch.device("cuda", 0)


def test_topology_device_errors(plain_process):
    with pytest.raises(ValueError, match="0 GPUs visible for 1 local worker"):
        Topology(device="cuda")
    with pytest.raises(ValueError, match="device='cpu' and device_type='cuda'"):
        Topology(device="cpu", device_type="cuda")
    with pytest.raises(ValueError, match=r"'tpu' is not one of"):
        Topology(device="tpu")


def test_init_distributed_without_torchrun_starts_no_group(plain_process):
    init_distributed()
    assert not dist.is_initialized()


# ---- the peak behind MFU -------------------------------------------------------------
@pytest.mark.parametrize("name, precision, tflops", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989), ("NVIDIA H100 80GB HBM3", "fp32", 494),
    ("NVIDIA H200", "fp16", 989), ("NVIDIA H100 PCIe", "bf16", 756),
    ("NVIDIA A100-SXM4-80GB", "bf16", 312), ("NVIDIA A100 80GB PCIe", "fp32", 156),
    ("NVIDIA A10", "bf16", 125), ("NVIDIA L40S", "bf16", 362), ("NVIDIA L4", "bf16", 121),
])
def test_gpu_peak_by_name_and_precision(name, precision, tflops):
    peak, source = _gpu_peak(name, precision)
    assert peak == tflops * 1e12 and name in source


def test_unknown_gpu_says_so_and_mfu_is_na():
    peak, source = _gpu_peak("NVIDIA GeForce GTX 1080", "bf16")
    assert peak is None and "unknown GPU 'NVIDIA GeForce GTX 1080'" in source and "logging.peak_tflops" in source
    assert _peak_text({"peak_flops_per_device": None, "peak_source": source}).startswith("n/a (unknown GPU")


def test_cpu_peak_is_measured_in_one_plain_process(plain_process):
    peak = _measured_cpu_peak(Topology(device="cpu"), seconds=0.05)
    assert 1e8 < peak < 1e13
    text = _peak_text({"peak_flops_per_device": peak, "peak_source": "measured", "devices": 2})
    assert "GFLOP/s per device x 2 (measured)" in text


@pytest.mark.parametrize("device, backend", [("cuda", "nccl"), ("cpu", "gloo")])
def test_the_one_process_group_takes_the_devices_backend(monkeypatch, device, backend):
    """`init_alone` (parameter offload in one process: FSDP needs a group) makes a group of one
    rank over an in-process store, NCCL for a GPU run and gloo for the CPU; none where a group is
    up already. The call is recorded, not made: the same on a GPU machine and a CPU-only one."""
    from pipekit.topology import init_alone

    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(kw))
    init_alone(device)
    assert len(calls) == 1 and calls[0]["backend"] == backend, calls
    assert (calls[0]["rank"], calls[0]["world_size"]) == (0, 1) and isinstance(calls[0]["store"], dist.HashStore)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    init_alone(device)
    assert len(calls) == 1
