"""The kernels' one dispatch rule (pipekit/kernels/dispatch.py): every row of its table,
the CUDA column with stand-ins for CUDA tensors (no GPU here), and the errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pipekit.kernels import dispatch
from pipekit.kernels.dispatch import kernels, kernels_mode, set_kernels, use_triton


@dataclass
class FakeCuda:
    """What use_triton reads of a CUDA tensor: its dtype and device."""

    dtype: torch.dtype
    is_cuda: bool = True
    is_meta: bool = False


@pytest.fixture(autouse=True)
def _triton_importable(monkeypatch):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    set_kernels(None)
    yield
    set_kernels(None)


def test_auto_takes_triton_on_cuda_in_the_triton_dtypes_only():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert use_triton(FakeCuda(dtype), FakeCuda(torch.int64))
    assert not use_triton(FakeCuda(torch.float64))  # float64 always the reference
    assert not use_triton(torch.ones(2))  # CPU
    assert not use_triton(FakeCuda(torch.float32), torch.ones(2))  # mixed devices


def test_auto_without_triton_takes_the_reference(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    assert not use_triton(FakeCuda(torch.bfloat16))


def test_torch_mode_always_takes_the_reference():
    with kernels("torch"):
        assert not use_triton(FakeCuda(torch.bfloat16))
    assert kernels_mode() == "auto"


def test_forced_triton_on_cpu_needs_the_interpreter(monkeypatch):
    with kernels("triton"):
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            use_triton(torch.ones(2))
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert use_triton(torch.ones(2))
        assert not use_triton(torch.ones(2, dtype=torch.float64))  # float64 even when forced
        with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
            use_triton(FakeCuda(torch.complex64))


def test_forced_triton_without_the_package_says_so(monkeypatch):
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    with kernels("triton"), pytest.raises(RuntimeError, match="needs the triton package, which is not installed"):
        use_triton(FakeCuda(torch.float32))


def test_the_environment_variable_sets_the_mode_and_a_bad_value_is_named(monkeypatch):
    monkeypatch.setenv(dispatch.ENV, "torch")
    assert kernels_mode() == "torch"
    set_kernels("auto")  # the config's choice wins over the environment
    assert kernels_mode() == "auto"
    set_kernels(None)
    monkeypatch.setenv(dispatch.ENV, "cuda")
    with pytest.raises(ValueError, match=r"PIPEKIT_KERNELS='cuda' is not one of \['auto', 'triton', 'torch'\]"):
        kernels_mode()
    with pytest.raises(ValueError, match=r"kernels='fast' is not one of"):
        set_kernels("fast")


def test_model_kernels_in_a_config_is_checked_before_launch(monkeypatch):
    from pipekit.config import ConfigError, load_config, load_run

    assert load_config(None, ["model.kernels=torch"]).model.kernels == "torch"
    with pytest.raises(ConfigError, match=r"model.kernels='fast' is not one of \['auto', 'triton', 'torch'\]"):
        load_config(None, ["model.kernels=fast"])
    with pytest.raises(ConfigError, match="runs only in Triton's interpreter: set TRITON_INTERPRET=1"):
        load_config(None, ["model.kernels=triton", "train.device=cpu"])
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    with pytest.raises(ConfigError, match="model.kernels=triton needs the triton package"):
        load_config(None, ["model.kernels=triton"])
    monkeypatch.setattr(dispatch, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    run = load_run(None, ["model.kernels=triton", "train.device=cpu"])
    assert run.config.model.kernels == "triton" and not hasattr(run.model, "kernels")  # not a model field


def test_an_in_process_run_sets_the_kernels_for_its_steps_and_restores_them(tmp_path, monkeypatch):
    from pipekit.config import load_run
    from pipekit.run import loop as train_module

    seen = []
    real = train_module._train
    monkeypatch.setattr(train_module, "_train", lambda run: seen.append(kernels_mode()) or real(run))
    run = load_run("configs/toy.yaml", ["model.kernels=torch", "train.steps=1", "parallel.pp=1", "data.val_every=0",
                                        "logging.progress=false", f"logging.out_dir={tmp_path}"])
    train_module.train(run)
    assert seen == ["torch"] and kernels_mode() == "auto"


def test_meta_tensors_take_the_reference_in_every_mode():
    """The engine runs the layers on meta tensors (no data) to learn the stages' shapes at
    pp > 1: they must never reach a Triton program, not even with "triton" forced."""
    meta = torch.empty(3, 5, device="meta")
    for mode in dispatch.MODES:
        with kernels(mode):
            assert not use_triton(meta, meta)
