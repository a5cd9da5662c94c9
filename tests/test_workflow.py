"""A user's whole journey, in one process: prepare data, train, generate, export, env."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import pipekit
from pipekit.checkpoint import load_full_state_dict
from pipekit.cli import main
from pipekit.interchange import read_saved_model
from pipekit.models import config_from_dict, model_specs
from pipekit.precision import default_dtype

ROOT = Path(__file__).resolve().parents[1]
FUNCTION = "def add(a, b):\n    return a + b\n\n"  # the training text, repeated


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("journey")
    text = tmp / "text"
    text.mkdir()
    for i in range(6):
        (text / f"doc{i}.py").write_text(FUNCTION * (40 + i))
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


def _greedy(path: Path, prompt: str, n: int) -> str:
    """Greedy decoding written out here: the saved weights, the model's forward, the argmax."""
    saved = read_saved_model(str(path))
    with default_dtype(next(iter(saved["state_dict"].values())).dtype):
        module = pipekit.PipelineModule(model_specs(config_from_dict(saved["family"], saved["config"])))
    load_full_state_dict(module, saved["state_dict"])
    ids = list(prompt.encode())  # the byte tokenizer
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(module.eval()(torch.tensor([ids]))[0, -1].argmax()))
    return bytes(ids).decode("utf-8", errors="replace")


def test_generate_at_temperature_0_is_greedy_decoding_of_the_trained_model(trained, capsys):
    """--temperature 0 is greedy decoding: 16 new bytes, each the argmax of the model's forward
    (written out here), drawn from the bytes of the text it trained on; nothing an echo of the
    prompt could give. (30 steps learn the corpus's bytes, not yet the function itself.)"""
    assert main(["generate", str(trained[1] / "model.pt"), "--prompt", "def ", "--max-new-tokens", "16",
                 "--temperature", "0"]) == 0
    text = capsys.readouterr().out.removesuffix("\n")
    assert text == _greedy(trained[1] / "model.pt", "def ", 16)
    assert len(text) == len("def ") + 16 and text.startswith("def ")
    assert set(text[len("def "):]) <= set(FUNCTION), text


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
