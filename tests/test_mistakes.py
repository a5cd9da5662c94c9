"""A user's mistake, in any subcommand: one line on stderr, exit status 2, nothing on disk changed.

Each row of MISTAKES is a command line and a piece of the one line it must
print. `{tmp}` is the test's own directory (the files of `tmp_files` are in it,
and it is the working directory), `{shared}` the module's fixtures (a trained
toy model.pt and prepared datasets), `{root}` the repository. Every file and
directory under both is compared, bytes and names, before and after the command.

Train rows run in this process: a config mistake is found before any worker
starts (`load_config`, then `pipekit.run.preflight.check_before_launch`). Each
train row also sets parallel.pp=1 and train.steps=2, so a check gone missing
fails quickly in this process instead of launching workers.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from pipekit.cli import main
from pipekit.data import prepare_data

ROOT = Path(__file__).resolve().parents[1]
TEXT = "def f(x):\n    return 2 * x + 1\n" * 20  # 640 bytes


def train(*overrides: str) -> list[str]:
    """A train command line of the toy config that could only run in this process, quickly."""
    return ["train", "{root}/configs/toy.yaml", "parallel.pp=1", "train.steps=2", "logging.progress=false",
            *overrides]


GPT2_CONFIG = '{"model_type": "gpt2", "vocab_size": 64, "n_positions": 32, "n_layer": 1, "n_embd": 32, "n_head": 2}'

MISTAKES = [  # (id, argv, what the one line must say: a piece, or a tuple of pieces)
    # ---- train: config files
    ("train-config-is-a-dir", ["train", "{tmp}"], "is a directory; give a YAML file"),
    ("train-config-bad-yaml", ["train", "{tmp}/bad.yaml"], "is not valid YAML"),
    ("train-config-missing", ["train", "{tmp}/missing.yaml"], "config file not found"),
    ("train-config-is-a-list", ["train", "{tmp}/list.yaml"], "holds a YAML list at its top level; a config is a"),
    ("train-two-configs", ["train", "{root}/configs/toy.yaml", "{root}/configs/gpt2_tiny.yaml"],
     "one config file, got 2"),
    ("train-override-without-equals", train("train.steps", "3"),
     "'train.steps' is neither a config file (not found) nor a key=value override (did you mean train.steps=3?)"),
    ("train-max-restarts-negative", [*train(), "--max-restarts", "-1"], "argument --max-restarts: -1 must be >= 0"),
    ("train-flag-between-overrides", [*train(), "--max-restarts", "1", "--nope", "model.dim=0"],
     "unrecognized arguments: --nope"),
    # ---- train: values (pipekit.config.check_config)
    ("unknown-key", train("parallel.ppp=2"), "ppp"),
    ("wrong-type", train("train.steps=many"), "train.steps"),
    ("family", train("model.family=bert"), "model.family='bert' is not one of"),
    ("toy-dim", train("model.dim=0"), "model.dim=0 must be >= 1"),
    ("lr-zero", train("optimizer.lr=0"), "optimizer.lr=0.0 must be a finite number > 0"),
    ("lr-nan", train("optimizer.lr=nan"), "optimizer.lr=nan must be a finite number > 0"),
    ("min-lr-above-lr", train("optimizer.min_lr=1"), "optimizer.min_lr=1.0 must be in [0, optimizer.lr=0.003]"),
    ("warmup-negative", train("optimizer.warmup_steps=-1"), "optimizer.warmup_steps=-1 must be >= 0"),
    ("weight-decay-negative", train("optimizer.weight_decay=-0.1"), "optimizer.weight_decay=-0.1 must be"),
    ("beta2-one", train("optimizer.beta2=1.0"), "optimizer.beta2=1.0 must be in [0, 1)"),
    ("eps-zero", train("optimizer.eps=0"), "optimizer.eps=0.0 must be a finite number > 0"),
    ("clip-zero", train("optimizer.clip_grad_norm=0"),
     "optimizer.clip_grad_norm=0.0 must be a finite number > 0, or null"),
    ("fused-not-a-choice", train("optimizer.fused=maybe"), "optimizer.fused='maybe' is not one of"),
    ("fused-sgd", train("optimizer.fused=true", "optimizer.name=sgd"),
     "optimizer.fused=true is fused AdamW, but optimizer.name=sgd"),
    ("fp16-loss-scale", train("fp16.loss_scale=-1"), "fp16.loss_scale=-1.0 must be a finite number >= 0"),
    ("val-every-negative", train("data.val_every=-1"), "data.val_every=-1 must be >= 0"),
    ("val-batches-zero", train("data.val_batches=0"), "data.val_batches=0 must be >= 1 while data.val_every=100"),
    ("partition-name", train("schedule.partition=balanced"),
     "schedule.partition='balanced' must be uniform, parameters, profile, type:REGEX"),
    ("partition-boundaries", train("schedule.partition=0,4"),
     "schedule.partition: explicit boundaries [0, 4] must start at 0 and end at 13 (the number of layers)"),
    ("memory-budget-not-profile", train("schedule.memory_budget_gb=2"),
     "schedule.memory_budget_gb=2.0 applies to schedule.partition=profile"),
    ("interleaved-one-chunk", train("schedule.name=interleaved_1f1b", "schedule.chunks_per_rank=1"),
     "interleaved_1f1b needs at least 2 virtual stages per rank, got chunks_per_rank=1"),
    ("partition-bad-regex", train("schedule.partition=type:("), "'(' is not a valid regex"),
    ("partition-matches-nothing", train("schedule.partition=type:Attention"),
     "matches no layer; the layer class names are: TokenEmbedding"),
    ("recompute-interval-negative", train("schedule.activation_checkpoint_interval=-1"),
     "schedule.activation_checkpoint_interval=-1 must be >= 0"),
    ("recompute-bad-regex", train("schedule.checkpoint_layers=("),
     "schedule.checkpoint_layers='(' is not a valid regex"),
    ("recompute-matches-nothing", train("schedule.checkpoint_layers=Attention"),
     "schedule.checkpoint_layers='Attention' matches no layer"),
    ("checkpoint-every-negative", train("checkpoint.every=-1"), "checkpoint.every=-1 must be >= 0"),
    ("checkpoint-keep-zero", train("checkpoint.keep=0"), "checkpoint.keep=0 must be >= 1"),
    ("checkpoint-every-nowhere", train("logging.out_dir=null", "checkpoint.every=5"),
     "checkpoint.every=5 has nowhere to save"),
    ("resume-blank", train("train.resume=' '"), "train.resume=' ' is empty (an unset shell variable?); it must be"),
    # ---- train: config and environment (issue 27): nothing silent
    ("resume-empty-override", train("train.resume="), "train.resume= is empty (an unset shell variable?)"),
    ("checkpoint-dir-empty-string", train("checkpoint.dir=''"), "checkpoint.dir='' is empty"),
    ("data-source-empty-in-file", ["train", "{tmp}/empty_source.yaml"], "data.source='' is empty"),
    ("out-dir-a-boolean", train("logging.out_dir=no"), "logging.out_dir=false (override 'logging.out_dir=no') is a"),
    ("out-dir-a-boolean-in-file", ["train", "{tmp}/out_dir_no.yaml"],
     ("logging.out_dir=false (", "out_dir_no.yaml) is a boolean, not text")),
    ("model-init-a-number", train("model.init=2024"), "model.init=2024 (override 'model.init=2024') is a number"),
    ("checkpoint-dir-in-another-run", train("checkpoint.dir={shared}/run/checkpoints"),
     ("checkpoint.dir=", "lies in another run's directory", "(metrics.jsonl, model.pt, checkpoints")),
    ("checkpoint-dir-in-another-run-via-dotdot", train("checkpoint.dir={shared}/run/../run/ck"),
     "lies in another run's directory"),
    ("override-names-no-key", train("=3"), "override '=3' names no key before =; write KEY=VALUE"),
    ("override-empty-segment", train("train..steps=3"), "override 'train..steps=3' names no key"),
    ("section-given-a-value", train("model=gpt2"), "model=gpt2 (override 'model=gpt2'): model is a section, not a"),
    ("section-given-a-value-in-file", ["train", "{tmp}/model_str.yaml"], "model is a section, not a value"),
    ("override-bad-yaml", train("train.steps=[1"), "override 'train.steps=[1': the value is not valid YAML"),
    ("config-duplicate-key", ["train", "{tmp}/dup.yaml"], "is not valid YAML: found duplicate key steps (line 3"),
    ("rope-theta-zero", ["train", "model.family=llama", "model.rope_theta=0", "parallel.pp=1"],
     "rope_theta=0.0 must be a finite number > 0"),
    ("norm-eps-negative", ["train", "model.family=gpt2", "model.norm_eps=-1", "parallel.pp=1"], "norm_eps"),
    ("resume-auto-nowhere", train("logging.out_dir=null", "train.resume=auto"),
     "train.resume=auto looks for the newest checkpoint"),
    ("trace-step-zero", train("logging.trace_step=0"), "logging.trace_step=0 must be a step in 1..train.steps=2"),
    ("trace-step-past-end", train("logging.trace_step=9"), "logging.trace_step=9 must be a step in 1..train.steps=2"),
    ("trace-step-no-out-dir", train("logging.out_dir=null", "logging.trace_step=1"),
     "writes its timeline to logging.out_dir"),
    ("seed-negative", train("train.seed=-1"), "train.seed=-1 must be >= 0"),
    ("peak-tflops-zero", train("logging.peak_tflops=0"), "logging.peak_tflops=0.0 must be a finite number > 0"),
    # ---- train: what the paths hold (pipekit.run.preflight)
    ("data-missing", train("data.source={tmp}/nothing-here"), "does not exist; give stdlib or synthetic"),
    ("data-is-a-file", train("data.source={tmp}/afile"), "is a file, not a dataset directory"),
    ("data-not-prepared", train("data.source={tmp}/empty"), "holds no complete prepared dataset"),
    ("data-file-changed-same-size", train("data.source={tmp}/scrambled", "model.vocab_size=256"),
     "/scrambled/train.bin is not the file its meta.json describes (its CRC-32"),
    ("resume-data-prepared-again", train("train.resume={shared}/redata_run/checkpoints/step_00000002",
                                         "data.source={shared}/redata", "model.vocab_size=256", "data.val_every=0"),
     ("was trained on other data: train.bin", "train.allow_changed=data")),
    ("data-too-short", train("data.source={shared}/small", "model.vocab_size=256"),
     "training tokens, fewer than one window of train.seq_len+1 = 33"),
    ("data-no-val", train("data.source={shared}/noval", "model.vocab_size=256"),
     "validation tokens, fewer than one window"),
    ("data-vocab", train("data.source={shared}/data"), "model.vocab_size=64; set model.vocab_size>=256"),
    ("stdlib-vocab", train("data.source=stdlib"), "data.source=stdlib (byte tokens) has token ids up to 255"),
    ("out-dir-is-a-file", train("logging.out_dir={tmp}/afile"), ("logging.out_dir=", "afile is a file; give a dir")),
    ("out-dir-under-a-file", train("logging.out_dir={tmp}/afile/run"), ("logging.out_dir=", "afile is a file, not a")),
    ("checkpoint-dir-is-a-file", train("checkpoint.dir={tmp}/afile"), ("checkpoint.dir=", "afile is a file; give a")),
    ("key-of-another-section", train("train.lr=0.1"),
     "train.lr: Key 'lr' not in 'TrainConfig'; did you mean optimizer.lr?"),
    ("zero-stage-under-train", train("train.zero_stage=1"), "did you mean optimizer.zero_stage?"),
    ("out-dir-unwritable", train("logging.out_dir=/proc/pipekit-nowhere/run"),
     "logging.out_dir=/proc/pipekit-nowhere/run cannot be written: No such file or directory"),
    ("resume-missing", train("train.resume={tmp}/nothing-here"), "does not exist; give a checkpoint directory"),
    ("resume-is-a-file", train("train.resume={tmp}/afile"), "is a file, not a checkpoint directory"),
    # ---- train: checkpoints (the shared run saved one at step 2) and a diverging run
    ("resume-incomplete", train("train.resume={tmp}/ckpt_nometa"), "is not a complete pipekit checkpoint"),
    ("resume-bad-json", train("train.resume={tmp}/ckpt_badjson"), "pipekit.json is unreadable"),
    ("resume-manifest-without-files", train("train.resume={tmp}/ckpt_nofiles", "logging.out_dir=null"),
     ("ckpt_nofiles is damaged: pipekit.json records no file digests", "cannot be checked")),
    ("resume-manifest-missing-an-entry", train("train.resume={tmp}/ckpt_unlisted", "logging.out_dir=null"),
     ("ckpt_unlisted is damaged: __", ".distcp has no recorded digest in pipekit.json")),
    ("resume-truncated", train("train.resume={tmp}/ckpt_truncated", "logging.out_dir=null"),
     ("ckpt_truncated is damaged: __", ".distcp holds 100 bytes but", "(truncated or overwritten)")),
    ("resume-other-model", train("train.resume={shared}/run/checkpoints/step_00000002", "model.dim=32"),
     "was saved from another model (toy: dim=64 (this config: 32))"),
    ("resume-past-steps", train("train.resume={shared}/run/checkpoints/step_00000002", "train.steps=1"),
     "the checkpoint is at step 2, past train.steps=1"),
    ("resume-auto-other-model", train("logging.out_dir={shared}/run", "train.resume=auto", "model.dim=32"),
     ("train.resume=auto", "step_00000002 was saved from another model")),
    ("out-dir-holds-a-run", train("logging.out_dir={shared}/run"),
     ("holds another run (metrics.jsonl, model.pt, checkpoints)", "train.resume=auto")),
    # ---- train: resume (issue 18): a resume never writes into another run, nor becomes another run unasked
    ("resume-auto-finds-nothing",
     train("logging.out_dir={shared}/run", "train.resume=auto", "checkpoint.dir={tmp}/empty"),
     ("train.resume=auto found no checkpoint in", "empty, but logging.out_dir=", "holds another run (metrics.jsonl")),
    ("resume-another-runs-checkpoint-into-a-run",
     train("train.resume={shared}/run/checkpoints/step_00000002", "logging.out_dir={tmp}/b"),
     ("step_00000002 is another run's checkpoint, but logging.out_dir=", "b holds another run (metrics.jsonl)")),
    ("resume-changed-seed", train("train.resume={shared}/run/checkpoints/step_00000002", "train.seed=1"),
     ("was saved with train.seed=0 (this config: 1), which makes this another run",
      "train.allow_changed=train.seed")),
    ("resume-changed-seq-len", train("logging.out_dir={shared}/run", "train.resume=auto", "train.seq_len=16"),
     "train.seq_len=32 (this config: 16), which makes this another run"),
    ("allow-changed-not-needed", train("train.allow_changed=optimizer.lr"),
     "train.allow_changed: 'optimizer.lr' is not a key that needs allowing"),
    ("loss-not-finite", train("optimizer.lr=1e6", "optimizer.warmup_steps=1", "optimizer.clip_grad_norm=null",
                              "logging.out_dir=null", "data.val_every=0", "train.max_skipped_steps=1"),
     "step 2: the loss is nan (training diverged): step 2 skipped, 1 in a row (train.max_skipped_steps=1)"),
    ("max-skipped-steps-zero", train("train.max_skipped_steps=0"), "train.max_skipped_steps=0 must be >= 1"),
    # ---- generate
    ("generate-missing", ["generate", "{tmp}/missing.pt", "--prompt", "x"], "no such pipekit file"),
    ("generate-corrupt", ["generate", "{tmp}/corrupt.pt", "--prompt", "x"], "not a readable pipekit model file"),
    ("generate-truncated", ["generate", "{tmp}/truncated.pt"], "not a readable pipekit model file"),
    ("generate-cut-early", ["generate", "{tmp}/cut_early.pt"], "not a readable pipekit model file"),
    ("generate-json", ["generate", "{shared}/data/meta.json"], "not a readable pipekit model file"),
    ("generate-not-a-model", ["generate", "{tmp}/list.pt"], "is not a pipekit model file"),
    ("generate-dir", ["generate", "{tmp}", "--prompt", "x"], "is a directory"),
    ("generate-negative-tokens", ["generate", "{shared}/run/model.pt", "--max-new-tokens", "-1"],
     "max_new_tokens=-1 must be >= 0"),
    ("generate-negative-temperature", ["generate", "{shared}/run/model.pt", "--temperature", "-1"],
     "temperature=-1.0 must be a finite number >= 0"),
    ("generate-nan-temperature", ["generate", "{shared}/run/model.pt", "--temperature", "nan"], "temperature=nan"),
    ("generate-negative-top-k", ["generate", "{shared}/run/model.pt", "--top-k", "-3"], "top_k=-3 must be >= 1, or 0"),
    ("generate-prompt-outside-vocab", ["generate", "{shared}/run/model.pt", "--prompt", "hello"],
     "has token ids up to 111 under the byte tokenizer"),
    # ---- prepare-data
    ("prepare-missing-input", ["prepare-data", "{tmp}/nothing-here", "--out", "{tmp}/data"],
     "neither a file nor a directory"),
    ("prepare-empty-dir", ["prepare-data", "{tmp}/empty", "--out", "{tmp}/data"], "no input files in"),
    ("prepare-undecodable", ["prepare-data", "{tmp}/binary", "--out", "{tmp}/new/data"],
     "no UTF-8 text among 1 file (1 undecodable"),
    ("prepare-empty-text", ["prepare-data", "{tmp}/empty.txt", "--out", "{tmp}/data"],
     "no UTF-8 text among 1 file (0 undecodable, 1 empty): nothing to prepare"),
    ("prepare-empty-jsonl", ["prepare-data", "{tmp}/empty.jsonl", "--out", "{tmp}/data"],
     "(0 undecodable, 1 empty): nothing to prepare"),
    ("prepare-out-is-a-file", ["prepare-data", "{tmp}/texts", "--out", "{tmp}/afile"], "is a file; give a directory"),
    ("prepare-out-under-a-file", ["prepare-data", "{tmp}/texts", "--out", "{tmp}/afile/data"], "cannot be created"),
    ("prepare-val-fraction", ["prepare-data", "{tmp}/texts", "--out", "{tmp}/data", "--val-fraction", "1.5"],
     "val_fraction must be in [0, 1), got 1.5"),
    ("prepare-seed", ["prepare-data", "{tmp}/texts", "--out", "{tmp}/data", "--seed", "-1"],
     "seed must be >= 0, got -1"),
    ("prepare-tokenizer-missing", ["prepare-data", "{tmp}/texts", "--out", "{tmp}/d", "--tokenizer", "{tmp}/nope.json"],
     "does not exist (want a HuggingFace tokenizer.json"),
    ("prepare-tokenizer-not-json", ["prepare-data", "{tmp}/texts", "--out", "{tmp}/data", "--tokenizer", "{tmp}/afile"],
     "is not a HuggingFace tokenizer.json"),
    ("prepare-out-holds-a-dataset", ["prepare-data", "{tmp}/texts", "--out", "{shared}/data"],
     "already holds a prepared dataset (meta.json); choose another --out, or pass --overwrite"),
    ("prepare-out-holds-a-users-train-bin", ["prepare-data", "{tmp}/texts", "--out", "{tmp}/mine"],
     "/mine' already holds train.bin; choose another --out, or pass --overwrite"),
    # ---- plan
    ("plan-config-pp-flag", ["plan", "{root}/configs/toy.yaml", "--pp", "4"],
     "--pp 4 applies without a CONFIG; with one, override parallel.pp=N"),
    ("plan-config-schedule", ["plan", "{root}/configs/toy.yaml", "--schedule", "zbw"], "--schedule zbw is not one of"),
    ("plan-config-microbatches", ["plan", "{root}/configs/toy.yaml", "--microbatches", "7"],
     "--microbatches 7 does not divide this run's batch per replica (32 rows); valid: [1, 2, 4, 8, 16, 32]"),
    ("plan-pp-zero", ["plan", "--schedule", "1f1b", "--pp", "0", "--microbatches", "4"], "pp must be >= 1, got 0"),
    ("plan-microbatches-zero", ["plan", "--pp", "2", "--microbatches", "0"], "microbatches must be >= 1, got 0"),
    ("plan-schedule", ["plan", "--schedule", "nope", "--pp", "2", "--microbatches", "4"], "unknown schedule 'nope'"),
    ("plan-virtual-1f1b", ["plan", "--schedule", "1f1b", "--pp", "2", "--microbatches", "4", "--virtual", "3"],
     "only interleaved_1f1b takes chunks_per_rank"),
    ("plan-cost-negative", ["plan", "--pp", "2", "--microbatches", "4", "--f-cost", "-1"],
     "cost of F must be a number >= 0"),
    ("plan-cost-nan", ["plan", "--pp", "2", "--microbatches", "4", "--b-cost", "nan"],
     "--b-cost nan must be a finite number"),
    ("plan-png-no-dir", ["plan", "--pp", "2", "--microbatches", "4",
                         "--trace", "{tmp}/t.json", "--png", "{tmp}/no/x.png"],
     "/no does not exist"),  # and t.json is not written either
    ("plan-trace-is-a-dir", ["plan", "--pp", "2", "--microbatches", "4", "--trace", "{tmp}"],
     "is a directory; give a file name"),
    # ---- convert
    ("convert-missing", ["convert", "--to-hf", "{tmp}/missing.pt", "--out", "{tmp}/hf"], "no such pipekit file"),
    ("convert-toy", ["convert", "--to-hf", "{shared}/run/model.pt", "--out", "{tmp}/hf"],
     "holds a 'toy' model, which has no Hugging Face form"),
    ("convert-to-hf-out-is-a-file", ["convert", "--to-hf", "{shared}/run/model.pt", "--out", "{tmp}/afile"],
     "is a file; give a directory for the Hugging Face model"),
    ("convert-from-missing", ["convert", "--from-hf", "{tmp}/nothing-here", "--out", "{tmp}/m.pt"],
     "does not exist; give a Hugging Face model dir"),
    ("convert-no-config", ["convert", "--from-hf", "{tmp}/empty", "--out", "{tmp}/m.pt"], "it has no config.json"),
    ("convert-model-type", ["convert", "--from-hf", "{tmp}/hf_bert", "--out", "{tmp}/m.pt"],
     "unsupported Hugging Face model_type 'bert'"),
    ("convert-config-not-json", ["convert", "--from-hf", "{tmp}/hf_notjson", "--out", "{tmp}/m.pt"],
     "config.json is not valid JSON"),
    ("convert-config-lacks-key", ["convert", "--from-hf", "{tmp}/hf_nokeys", "--out", "{tmp}/m.pt"],
     "the Hugging Face gpt2 config lacks 'n_embd'"),
    ("convert-no-weights", ["convert", "--from-hf", "{tmp}/hf_noweights", "--out", "{tmp}/m.pt"],
     "holds no model.safetensors"),
    ("convert-corrupt-weights", ["convert", "--from-hf", "{tmp}/hf_corrupt", "--out", "{tmp}/m.pt"],
     "model.safetensors is not readable: truncated, corrupt"),
    ("convert-out-exists", ["convert", "--from-hf", "{tmp}/hf_corrupt", "--out", "{tmp}/afile"],
     "exists; pass overwrite=True"),
    ("convert-out-is-a-dir", ["convert", "--from-hf", "{tmp}/hf_corrupt", "--out", "{tmp}/empty", "--overwrite"],
     "is a directory; give the pipekit file to write"),
]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """A toy model.pt trained for 2 steps in this process, and prepared byte-token datasets."""
    root = tmp_path_factory.mktemp("shared")
    texts = [root / "a.txt", root / "b.txt"]
    for i, path in enumerate(texts):
        path.write_text(TEXT * (i + 1))
    (root / "tiny.txt").write_text("hi\n")
    prepare_data([str(p) for p in texts], str(root / "data"), val_fraction=0.5)
    prepare_data([str(texts[0])], str(root / "noval"), val_fraction=0.0)
    prepare_data([str(root / "tiny.txt")], str(root / "small"), val_fraction=0.0)
    argv = [a.format(root=ROOT) for a in train(
        "data.val_every=0", f"logging.out_dir={root / 'run'}", "logging.peak_tflops=1", "logging.tensorboard=false",
        "checkpoint.every=2")]
    assert main(argv) == 0
    assert (root / "run" / "model.pt").is_file()
    prepare_data([str(texts[1])], str(root / "redata"), val_fraction=0.0)  # a run on it, then other text there
    assert main(on_data(root / "redata", root / "redata_run", "checkpoint.every=2")) == 0
    (root / "other.txt").write_text(TEXT.replace("2 * x", "3 * x") * 2)
    prepare_data([str(root / "other.txt")], str(root / "redata"), val_fraction=0.0, overwrite=True)
    return root


def on_data(dataset: Path, out_dir: Path, *overrides: str) -> list[str]:
    """A train command line of the toy model on a prepared byte-token dataset, into `out_dir`."""
    return [a.format(root=ROOT) for a in train(
        f"data.source={dataset}", "model.vocab_size=256", "data.val_every=0", f"logging.out_dir={out_dir}",
        "logging.peak_tflops=1", "logging.tensorboard=false", *overrides)]


def tmp_files(tmp: Path, shared: Path) -> None:
    """The broken and odd inputs the rows name."""
    (tmp / "afile").write_text("just a file\n")
    (tmp / "corrupt.pt").write_bytes(b"PK\x03\x04 not really a checkpoint")
    model = (shared / "run" / "model.pt").read_bytes()
    (tmp / "truncated.pt").write_bytes(model[: len(model) // 2])
    (tmp / "cut_early.pt").write_bytes(model[:5000])  # torch.load: OSError EINVAL, not a RuntimeError
    torch.save([1, 2, 3], tmp / "list.pt")
    ckpt = shared / "run" / "checkpoints" / "step_00000002"
    for name in ("ckpt_nometa", "ckpt_badjson", "ckpt_truncated", "ckpt_nofiles", "ckpt_unlisted"):
        shutil.copytree(ckpt, tmp / name)
    meta = json.loads((ckpt / "pipekit.json").read_text())
    unlisted = {k: v for k, v in meta["files"].items() if not k.endswith(".distcp")}  # lost its shards' entries
    (tmp / "ckpt_unlisted" / "pipekit.json").write_text(json.dumps({**meta, "files": unlisted}))
    del meta["files"]  # lost its list: no longer "nothing to check"
    (tmp / "ckpt_nofiles" / "pipekit.json").write_text(json.dumps(meta))
    (tmp / "ckpt_nometa" / "pipekit.json").unlink()
    (tmp / "ckpt_badjson" / "pipekit.json").write_text("{not json")
    shard = next((tmp / "ckpt_truncated").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    (tmp / "bad.yaml").write_text("model: [\n")
    (tmp / "list.yaml").write_text("- model\n- train\n")
    (tmp / "dup.yaml").write_text("train:\n  steps: 3\n  steps: 4\n")
    (tmp / "out_dir_no.yaml").write_text("logging:\n  out_dir: no\n")
    (tmp / "empty_source.yaml").write_text("data:\n  source: ''\n")
    (tmp / "model_str.yaml").write_text("model: gpt2\n")
    (tmp / "empty").mkdir()
    (tmp / "empty.txt").write_text("")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "b").mkdir()
    (tmp / "b" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (tmp / "texts").mkdir()
    (tmp / "texts" / "a.txt").write_text(TEXT)
    (tmp / "mine").mkdir()
    (tmp / "mine" / "train.bin").write_bytes(b"a user's own tokens")
    shutil.copytree(shared / "data", tmp / "scrambled")
    size = (tmp / "scrambled" / "train.bin").stat().st_size
    (tmp / "scrambled" / "train.bin").write_bytes(torch.randint(0, 256, (size,), dtype=torch.uint8).numpy().tobytes())
    (tmp / "binary").mkdir()
    (tmp / "binary" / "x.txt").write_bytes(b"\xff\xfe\x00 not UTF-8")
    for name, config in [("hf_bert", '{"model_type": "bert"}'), ("hf_notjson", "model_type: gpt2\n"),
                         ("hf_nokeys", '{"model_type": "gpt2", "vocab_size": 64}'), ("hf_noweights", GPT2_CONFIG),
                         ("hf_corrupt", GPT2_CONFIG)]:
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(config)
    (tmp / "hf_corrupt" / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")


def snapshot(*roots: Path) -> dict:
    """Every path under `roots`: a file's bytes, None for a directory."""
    return {p: (p.read_bytes() if p.is_file() else None) for root in roots for p in sorted(root.rglob("*"))}


