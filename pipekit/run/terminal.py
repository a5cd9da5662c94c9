"""Output that outlives its terminal: after a hang-up (a closed terminal or SSH session), a
write to stdout or stderr fails with EIO (a pipe whose reader is gone: EPIPE). A run must not
die of its own progress line while it saves: `surviving_hangup` makes such a write point the
stream at /dev/null and carry on (the run's files, metrics.jsonl and the checkpoints, are
written as before), and `detach_from_closed_terminal` does the same for both streams when
SIGHUP comes first."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import sys

_GONE = (errno.EIO, errno.EPIPE, errno.ENXIO)  # a hung-up terminal, a pipe with no reader


def _to_devnull(fd: int) -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def _is_terminal(fd: int) -> bool:
    """A terminal, hung up or not (isatty asks the terminal, and a hung-up one does not answer)."""
    try:
        if os.isatty(fd):
            return True
        mode, rdev = os.fstat(fd).st_mode, os.fstat(fd).st_rdev
    except OSError:
        return False
    return stat.S_ISCHR(mode) and rdev != os.stat(os.devnull).st_rdev


def detach_from_closed_terminal() -> None:
    """Point stdout and stderr that are a terminal (hung up or not) at /dev/null."""
    for fd in (1, 2):
        if _is_terminal(fd):
            _to_devnull(fd)


class _Surviving:
    """A text stream whose writes after its terminal or reader is gone go to /dev/null instead of raising."""

    def __init__(self, stream):
        self._stream = stream

    def _gone(self, e: OSError) -> None:
        if e.errno not in _GONE:
            raise e
        with contextlib.suppress(OSError, ValueError):
            _to_devnull(self._stream.fileno())

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as e:
            self._gone(e)
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as e:
            self._gone(e)
            with contextlib.suppress(OSError):
                self._stream.flush()  # what was buffered, now to /dev/null

    def __getattr__(self, name):
        return getattr(self._stream, name)


@contextlib.contextmanager
def surviving_hangup():
    """sys.stdout and sys.stderr, for the duration, outlive their terminal (see the module)."""
    old = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Surviving(sys.stdout), _Surviving(sys.stderr)
    try:
        yield
    finally:
        sys.stdout, sys.stderr = old
