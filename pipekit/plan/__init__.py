"""`pipekit plan`: what a run will cost before it runs.

    profiler.py  each layer's forward/backward/weight-gradient time (measured, or FLOPs on meta),
                 the bytes it saves, message costs
    planner.py   every schedule x partition x microbatch count simulated with those costs
    memory.py    each candidate's bytes per rank (parameters, gradients, optimizer state,
                 activations) for every ZeRO stage x sequence parallelism x checkpointing
    command.py   what `pipekit plan` prints and writes
"""

from .memory import MemoryRow, memory_plan, planned_activations
from .planner import Candidate, plan, predict
from .profiler import CommModel, Profile, flop_layers, profile_layers

__all__ = ["plan", "predict", "Candidate", "memory_plan", "planned_activations", "MemoryRow",
           "profile_layers", "flop_layers", "Profile", "CommModel"]
