"""What the workers of `pipekit train`'s launcher tell it, as files in the directory it names
in PIPEKIT_ERROR_DIR: an error (`attempt{A}-rank{R}.json`), a stop request received
(`stopping-attempt{A}-rank{R}.json`), a stop done (`stopped-attempt{A}-rank{R}.json`, with the
exit status the run earned), and, from the launcher, how many stop signals it passed on
(`forwarded`). `read` is the one place names are parsed: anything else there (a temporary
file of a write a kill cut short) is not a report."""

from __future__ import annotations

import json
import os
import re

from ..atomic import write_atomic

_NAME = re.compile(r"^(?:(?P<kind>stopping|stopped)-)?attempt(?P<attempt>\d+)-rank(?P<rank>\d+)\.json$")
FORWARDED = "forwarded"


def directory() -> str | None:
    """The launcher's report directory, when this process is a worker whose launcher is alive to read it."""
    found = os.environ.get("PIPEKIT_ERROR_DIR")
    return found if found and str(os.getppid()) == os.environ.get("PIPEKIT_LAUNCHER_PID") else None


def write(kind: str, record: dict) -> bool:
    """Tell the launcher `record` ("error", "stopping" or "stopped"); False when there is none to tell."""
    found = directory()
    if found is None:
        return False
    name = (f"{kind}-" if kind != "error" else "") + (f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
                                                      f"-rank{os.environ.get('RANK', '0')}.json")
    write_atomic(os.path.join(found, name), json.dumps(record))
    return True


def read(reports: str, kind: str = "error") -> dict[int, list[dict]]:
    """{attempt: [record, ...]} of the complete reports of `kind` in `reports`."""
    found: dict[int, list[dict]] = {}
    for name in os.listdir(reports):
        m = _NAME.match(name)
        if not m or (m["kind"] or "error") != kind:
            continue
        try:
            with open(os.path.join(reports, name)) as f:
                found.setdefault(int(m["attempt"]), []).append(json.load(f))
        except (OSError, ValueError):
            continue
    return found


def last(reports: str, kind: str) -> list[dict]:
    """The reports of `kind` from the last attempt that left any."""
    found = read(reports, kind)
    return found[max(found)] if found else []


def note_forward(reports: str) -> None:
    """The launcher got a stop signal, which it passes on to its workers."""
    write_atomic(os.path.join(reports, FORWARDED), str(forwards(reports) + 1))


def forwards(reports: str | None = None) -> int:
    """How many stop signals the launcher has passed on (0 outside one)."""
    reports = reports or directory()
    if reports is None:
        return 0
    try:
        with open(os.path.join(reports, FORWARDED)) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 0
