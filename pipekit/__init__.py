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
import sys


def _interrupted_while_starting() -> None:
    """Ctrl-C while the `pipekit` command imports torch (its first second or two): one line and
    exit status 130, not import machinery's traceback. A library user's import is left alone."""
    argv = getattr(sys, "orig_argv", sys.argv)
    command = sys.argv[0].endswith("pipekit") or "pipekit.cli" in argv[1:3]
    if not command:
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