@pytest.mark.parametrize("argv, said", [pytest.param(a, s, id=i) for i, a, s in MISTAKES])
def test_a_mistake_gets_one_line_status_2_and_changes_nothing(argv, said, shared, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PIPEKIT_DEBUG", raising=False)
    monkeypatch.setenv("PIPEKIT_CACHE", str(tmp_path / "cache"))  # a stray stdlib corpus would land here
    monkeypatch.chdir(tmp_path)  # and a stray relative out_dir (toy.yaml's runs/toy) here
    tmp_files(tmp_path, shared)
    capsys.readouterr()
    before = snapshot(tmp_path, shared)
    try:
        code = main([a.format(tmp=tmp_path, shared=shared, root=ROOT) for a in argv])
    except SystemExit as stop:  # a usage mistake, said by argparse
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    line = err.strip()
    assert line.startswith(f"pipekit {argv[0]}: ") and "\n" not in line and "Traceback" not in err, err
    assert all(piece in line for piece in ((said,) if isinstance(said, str) else said)), line
    assert snapshot(tmp_path, shared) == before  # nothing written, changed or removed


def test_the_table_covers_every_subcommand_but_env():
    assert {argv[0] for _, argv, _ in MISTAKES} == {"train", "generate", "prepare-data", "plan", "convert"}
    assert len({i for i, _, _ in MISTAKES}) == len(MISTAKES) >= 40


def test_a_change_train_allow_changed_names_is_resumed_and_listed(shared, tmp_path, capsys):
    """The other side of the resume-changed-* rows: the flag lets the run go on, and says what changed."""
    ckpt = shared / "run" / "checkpoints" / "step_00000002"
    argv = [a.format(root=ROOT) for a in train(f"train.resume={ckpt}", "train.steps=3", "train.seed=1",
                                               "train.allow_changed=train.seed", f"logging.out_dir={tmp_path}",
                                               "data.val_every=0", "logging.peak_tflops=1")]
    assert main(argv) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "changed since the checkpoint" in line]
    assert len(said) == 1 and "train.seed 0 -> 1" in said[0] and "train.steps 2 -> 3" in said[0], said


