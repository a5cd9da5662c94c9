"""Communication lanes: a forward and a backward that run at once never share a process group.

An OVERLAP action (`pipekit.schedules.ir`) runs a forward of one microbatch beside a
backward of another, on two threads, so that the collectives inside one (the MoE
all-to-all, a tensor-parallel all-reduce) hide behind the other's compute. Collectives
on one group must be issued in the same order on every member, and two threads give
no order. So while an engine runs overlapped actions, every collective inside the
model goes through `lane(group)`: a forward uses the group itself, a backward (any
code the autograd engine runs, a checkpointed recomputation included) its twin, a
second group of the same ranks (`Topology.backward_twins`). Each lane's collectives
then come in program order on every rank, as they do without overlap.

Without twins registered `lane` returns its argument: nothing changes.
"""

from __future__ import annotations

import torch

_twins: dict = {}  # process group -> its backward twin


def use_backward_twins(twins: dict) -> None:
    """From now on backward passes in this process communicate over `twins[group]` for each group."""
    _twins.update(twins)


def lane(group):
    """The group a collective on `group` uses here: its backward twin inside a backward pass
    (when one is registered), else `group`."""
    if group is None or not _twins or torch._C._current_graph_task_id() == -1:
        return group
    return _twins.get(group, group)
