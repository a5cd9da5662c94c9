"""pipekit: pipeline, tensor and data parallelism and Mixture-of-Experts for PyTorch, small and tested.

The library: a model is a list of `LayerSpec`s; `partition` cuts it into stages;
`PipelineModule` builds this rank's stage chunk(s); `PipelineEngine` runs a schedule
from `pipekit.schedules` (GPipe, 1F1B, interleaved, ZB-H1, ZBV, DualPipe-V) over
`torch.distributed`, with `ZeroOptimizer` (`pipekit.optim`, stages 0-3) stepping it.
Layers, MoE and kernels live in `layers/`, `moe/`, `kernels/`; the zoo in `models/`.

The application sits on top, in rooms of its own: `pipekit.run` (the `train` command)
and `pipekit.plan` (the `plan` command); `pipekit.cli` only parses arguments.
"""

import importlib
import importlib.abc
import importlib.util
import os
import signal
import sys
import threading
import time


def _importing(frame) -> bool:
    """Whether `frame` runs inside an import (a module's top level, or a C extension's start-up)."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


class _HeldInterrupts:
    """Ctrl-C while a module is being imported is held until that import is done, then delivered
    (to whoever handles SIGINT by then: Python's KeyboardInterrupt, torchrun's handler, the
    run's stop requests). A KeyboardInterrupt raised inside an import leaves it half made:
    torch's and numpy's C start-up then fail later ("cannot load module more than once"), abort
    the process (a pybind11 error in a static initialiser) or swallow the signal outright, so
    the run trained on as if never interrupted. Installed over Python's default handler only,
    in the main thread: by `import pipekit` for its own imports (then the default is put back),
    and for the whole `pipekit` command (until torchrun or the run installs its own)."""

    def __init__(self) -> None:
        self.installed = False
        self._redelivering = False

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._handle)
            self.installed = True

    def uninstall(self) -> None:
        if self.installed and signal.getsignal(signal.SIGINT) == self._handle:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        self.installed = False

    def _handle(self, signum, frame):
        if not _importing(frame):
            raise KeyboardInterrupt
        if not self._redelivering:  # several while one import runs: one Ctrl-C, as the kernel coalesces them
            self._redelivering = True
            threading.Thread(target=self._redeliver, name="pipekit-held-interrupt", daemon=True).start()

    def _redeliver(self) -> None:
        import _thread

        main = threading.main_thread().ident
        while True:
            time.sleep(0.02)
            frame = sys._current_frames().get(main or 0)
            if frame is None or not _importing(frame):
                break
        self._redelivering = False
        _thread.interrupt_main(signal.SIGINT)  # runs the SIGINT handler in place now, in the main thread


def _is_command() -> bool:
    """This process is the `pipekit` command (or one of its launcher's workers)."""
    argv = getattr(sys, "orig_argv", sys.argv)
    return sys.argv[0].endswith("pipekit") or "pipekit.cli" in argv[1:3]


HELD_INTERRUPTS = _HeldInterrupts()
HELD_INTERRUPTS.install()


def _interrupted_while_starting() -> None:
    """Ctrl-C while the `pipekit` command imports torch with another SIGINT handler than Python's
    (so none was held): one line and exit status 130, not import machinery's traceback. A
    library user's import is left alone."""
    if not _is_command():
        return
    if "PIPEKIT_ERROR_DIR" not in os.environ:  # a worker of pipekit's launcher: the launcher says it
        sys.stderr.write("pipekit: interrupted\n")
    raise SystemExit(128 + 2)  # 128 + SIGINT


try:
    from .engine import PipelineEngine, PipelineError
    from .microbatch import Microbatches
    from .partition import partition
    from .pipeline import PipelineModule
    from .spec import LayerSpec, TiedLayerSpec
    from .topology import Topology, init_distributed
except KeyboardInterrupt:
    _interrupted_while_starting()
    raise
if not _is_command():
    HELD_INTERRUPTS.uninstall()  # a library user's handler is theirs again (one held is delivered to it)

__version__ = "0.1.0"

__all__ = [
    "LayerSpec",
    "TiedLayerSpec",
    "partition",
    "Topology",
    "init_distributed",
    "PipelineModule",
    "PipelineEngine",
    "PipelineError",
    "Microbatches",
]

# Modules that moved into the application's rooms: their old names still import (the same module object).
MOVED = {
    "pipekit.train": "pipekit.run.loop", "pipekit.launch": "pipekit.run.launch",
    "pipekit.preflight": "pipekit.run.preflight", "pipekit.rundirs": "pipekit.run.rundirs",
    "pipekit.resume": "pipekit.run.resume", "pipekit.metrics": "pipekit.run.metrics",
    "pipekit.generate": "pipekit.run.generate", "pipekit.env": "pipekit.run.env",
    "pipekit.planner": "pipekit.plan.planner", "pipekit.profiler": "pipekit.plan.profiler",
    "pipekit.memplan": "pipekit.plan.memory", "pipekit.lanes": "pipekit.comm",
    "pipekit.schedules.plan": "pipekit.schedules.build",
}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import pipekit.train` gives `pipekit.run.loop` itself (one module under two names)."""

    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in MOVED else None

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        pass


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())
