"""A resumable checkpoint is a saved model like model.pt: `pipekit convert --to-hf` and
`pipekit generate` read a checkpoint dir (`checkpoints/step_N`), or the checkpoints
root for its newest complete one, and `convert --overwrite` replaces only the files
it writes.

Each run is `pipekit.run.loop.train` in this process: a tiny GPT-2 and a tiny Llama
(1 layer, dim 32, vocab 64 padded to 128) for 2 steps on synthetic data, saving a
checkpoint after each step and model.pt at the end, so step_00000002 and model.pt
hold the same weights; and a toy run for the family that has no Hugging Face form.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from test_hf import TOL, hf_logits, max_diff, same_state  # noqa: E402

import pipekit  # noqa: E402
from pipekit.checkpoint import load_full_state_dict, load_full_weights  # noqa: E402
from pipekit.cli import main  # noqa: E402
from pipekit.config import load_config  # noqa: E402
from pipekit.data import prepare_data  # noqa: E402
from pipekit.models import config_from_dict, model_specs  # noqa: E402
from pipekit.run.generate import tokenizer_name  # noqa: E402
from pipekit.run.loop import train  # noqa: E402

VOCAB = 64
COMMON = ["model.n_layers=1", "model.dim=32", f"model.vocab_size={VOCAB}", "train.seq_len=16",
          "train.micro_batch=2", "schedule.microbatches=2", "parallel.pp=1", "train.steps=2",
          "data.source=synthetic", "data.val_every=0", "logging.progress=false", "logging.tensorboard=false",
          "logging.peak_tflops=1", "checkpoint.every=1"]
FAMILIES = {"gpt2": ["model.family=gpt2", "model.n_heads=2"],
            "llama": ["model.family=llama", "model.n_heads=2", "model.n_kv_heads=1", "model.hidden=48"],
            "toy": ["model.family=toy"]}
STEP1, STEP2 = "checkpoints/step_00000001", "checkpoints/step_00000002"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """family -> its run dir: model.pt, checkpoints/step_00000001 and step_00000002."""
    root = tmp_path_factory.mktemp("runs")
    for family, overrides in FAMILIES.items():
        train(load_config(None, [*COMMON, *overrides, f"logging.out_dir={root / family}"]))
        assert (root / family / STEP2 / "pipekit.json").is_file() and (root / family / "model.pt").is_file()
    return {family: root / family for family in FAMILIES}


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.delenv("PIPEKIT_DEBUG", raising=False)


def export(src: Path, out: Path, *flags: str) -> int:
    return main(["convert", "--to-hf", str(src), "--out", str(out), *flags])


def pipekit_model(checkpoint: Path) -> pipekit.PipelineModule:
    """The pipekit model built from the checkpoint's weights, as `pipekit generate` builds it."""
    meta, weights = load_full_weights(str(checkpoint))
    module = pipekit.PipelineModule(model_specs(config_from_dict(meta["family"], meta["model_config"])))
    load_full_state_dict(module, weights)
    return module.eval()


