"""The schedule IR, generators, lowering, validation, simulation and drawing.

Pure Python (no torch): generate -> lower -> validate -> simulate are
separate functions over plain ints and `Action` lists, so everything here is
tested and drawn without processes. A `Schedule` (validated when made, with
its placement of virtual stages on ranks; `program.py`) is the one description
of a pipeline program: `PipelineModule(schedule=schedule)` builds the stages it
places on this rank, the engine executes `Schedule.ranks`, the simulator and
the renderers draw it.
"""

from .build import build_schedule, load_schedule, parse_table, plan_report, schedule_from_table
from .generators import (
    SCHEDULES,
    Generator,
    dualpipe_v,
    generate,
    gpipe,
    interleaved_1f1b,
    one_f_one_b,
    register_schedule,
    zb_h1,
    zbv,
)
from .ir import Action, Kind, ScheduleError
from .lowering import lower
from .placement import PLACEMENTS, looping_placement, resolve_placement, v_placement
from .program import Schedule
from .render import render_png, render_text, to_chrome_trace
from .simulate import SimResult, TimelineEvent, mean_costs, simulate
from .validate import validate

__all__ = [
    "Action",
    "Generator",
    "Kind",
    "PLACEMENTS",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "TimelineEvent",
    "build_schedule",
    "dualpipe_v",
    "generate",
    "gpipe",
    "interleaved_1f1b",
    "load_schedule",
    "looping_placement",
    "lower",
    "mean_costs",
    "one_f_one_b",
    "parse_table",
    "plan_report",
    "register_schedule",
    "render_png",
    "render_text",
    "resolve_placement",
    "schedule_from_table",
    "simulate",
    "to_chrome_trace",
    "v_placement",
    "validate",
    "zb_h1",
    "zbv",
]
