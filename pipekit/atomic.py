"""Every file pipekit writes is written whole or not at all.

A file is written to a temporary name in its own directory, flushed and
fsynced, then renamed over its final name (`os.replace`, atomic on POSIX), and
the directory entry is fsynced; a reader sees the old file or the new one, and
a crash leaves at worst a stray `.NAME.*.tmp`. Directories (checkpoints, a
HuggingFace export) are built under a temporary name and published the same
way by `publish_dir`.

A write that fails because the disk is full says so (`no_space_left`), whatever
form the error took on its way up (torch.save reports a short write as
`RuntimeError: ... unexpected pos`), and leaves no temporary file behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import BinaryIO


def write_atomic(path: str, data: bytes | str | Callable[[BinaryIO], None], *, replace: bool = True) -> None:
    """Write `data` (bytes, text, or a function writing to a binary file) to `path` atomically
    (`replace=False`: FileExistsError, and nothing written, when `path` exists by then)."""
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            if callable(data):
                data(fh)
            else:
                fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        publish(tmp, path, replace=replace)
    except Exception as e:
        remove(tmp)
        if no_space_left(e, parent):
            raise OSError(errno.ENOSPC, f"no space left on device to write {path} ({free_space(parent)} free "
                                        f"there)") from e
        raise
    finally:
        remove(tmp)


@contextlib.contextmanager
def naming_the_file(path: str):
    """Inside: a write to an open file `path` that fails for want of space (which Python
    reports without a file name) is an OSError naming `path` and the space left there."""
    try:
        yield
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT) and path not in str(e):
            parent = os.path.dirname(os.path.abspath(path))
            raise OSError(e.errno, f"no space left on device to write {path} ({free_space(parent)} free there); "
                                   f"free some, or point logging.out_dir elsewhere") from e
        raise


def no_space_left(e: BaseException, directory: str, needed: int = 0) -> bool:
    """Whether the write that raised `e` failed for want of space in `directory`'s file
    system: ENOSPC or EDQUOT anywhere in the exception's chain, or (for an error that lost
    its chain, as one pickled from another rank does) less than `needed` bytes free there."""
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        seen = seen.__cause__ or seen.__context__
    try:
        return needed > 0 and shutil.disk_usage(directory).free < needed
    except OSError:
        return False


def free_space(directory: str) -> str:
    """The space left to this user in `directory`'s file system, for a message ("3.2 MiB")."""
    try:
        free = float(shutil.disk_usage(directory).free)
    except OSError:
        return "unknown space"
    if free < 1024:
        return f"{free:.0f} bytes"
    for unit in ("KiB", "MiB"):
        free /= 1024
        if free < 1024:
            return f"{free:.1f} {unit}"
    return f"{free / 1024:.1f} GiB"


def torch_save_atomic(obj, path: str) -> None:
    """`torch.save(obj, path)`, atomically."""
    import torch

    write_atomic(path, lambda fh: torch.save(obj, fh))


def publish(tmp: str, path: str, *, replace: bool = True) -> None:
    """Rename a finished temporary file into place, with the permissions a plain `open` would
    give (mkstemp makes 0600), and make the rename durable. `replace=False` never replaces a
    file there: it links `tmp` as `path` (atomic, failing with FileExistsError when `path`
    exists) and removes `tmp`."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    if replace:
        os.replace(tmp, path)
    else:
        os.link(tmp, path)
        os.remove(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def publish_dir(tmp: str, path: str) -> None:
    """Rename the finished directory `tmp` to `path`; an existing `path` is moved aside first
    and removed only after the new one is in place (restored if the rename fails)."""
    if not os.path.exists(path):
        os.replace(tmp, path)
    else:
        old = f"{path}.old-{os.getpid()}"
        os.replace(path, old)
        try:
            os.replace(tmp, path)
        except BaseException:
            os.replace(old, path)
            raise
        shutil.rmtree(old, ignore_errors=True)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def fsync_dir(path: str) -> None:
    """Make renames inside directory `path` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove(path: str) -> None:
    """Remove a file if it exists."""
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
