"""Which run owns a directory: a run's `logging.out_dir` (and `checkpoint.dir`) are locked by
every process of the run for its whole life (`hold_run_dirs`), another run's files there are
refused unless this run continues it (`out_dir_taken`), and a run that wrote nothing leaves
nothing behind (`leave_no_trace`).

One function decides whose a directory is, whatever path names it (`owner`): the real path's
nearest enclosing run directory (one holding a run's lock or files), else the directory itself.
So a checkpoint.dir inside another run's out_dir is locked by that out_dir's lock, and a
run's own default {out_dir}/checkpoints by its out_dir's."""

from __future__ import annotations

import os

from .resume import checkpoint_root, is_own, resume_path

RUN_FILES = ("metrics.jsonl", "model.pt", "checkpoints")


OWNER_MARKS = (".pipekit.lock", "metrics.jsonl", "model.pt")  # what makes a directory a run's


def _enclosing_run(path: str) -> str | None:
    """The nearest directory strictly above `path`'s real path that holds a run (OWNER_MARKS), or None."""
    d = os.path.realpath(path)
    while os.path.dirname(d) != d:
        d = os.path.dirname(d)
        if any(os.path.exists(os.path.join(d, mark)) for mark in OWNER_MARKS):
            return d
    return None


def owner(path: str) -> str:
    """The directory whose lock guards `path`: its nearest enclosing run directory, else `path`
    itself (real paths: a symlink or `..` names the same owner)."""
    return _enclosing_run(path) or os.path.realpath(path)


def _checkpoint_dir_taken(cfg) -> str | None:
    """Why checkpoint.dir must not be written: it lies inside another run's directory (not this
    run's out_dir), this run does not resume from a checkpoint there, and logging.overwrite is not set."""
    ck, out = cfg.checkpoint.dir, cfg.logging.out_dir
    if not ck or cfg.logging.overwrite:
        return None
    other = _enclosing_run(ck)
    if other is None or (out and other == os.path.realpath(out)):
        return None
    chosen = resume_path(cfg) if cfg.train.resume is not None else None
    if chosen is not None and os.path.realpath(chosen).startswith(other + os.sep):
        return None  # continuing that run's checkpoints
    found = [f for f in (*RUN_FILES, ".pipekit.lock") if os.path.exists(os.path.join(other, f))]
    return (f"checkpoint.dir={ck} lies in another run's directory {other} ({', '.join(found)}); choose a "
            f"checkpoint.dir outside it, continue that run with logging.out_dir={other} train.resume=auto, or pass "
            "logging.overwrite=true to replace it")


def out_dir_taken(cfg) -> str | None:
    """Why this run must not write into `logging.out_dir`: another run's files are there, this
    run does not continue that run (it starts fresh, `train.resume=auto` finds no checkpoint of
    it, or `train.resume` names another run's checkpoint) and `logging.overwrite` is not set;
    or None."""
    out = cfg.logging.out_dir
    if (ck := _checkpoint_dir_taken(cfg)) is not None:
        return ck
    if not out or cfg.logging.overwrite or not os.path.isdir(out):
        return None
    found = [f for f in RUN_FILES if os.path.exists(os.path.join(out, f))]
    if not found:
        return None
    held, resume = f"logging.out_dir={out} holds another run ({', '.join(found)})", cfg.train.resume
    replace = "choose another logging.out_dir, or pass logging.overwrite=true to replace it"
    if resume is None:
        return f"{held}; continue it with train.resume=auto, {replace}"
    if resume == "auto" and resume_path(cfg) is None:
        return (f"train.resume=auto found no checkpoint in {checkpoint_root(cfg)}, but {held}; give train.resume "
                f"that run's checkpoint (or the checkpoint.dir it used), {replace}")
    if resume != "auto" and not is_own(cfg, resume_path(cfg) or resume):  # a checkpoints root: its newest
        return f"train.resume={resume} is another run's checkpoint, but {held}; {replace}"
    return None


