"""The schedule IR, generators, lowering, validation, simulation and drawing.

Pure Python (no torch): generate -> lower -> validate -> simulate are
separate functions over plain ints and `Action` lists, so everything here is
tested and drawn without processes. The engine executes `Schedule.ranks`.
"""

from .generators import SCHEDULES, generate, gpipe, interleaved_1f1b, looping_placement, one_f_one_b
from .ir import Action, Kind, Schedule, ScheduleError
from .lowering import lower
from .plan import build_schedule, plan_report
from .render import render_png, render_text, to_chrome_trace
from .simulate import SimResult, TimelineEvent, simulate
from .validate import validate

__all__ = [
    "Action",
    "Kind",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "TimelineEvent",
    "build_schedule",
    "generate",
    "gpipe",
    "interleaved_1f1b",
    "looping_placement",
    "lower",
    "one_f_one_b",
    "plan_report",
    "render_png",
    "render_text",
    "simulate",
    "to_chrome_trace",
    "validate",
]