def test_a_dataset_prepared_again_resumes_with_allow_changed_data_and_says_so(shared, tmp_path, capsys):
    """The other side of the resume-data-prepared-again row."""
    ckpt = shared / "redata_run" / "checkpoints" / "step_00000002"
    assert main(on_data(shared / "redata", tmp_path, f"train.resume={ckpt}", "train.steps=3",
                        "train.allow_changed=data")) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "changed since the checkpoint" in line]
    assert len(said) == 1 and f"data (train.bin in {shared / 'redata'})" in said[0], said


def test_an_unchanged_dataset_trains_and_resumes_without_a_word_about_data(shared, tmp_path, capsys):
    first = on_data(shared / "data", tmp_path / "run", "checkpoint.every=2")
    assert main(first) == 0
    meta = json.loads((tmp_path / "run" / "checkpoints" / "step_00000002" / "pipekit.json").read_text())
    assert meta["data"]["files"] == json.loads((shared / "data" / "meta.json").read_text())["files"]
    capsys.readouterr()
    assert main(on_data(shared / "data", tmp_path / "run", "train.resume=auto", "train.steps=3")) == 0
    out = capsys.readouterr()
    said = [line for line in out.out.splitlines() if "changed since the checkpoint" in line]
    assert "resuming from" in out.out and len(said) == 1 and "data (" not in said[0], said
    assert "fingerprint" not in out.err