def run_dirs(cfg) -> list[tuple[str, str, str]]:
    """(key, path, owner) of the directories a run writes, logging.out_dir and checkpoint.dir,
    each with the directory whose lock guards it (`owner`); a path whose owner an earlier one
    already has (the default {out_dir}/checkpoints, a checkpoint.dir inside out_dir) is left out."""
    dirs: list[tuple[str, str, str]] = []
    for key, path in (("logging.out_dir", cfg.logging.out_dir), ("checkpoint.dir", cfg.checkpoint.dir)):
        if not path:
            continue
        mine = [d for _, _, d in dirs]
        lock = owner(path)
        if lock not in mine and not any(lock.startswith(d + os.sep) for d in mine):
            dirs.append((key, path, lock))
    return dirs


def _taken_by_another(key: str, path: str) -> str:
    return f"another pipekit run is writing to {key}={path}; wait for it or choose another {key}"


def held_by_a_live_run(cfg) -> str | None:
    """Why a live run holds one of this run's directories (said before anything is judged from
    the files it is still writing), or None. Reads only: a lock file that is not there is not made."""
    try:
        import fcntl
    except ImportError:
        return None
    for key, path, lock_dir in run_dirs(cfg):
        lock = os.path.join(lock_dir, ".pipekit.lock")
        if os.path.isfile(lock):
            with open(lock) as handle:
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:
                    return _taken_by_another(key, path)
    return None


def hold_run_dirs(cfg) -> list | str:
    """Lock the directories this run writes (`run_dirs`, each by its `.pipekit.lock`) for the
    life of this process: the open lock files, or the reason another live run holds one.
    Nothing is locked where file locks are unavailable. Taken after every other pre-launch
    check has passed.

    A run is admitted by an exclusive lock (no process of another run holds one): the only
    process, a user's torchrun's rank 0 (its other ranks lock nothing; torchrun stops them
    together), or this command's launcher, which then shares its lock with its workers. Each
    of those workers holds a shared lock too, so the run's directories stay taken while any
    of its processes lives, the launcher killed or not (see `_die_with_launcher`)."""
    try:
        import fcntl
    except ImportError:  # not on this platform: no lock
        return []
    ours = "PIPEKIT_ERROR_DIR" in os.environ  # a worker of this command's launcher
    if "RANK" in os.environ and not ours and os.environ["RANK"] != "0":
        return []
    shares = ours or (cfg.world_size > 1 and "RANK" not in os.environ)
    held: list = []
    for key, path, lock_dir in run_dirs(cfg):
        try:
            os.makedirs(path, exist_ok=True)
            handle = open(os.path.join(lock_dir, ".pipekit.lock"), "a")
        except OSError as e:  # a read-only or special file system, no permission
            for h in held:
                h.close()
            return (f"{key}={path} cannot be written: {e.strerror or e} ({e.filename or path}); give a directory "
                    f"this user can create and write")
        held.append(handle)
        try:
            fcntl.flock(handle, (fcntl.LOCK_SH if ours else fcntl.LOCK_EX) | fcntl.LOCK_NB)
            if shares and not ours:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            for h in held:
                h.close()
            return _taken_by_another(key, path)
    return held


def dirs_to_make(cfg) -> list[str]:
    """The directories taking this run's locks will create (a run dir and its missing parents),
    deepest first."""
    made = []
    for _, path, _ in run_dirs(cfg):
        d = os.path.abspath(path)
        while not os.path.exists(d):
            made.append(d)
            d = os.path.dirname(d)
    return made


def leave_no_trace(made: list[str]) -> None:
    """After a run that wrote nothing (refused, or failed before its first file): remove the
    lock files and the directories it made for them, so a refused run leaves no out_dir
    holding only `.pipekit.lock`. A directory holding anything else is kept."""
    for d in made:
        lock = os.path.join(d, ".pipekit.lock")
        try:
            if os.path.exists(lock) and os.listdir(d) == [".pipekit.lock"]:
                os.remove(lock)
            os.rmdir(d)  # only when empty
        except OSError:
            pass
