"""A user's whole journey, in one process: prepare data, train, generate, export, env."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipekit.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("journey")
    text = tmp / "text"
    text.mkdir()
    for i in range(6):
        (text / f"doc{i}.py").write_text("def add(a, b):\n    return a + b\n\n" * (40 + i))
    assert main(["prepare-data", str(text), "--out", str(tmp / "data"), "--val-fraction", "0.2"]) == 0
    out = tmp / "run"
    args = ["train", str(ROOT / "configs/gpt2_tiny.yaml"), "parallel.pp=1", "model.n_layers=1", "model.dim=32",
            "train.steps=30", "train.seq_len=32", "train.micro_batch=2", "optimizer.warmup_steps=3",
            f"data.source={tmp / 'data'}", "data.val_every=10", "logging.progress=false", f"logging.out_dir={out}"]
    assert main(args) == 0
    return tmp, out


def test_prepare_data_writes_a_dataset(trained):
    meta = json.loads((trained[0] / "data" / "meta.json").read_text())
    assert meta["tokenizer"] == "byte" and meta["n_files"] == 6 and meta["n_tokens"]["val"] > 0


def test_training_learns_and_saves(trained):
    lines = (trained[1] / "metrics.jsonl").read_text().splitlines()
    summary = json.loads(lines[-1])["summary"]
    assert summary["final_loss"] < summary["first_loss"] - 1.0
    assert summary["final_val_loss"] is not None
    assert (trained[1] / "model.pt").exists()


def test_generate_samples_text(trained, capsys):
    assert main(["generate", str(trained[1] / "model.pt"), "--prompt", "def ", "--max-new-tokens", "16",
                 "--temperature", "0"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("def ") and len(text.rstrip("\n")) >= len("def ")


def test_export_to_transformers(trained):
    transformers = pytest.importorskip("transformers")
    hf_dir = trained[0] / "hf"
    assert main(["convert", "--to-hf", str(trained[1] / "model.pt"), "--out", str(hf_dir)]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir))
    assert model.config.n_layer == 1 and model.config.n_embd == 32


def test_env_reports_versions(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and "gloo" in out and "Triton kernels usable" in out
