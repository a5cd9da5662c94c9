"""Checks of a config against the filesystem, made by the launcher before any worker starts.

`pipekit.config.load_run` judges values, the model and the schedule;
`check_before_launch(run)` looks at what the paths a config names hold: the
prepared dataset of `data.source` (its files read whole against the fingerprint
its meta.json records), the directories a run will write (`logging.out_dir`,
`checkpoint.dir`) and the checkpoint `train.resume` names. So a mistake a worker
would meet after launch (a missing dataset, a window longer than the data, an
out_dir that is a file) is one line and exit status 2 instead of a failed world.

It only reads: nothing is created, so a refused run leaves the disk as it was.
No torch.distributed. Limits: paths are judged from this machine (workers on
other nodes may see other filesystems), and what holds here can change before
a worker looks (another process may remove or fill a directory in between).
"""

from __future__ import annotations

import os
import sys

from ..checkpoint import CheckpointError, read_meta
from ..config import ConfigError, Run
from ..data import ByteTokenizer, DataChanged, check_files, unfingerprinted
from ..data import read_meta as read_data_meta
from ..models import model_vocab
from .resume import compare_settings, resume_path

BUILT_IN_SOURCES = ("stdlib", "synthetic")


def check_before_launch(run: Run) -> None:
    """Raise a ConfigError naming the key, the bad path and what would be valid."""
    cfg = run.config
    _check_data(run)
    _check_output_dir("logging.out_dir", cfg.logging.out_dir)
    _check_output_dir("checkpoint.dir", cfg.checkpoint.dir)
    _check_resume_path(run)


def _check_data(run: Run) -> None:
    """data.source: stdlib's byte tokens fit the model's vocabulary, or the path is a complete
    prepared dataset with a window of train.seq_len+1 tokens in each split it is sampled from."""
    cfg = run.config
    src = cfg.data.source
    if src == "synthetic":
        return
    if src == "stdlib":  # byte tokens, prepared on first use (not here: nothing is written)
        _check_vocab(run, ByteTokenizer.vocab_size, "data.source=stdlib (byte tokens)")
        return
    make = f"give {' or '.join(BUILT_IN_SOURCES)}, or a directory made by `pipekit prepare-data FILES --out DIR`"
    if not os.path.exists(src):
        raise ConfigError(f"data.source={src} does not exist; {make}")
    if not os.path.isdir(src):
        raise ConfigError(f"data.source={src} is a file, not a dataset directory; {make}")
    meta = read_data_meta(src)
    if meta is None:
        raise ConfigError(f"data.source={src} holds no complete prepared dataset (meta.json missing, stale, or not "
                          f"matching train.bin/val.bin); run `pipekit prepare-data FILES --out {src}`")
    need, tokens = cfg.train.seq_len + 1, meta["n_tokens"]
    if tokens.get("train", 0) < need:
        raise ConfigError(f"data.source={src} has {tokens.get('train', 0)} training tokens, fewer than one window of "
                          f"train.seq_len+1 = {need}; use a shorter train.seq_len or more data")
    if cfg.data.val_every > 0 and tokens.get("val", 0) < need:
        raise ConfigError(f"data.source={src} has {tokens.get('val', 0)} validation tokens, fewer than one window of "
                          f"train.seq_len+1 = {need}; prepare it with a larger --val-fraction, or set data.val_every=0")
    _check_vocab(run, int(meta["vocab_size"]), f"data.source={src}")
    _check_fingerprint(src, meta)


def _check_fingerprint(src: str, meta: dict) -> None:
    """The dataset's files are the ones its meta.json records (one read of each); an older
    dataset without a fingerprint gets one notice. Not in the workers of this command's
    launcher (PIPEKIT_ERROR_DIR), which checked before starting them."""
    if "PIPEKIT_ERROR_DIR" in os.environ:
        return
    try:
        recorded = check_files(src, meta)
    except DataChanged as e:
        raise ConfigError(f"data.source={src}: {e}") from None
    if recorded is None and os.environ.get("RANK", "0") == "0":
        print(unfingerprinted(src), file=sys.stderr, flush=True)


def _check_vocab(run: Run, data_vocab: int, what: str) -> None:
    vocab = model_vocab(run.model)
    if data_vocab > vocab:
        raise ConfigError(f"{what} has token ids up to {data_vocab - 1} (vocab_size {data_vocab}) but "
                          f"model.vocab_size={vocab}; set model.vocab_size>={data_vocab}")


def _check_output_dir(key: str, path: str | None) -> None:
    """`path` is a writable directory, or could be created as one (it is not created here)."""
    if not path:
        return
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ConfigError(f"{key}={path} is a file; give a directory (it is created when missing)")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}={path} is not writable by this user; choose another directory")
        return
    parent = _nearest_existing(path)
    if not os.path.isdir(parent):
        raise ConfigError(f"{key}={path} cannot be created: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}={path} cannot be created: {parent} is not writable by this user")


def _nearest_existing(path: str) -> str:
    """The longest prefix of `path` that exists (a directory, or a file standing in the way)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def _check_resume_path(run: Run) -> None:
    """train.resume, when a path this run would load, names an existing directory holding a
    complete checkpoint; the checkpoint it resumes from (that path, or the newest one for
    "auto" and after a restart) was saved from this config's model and run-defining settings
    (`resume.compare_settings`) and is not past train.steps."""
    cfg = run.config
    path, chosen = cfg.train.resume, resume_path(cfg)
    if path not in (None, "auto") and chosen == path:
        valid = "give a checkpoint directory such as checkpoints/step_00000100, or auto"
        if not os.path.exists(path):
            raise ConfigError(f"train.resume={path} does not exist; {valid}")
        if not os.path.isdir(path):
            raise ConfigError(f"train.resume={path} is a file, not a checkpoint directory; {valid}")
    if chosen is None:
        return
    try:
        meta = read_meta(chosen)
        compare_settings(meta, run, chosen)
    except CheckpointError as e:
        raise ConfigError(f"train.resume={path or 'auto'}: {e}") from e
    step = meta.get("step")
    if not isinstance(step, int) or step < 0:
        raise ConfigError(f"train.resume={path or 'auto'}: {chosen}/pipekit.json has no valid step ({step!r})")
    if step > cfg.train.steps:
        raise ConfigError(f"train.resume={path or 'auto'}: the checkpoint is at step {step}, past train.steps="
                          f"{cfg.train.steps}; raise train.steps to train on")