def test_an_older_dataset_without_a_fingerprint_trains_with_one_notice(shared, tmp_path, capsys):
    shutil.copytree(shared / "data", tmp_path / "old")
    meta = json.loads((tmp_path / "old" / "meta.json").read_text())
    del meta["files"]
    (tmp_path / "old" / "meta.json").write_text(json.dumps(meta))
    assert main(on_data(tmp_path / "old", tmp_path / "run")) == 0
    notices = [line for line in capsys.readouterr().err.splitlines() if "without a fingerprint" in line]
    assert len(notices) == 1, notices


def test_generate_without_a_prompt_starts_a_new_document(shared, capsys):
    """The default empty prompt once crashed; the model now starts after an end-of-document separator."""
    model = str(shared / "run" / "model.pt")
    assert main(["generate", model, "--max-new-tokens", "5", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert len(out) == 5 + 1  # five byte tokens (ids below the toy's 64) and print's newline; no separator
    assert main(["generate", model, "--max-new-tokens", "3", "--top-k", "0", "--prompt", "12"]) == 0  # 0: no top-k
    assert capsys.readouterr().out.startswith("12")


@pytest.mark.parametrize("argv, said", [
    (["plan", "--pp", "two", "--microbatches", "2"], "pipekit plan: argument --pp: invalid int value: 'two'"),
    (["env", "extra"], "pipekit env: unrecognized arguments: extra"),
    ([], "pipekit: the following arguments are required: command"),
    (["train", "--max-restarts", "x"], "pipekit train: argument --max-restarts: 'x' is not a whole number"),
])
def test_a_usage_mistake_is_one_line_too(argv, said, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.strip().startswith(said) and "\n" not in err.strip(), err


def test_train_resume_takes_a_checkpoints_root(shared):
    """train.resume=<run>/checkpoints (as generate and convert take it) resumes from its newest complete
    checkpoint, which is this run's own when out_dir is that run's."""
    from pipekit.config import load_config
    from pipekit.run.resume import resume_path
    from pipekit.run.rundirs import out_dir_taken

    run = shared / "run"
    cfg = load_config(str(ROOT / "configs/toy.yaml"), [f"train.resume={run / 'checkpoints'}", f"logging.out_dir={run}",
                                                       "parallel.pp=1", "train.steps=4"])
    assert resume_path(cfg) == str(run / "checkpoints" / "step_00000002")
    assert out_dir_taken(cfg) is None


def _toy_run_with_checkpoints(shared: Path, tmp_path: Path, *steps: int) -> Path:
    """A copy of the shared run whose checkpoints are step_2's bytes under the names of `steps`."""
    run = tmp_path / "run"
    shutil.copytree(shared / "run", run)
    for step in steps:
        if step != 2:
            shutil.copytree(run / "checkpoints" / "step_00000002", run / "checkpoints" / f"step_{step:08d}")
    return run


def test_a_damaged_newest_checkpoint_is_passed_over_in_one_line_naming_what_it_lacks(shared, tmp_path, capsys):
    run = _toy_run_with_checkpoints(shared, tmp_path, 2, 4, 6)
    (run / "checkpoints" / "step_00000006" / "pipekit.json").unlink()
    (run / "checkpoints" / "step_00000004" / ".metadata").unlink()
    argv = [a.format(root=ROOT) for a in train(f"logging.out_dir={run}", "train.resume=auto", "train.steps=3",
                                               "data.val_every=0", "logging.tensorboard=false")]
    assert main(argv) == 0
    out = capsys.readouterr()
    ckpts = run / "checkpoints"
    said = [line for line in out.err.splitlines() if "passing over" in line]
    assert said == [f"pipekit: passing over newer checkpoints that are not complete: step_00000006 (it lacks "
                    f"pipekit.json), step_00000004 (it lacks .metadata); using {ckpts / 'step_00000002'}, the newest "
                    f"complete one"], out.err
    assert f"resuming from {ckpts / 'step_00000002'} (step 2)" in out.out


def test_resume_auto_without_a_checkpoint_says_it_starts_at_step_0(tmp_path, capsys):
    argv = [a.format(root=ROOT) for a in train(f"logging.out_dir={tmp_path / 'run'}", "train.resume=auto",
                                               "train.steps=1", "data.val_every=0", "logging.tensorboard=false")]
    assert main(argv) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "train.resume=auto" in line]
    assert said == [f"pipekit: train.resume=auto: no checkpoint under {tmp_path / 'run' / 'checkpoints'} yet; "
                    f"starting at step 0"], said


def test_a_checkpoints_root_given_to_generate_says_which_damaged_ones_it_passed_over(shared, tmp_path, capsys):
    from pipekit.interchange import checkpoint_dir

    ckpts = _toy_run_with_checkpoints(shared, tmp_path, 2, 4) / "checkpoints"
    (ckpts / "step_00000004" / "pipekit.json").unlink()
    assert checkpoint_dir(str(ckpts)) == str(ckpts / "step_00000002")
    assert capsys.readouterr().err.strip() == (f"pipekit: passing over newer checkpoints that are not complete: "
                                               f"step_00000004 (it lacks pipekit.json); using "
                                               f"{ckpts / 'step_00000002'}, the newest complete one")
    assert checkpoint_dir(str(ckpts), say=False) == str(ckpts / "step_00000002")
    assert capsys.readouterr().err == ""


def test_a_damaged_checkpoint_names_the_previous_complete_one(shared, tmp_path):
    from pipekit.checkpoint import CheckpointError, read_meta

    ckpts = _toy_run_with_checkpoints(shared, tmp_path, 2, 4) / "checkpoints"
    (ckpts / "step_00000004" / "pipekit.json").write_text('{"step": 4, "fam')  # cut short
    with pytest.raises(CheckpointError, match=f"unreadable .*; the previous complete checkpoint is "
                                              f"{ckpts / 'step_00000002'}: continue from it"):
        read_meta(str(ckpts / "step_00000004"))
    (ckpts / "step_00000004" / "pipekit.json").unlink()
    with pytest.raises(CheckpointError, match="it lacks pipekit.json; an interrupted save .*; the previous complete "
                                              "checkpoint is"):
        read_meta(str(ckpts / "step_00000004"))


def test_a_restart_continues_what_this_launch_saved_else_where_it_started(shared, tmp_path, monkeypatch):
    """A rollback (train.resume=<an older step>) whose workers die before the first save: the
    restart starts from that older step again, never from the newest checkpoint of the branch
    being left; once this launch has saved, from its newest save."""
    from pipekit.config import load_config
    from pipekit.run.resume import resume_path

    run = _toy_run_with_checkpoints(shared, tmp_path, 2, 4, 6)
    ckpts = run / "checkpoints"
    cfg = load_config(str(ROOT / "configs/toy.yaml"), [f"train.resume={ckpts / 'step_00000002'}",
                                                       f"logging.out_dir={run}", "parallel.pp=1"])
    monkeypatch.setenv("PIPEKIT_LAUNCH", "rollback")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert resume_path(cfg) == str(ckpts / "step_00000002")  # 4 and 6 are the old branch's
    meta = json.loads((ckpts / "step_00000004" / "pipekit.json").read_text())
    (ckpts / "step_00000004" / "pipekit.json").write_text(json.dumps({**meta, "launch": "rollback"}))
    assert resume_path(cfg) == str(ckpts / "step_00000004")  # this launch's own save
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert resume_path(cfg) == str(ckpts / "step_00000002")  # a first attempt: where it was told


def test_a_disk_that_fills_after_launch_is_one_line_naming_the_file(shared, tmp_path, monkeypatch, capsys):
    """Python reports a failed write to an open file without its name; the metrics file's says it."""
    import errno

    from pipekit.run import metrics

    class Full:  # a metrics.jsonl whose disk fills after the first record
        def __init__(self, file):
            self.file, self.writes = file, 0

        def write(self, text):
            self.writes += 1
            if self.writes > 1:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.file.write(text)

        def __getattr__(self, name):
            return getattr(self.file, name)

    opened = metrics._metrics_file
    monkeypatch.setattr(metrics, "_metrics_file", lambda path, start: (Full(opened(path, start)[0]), []))
    out = tmp_path / "run"
    argv = [a.format(root=ROOT) for a in train(f"logging.out_dir={out}", "train.steps=3", "logging.log_every=1",
                                               "data.val_every=0", "logging.tensorboard=false")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"no space left on device to write {out / 'metrics.jsonl'} (" in err, err


ENV_MISTAKES = [  # (id, environment, argv, what the one line must say): PIPEKIT_* variables, read when used
    ("kernels-env-nonsense", {"PIPEKIT_KERNELS": "nonsense"}, train(), "PIPEKIT_KERNELS='nonsense' is not one of"),
    ("kernels-env-triton-on-cpu", {"PIPEKIT_KERNELS": "triton", "TRITON_INTERPRET": "0"}, train("train.device=cpu"),
     "PIPEKIT_KERNELS=triton "),
    ("timeout-env-not-a-number", {"PIPEKIT_TIMEOUT": "abc"}, train(),
     "PIPEKIT_TIMEOUT='abc' must be a finite number of seconds > 0"),
    ("timeout-env-zero", {"PIPEKIT_TIMEOUT": "0"}, train(), "PIPEKIT_TIMEOUT='0' must be a finite number of seconds"),
]


@pytest.mark.parametrize("env, argv, said", [pytest.param(e, a, s, id=i) for i, e, a, s in ENV_MISTAKES])
def test_a_bad_environment_variable_gets_one_line_status_2(env, argv, said, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PIPEKIT_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    before = snapshot(tmp_path)
    assert main([a.format(root=ROOT) for a in argv]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("pipekit train: ") and "\n" not in line and said in line, line
    assert snapshot(tmp_path) == before


def test_a_bad_environment_variable_is_not_read_at_import():
    """PIPEKIT_TIMEOUT is read when a group or an engine is made, not when pipekit is imported."""
    import pipekit.topology as topology

    assert not hasattr(topology, "DEFAULT_TIMEOUT")


def test_pipekit_kernels_reaches_a_run_that_leaves_model_kernels_unset(monkeypatch):
    from pipekit.config import load_run

    monkeypatch.setenv("PIPEKIT_KERNELS", "torch")
    assert load_run(str(ROOT / "configs/toy.yaml"), ["parallel.pp=1"]).config.model.kernels is None  # workers: env
    assert load_run(str(ROOT / "configs/toy.yaml"), ["parallel.pp=1", "model.kernels=auto"]).config.model.kernels \
        == "auto"  # the config's choice wins


def test_a_checkpoint_dir_inside_a_live_run_is_refused_even_with_overwrite(shared, tmp_path, capsys, monkeypatch):
    """The live run locks its out_dir; a newcomer whose checkpoint.dir lies inside it takes that same lock."""
    import fcntl

    monkeypatch.chdir(tmp_path)
    live = tmp_path / "live"
    (live / "checkpoints").mkdir(parents=True)
    (live / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    with open(live / ".pipekit.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        before = snapshot(tmp_path)
        for ck in (live / "checkpoints", tmp_path / "." / "live" / "checkpoints" / ".." / "checkpoints"):
            argv = [a.format(root=ROOT) for a in train(f"checkpoint.dir={ck}", "logging.overwrite=true",
                                                      f"logging.out_dir={tmp_path / 'newcomer'}")]
            assert main(argv) == 2
            line = capsys.readouterr().err.strip()
            assert "another pipekit run is writing to checkpoint.dir=" in line and "\n" not in line, line
        assert snapshot(tmp_path) == before


NOTICES = [  # (overrides, the notice line): a key that does nothing in this run is said once, never refused
    (["optimizer.momentum=0.9"], "optimizer.momentum=0.9 has no effect: momentum is SGD's; optimizer.name=adamw"),
    (["optimizer.reshard_after_forward=true", "optimizer.zero_stage=1"],
     "optimizer.reshard_after_forward=true has no effect: only ZeRO-3 gathers parameters, and optimizer.zero_stage=1"),
    (["fp16.hysteresis=4"], "fp16.hysteresis=4 has no effect: loss scaling is for train.precision=fp16"),
    (["fp16.loss_scale=128"], "fp16.loss_scale=128.0 has no effect: loss scaling is for train.precision=fp16"),
    (["model.family=mixtral", "model.token_drop_policy=probs"],
     "model.token_drop_policy=probs has no effect: tokens are dropped only over a capacity"),
    (["model.family=gpt2", "model.global_balance=true"],
     "model.global_balance=true has no effect: the gpt2 model here is dense (no model.n_experts)"),
    (["model.family=gpt2", "parallel.sequence_parallel=true"], "parallel.sequence_parallel=true has no effect"),
    (["model.lora.alpha=32"], "model.lora.alpha=32.0 has no effect: model.lora.rank=0 adds no adapters"),
    (["train.allow_changed=train.seed"], "train.allow_changed=train.seed has no effect: it applies on resume"),
]


@pytest.mark.parametrize("overrides, said", NOTICES)
def test_a_key_without_effect_gets_one_notice_and_the_run_goes_on(overrides, said, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["train", *overrides, "parallel.pp=1", "--show"]
    assert main(argv) == 0
    notices = [line for line in capsys.readouterr().err.splitlines() if "notice:" in line]
    assert len(notices) == 1 and notices[0].startswith(f"pipekit: notice: {said}"), notices


def test_a_key_without_effect_is_said_once_to_a_python_caller_and_once_by_the_command(tmp_path, capsys):
    from pipekit.config import load_config
    from pipekit.run.loop import train as train_in_process

    quick = [a.format(root=ROOT) for a in train("optimizer.momentum=0.9", "train.steps=1", "data.val_every=0",
                                                "logging.tensorboard=false")]
    train_in_process(load_config(quick[1], [*quick[2:], f"logging.out_dir={tmp_path / 'api'}"]))
    assert main([*quick, f"logging.out_dir={tmp_path / 'cli'}"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "notice:" in line]
    assert said == ["pipekit: notice: optimizer.momentum=0.9 has no effect: momentum is SGD's; optimizer.name=adamw "
                    "uses optimizer.beta1"] * 2, said


def test_no_notice_for_keys_that_do_something_or_were_not_set(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for argv in (["train", str(ROOT / "configs/toy.yaml")],
                 ["train", "optimizer.name=sgd", "optimizer.momentum=0.9", "parallel.pp=1"],
                 ["train", "train.precision=fp16", "fp16.hysteresis=4", "parallel.pp=1"],
                 ["train", "optimizer.zero_stage=3", "optimizer.reshard_after_forward=true", "parallel.pp=1"]):
        assert main([*argv, "--show"]) == 0
        assert "notice:" not in capsys.readouterr().err, argv
