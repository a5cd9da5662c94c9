"""pipekit: pipeline, tensor and data parallelism for PyTorch, small and tested.

The spine: a model is a list of `LayerSpec`s; `partition` cuts it into
stages; `PipelineModule` builds this rank's stage(s); `PipelineEngine` runs a
schedule (GPipe, 1F1B, interleaved 1F1B) from `pipekit.schedules` over
`torch.distributed`.
"""

from .engine import PipelineEngine, PipelineError
from .partition import partition
from .pipeline import PipelineModule
from .spec import LayerSpec, TiedLayerSpec
from .topology import Topology, init_distributed

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
]