def snapshot(root: Path) -> dict:
    """Every path under `root`: a file's bytes, None for a directory."""
    return {p: (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


# ---- export ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_checkpoint_exports_to_transformers_with_pipekits_logits(runs, family, tmp_path):
    assert export(runs[family] / STEP2, tmp_path / "hf") == 0
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["hf"], "no temporary dir may be left behind"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager")
    expected = transformers.GPT2LMHeadModel if family == "gpt2" else transformers.LlamaForCausalLM
    assert type(loaded) is expected and loaded.config.vocab_size == VOCAB
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = pipekit_model(runs[family] / STEP2)(ids)[..., :VOCAB]
    assert max_diff(hf_logits(loaded.eval(), ids), ours) <= TOL


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_a_checkpoint_exports_what_model_pt_of_the_same_step_exports(runs, family, tmp_path):
    assert export(runs[family] / STEP2, tmp_path / "from_checkpoint") == 0
    assert export(runs[family] / "model.pt", tmp_path / "from_model_pt") == 0
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "from_checkpoint" / name).read_bytes() == (tmp_path / "from_model_pt" / name).read_bytes()


def test_the_checkpoints_root_exports_its_newest_checkpoint(runs, tmp_path):
    for src, out in [(STEP1, "step1"), (STEP2, "step2"), ("checkpoints", "root")]:
        assert export(runs["gpt2"] / src, tmp_path / out) == 0
    weights = {out: load_file(str(tmp_path / out / "model.safetensors")) for out in ("step1", "step2", "root")}
    assert same_state(weights["root"], weights["step2"])
    assert not same_state(weights["root"], weights["step1"]), "the two steps should hold different weights"


# ---- --overwrite ----------------------------------------------------------------------
def test_overwrite_replaces_only_the_files_it_writes(runs, tmp_path):
    """A user's README and tokenizer stay; config.json and model.safetensors are replaced;
    an earlier sharded export (index and shards) is removed, so one set of weights is left."""
    out = tmp_path / "hf"
    assert export(runs["gpt2"] / STEP2, tmp_path / "fresh") == 0
    out.mkdir()
    kept = {"README.md": b"# my model\n", "tokenizer.json": b'{"version": "1.0"}', "notes/x.txt": b"mine"}
    (out / "notes").mkdir()
    for name, data in kept.items():
        (out / name).write_bytes(data)
    (out / "config.json").write_text('{"model_type": "gpt2", "stale": true}')
    (out / "model.safetensors").write_bytes(b"stale weights")
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name in shards:
        (out / name).write_bytes(b"stale shard")
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": shards[0], "b": shards[1]}}))

    assert export(runs["gpt2"] / STEP2, out, "--overwrite") == 0
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == sorted(
        ["README.md", "tokenizer.json", "notes", "notes/x.txt", "config.json", "model.safetensors"])
    assert all((out / name).read_bytes() == data for name, data in kept.items())
    for name in ("config.json", "model.safetensors"):
        assert (out / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fresh", "hf"], "no temporary file may be left behind"
    transformers.AutoModelForCausalLM.from_pretrained(str(out))


def test_a_non_empty_out_dir_without_overwrite_is_refused_and_left_as_it_was(runs, tmp_path, capsys):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "README.md").write_text("mine\n")
    (out / "config.json").write_text("{}")
    before = snapshot(tmp_path)
    assert export(runs["gpt2"] / STEP2, out) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and "exists and is not empty" in line and "--overwrite" in line, line
    assert snapshot(tmp_path) == before


# ---- sources that are not a model pipekit can export -------------------------------------
NOT_EXPORTABLE = [  # (id, source: under the runs or this test's dir, what the one line must say)
    ("toy", "runs/toy/" + STEP2, "holds a 'toy' model, which has no Hugging Face form"),
    ("incomplete", "incomplete", "is not a complete pipekit checkpoint (it lacks pipekit.json;"),
    ("incomplete-step-dir", "interrupted/step_00000003", "is not a complete pipekit checkpoint"),
    ("root-without-a-complete-one", "interrupted", "holds no complete checkpoint (1 incomplete: step_00000003)"),
    ("random-dir", "random", "is a directory, but neither a pipekit checkpoint"),
    ("run-dir", "runs/gpt2", "is a directory, but not a checkpoint: it holds a run; give"),
]
ROWS = [pytest.param("convert", source, said, id=f"convert-{i}") for i, source, said in NOT_EXPORTABLE] + [
    pytest.param("generate", source, said, id=f"generate-{i}") for i, source, said in NOT_EXPORTABLE
    if i not in ("toy", "run-dir")]  # generate reads a run dir as its model.pt (below)


@pytest.mark.parametrize("command, source, said", ROWS)
def test_what_is_not_a_checkpoint_gets_one_line_status_2_and_changes_nothing(
        runs, command, source, said, tmp_path, capsys):
    shutil.copytree(runs["gpt2"] / STEP2, tmp_path / "incomplete")
    (tmp_path / "incomplete" / "pipekit.json").unlink()
    (tmp_path / "interrupted" / "step_00000003").mkdir(parents=True)
    (tmp_path / "random").mkdir()
    (tmp_path / "random" / "notes.txt").write_text("not a model\n")
    path = runs["gpt2"].parent / source.removeprefix("runs/") if source.startswith("runs/") else tmp_path / source
    before = snapshot(tmp_path), snapshot(runs["gpt2"].parent)
    argv = {"convert": ["convert", "--to-hf", str(path), "--out", str(tmp_path / "hf")],
            "generate": ["generate", str(path), "--prompt", "12", "--max-new-tokens", "2"]}[command]
    assert main(argv) == 2
    err = capsys.readouterr().err
    line = err.strip()
    assert line.startswith(f"pipekit {command}: ") and "\n" not in line and "Traceback" not in err, err
    assert said in line, line
    assert (snapshot(tmp_path), snapshot(runs["gpt2"].parent)) == before


# ---- generate ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generate_from_a_checkpoint_continues_the_prompt_as_model_pt_does(runs, family, capsys):
    texts = []
    for src in (STEP2, "checkpoints", "model.pt", "."):  # ".": the run dir, read as its model.pt
        assert main(["generate", str(runs[family] / src), "--prompt", "12", "--max-new-tokens", "6",
                     "--temperature", "0"]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0].startswith("12") and len(texts[0]) > len("12\n")
    assert texts[0] == texts[1] == texts[2] == texts[3], "greedy sampling from the same weights"


def test_a_checkpoint_names_the_tokenizer_model_pt_would(tmp_path, capsys):
    """model.pt records the tokenizer in its dataset's meta.json; a checkpoint finds it there
    through its config's data.source, and falls back to bytes (as model.pt would) with a note
    when the dataset is gone."""
    (tmp_path / "a.txt").write_text("def f(x):\n    return x\n" * 10)
    prepare_data([str(tmp_path / "a.txt")], str(tmp_path / "data"), val_fraction=0.0)

    def saved(source: str) -> dict:
        return {"family": "gpt2", "checkpoint": {"config": {"data": {"source": source}}}, "path": "step_00000002"}

    assert tokenizer_name({"family": "gpt2", "tokenizer": "/x/tokenizer.json"}) == "/x/tokenizer.json"
    assert tokenizer_name(saved("synthetic")) is None
    assert tokenizer_name(saved(str(tmp_path / "data"))) == "byte"
    assert capsys.readouterr().err == ""
    shutil.rmtree(tmp_path / "data")
    assert tokenizer_name(saved(str(tmp_path / "data"))) is None
    assert "is gone or incomplete; using the byte tokenizer" in capsys.readouterr().err
