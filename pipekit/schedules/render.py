"""Drawing timelines (simulated or measured): Chrome-trace JSON, an ASCII Gantt chart, a PNG."""

from __future__ import annotations

from .ir import Action, ScheduleError
from .simulate import TimelineEvent


def _category(action: str) -> str:
    try:
        return Action.parse(action).kind.value
    except ScheduleError:
        return "other"


def to_chrome_trace(events: list[TimelineEvent]) -> dict:
    """chrome://tracing / Perfetto JSON: one thread per rank, complete ("X") events.

    Times are read as seconds (what the engine measures) and written in
    microseconds; a simulated cost unit therefore shows as one second.
    """
    ranks = sorted({e.rank for e in events})
    names = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}}
        for r in ranks
    ]
    spans = [
        {
            "name": e.action,
            "cat": _category(e.action),
            "ph": "X",
            "pid": 0,
            "tid": e.rank,
            "ts": e.start * 1e6,
            "dur": (e.end - e.start) * 1e6,
        }
        for e in events
    ]
    return {"traceEvents": names + spans, "displayTimeUnit": "ms"}


def render_text(events: list[TimelineEvent], width: int = 100) -> str:
    """ASCII Gantt chart, one row per rank, at most `width` columns of time.

    Each action is drawn as kind and microbatch ("F3", "B12") padded with
    '-', or just its kind when its span is too narrow; idle time is '.'. When
    all times are whole numbers, each time unit gets the same whole number of
    columns so equal costs draw equally wide. Limits: the virtual stage is not
    shown, and actions narrower than a column may be hidden by their neighbours.
    """
    if width < 1:
        raise ScheduleError(f"width must be >= 1, got {width}")
    if not events:
        return "(empty timeline)"
    t0 = min(e.start for e in events)
    span = max(e.end for e in events) - t0
    scale = _columns_per_unit(events, span, width)
    ranks = sorted({e.rank for e in events})
    label = max(len(f"rank {r}") for r in ranks)
    cols = max(1, round(span * scale))
    lines = [f"{f'rank {r}':>{label}} |{_row([e for e in events if e.rank == r], t0, scale, cols)}|" for r in ranks]
    end = f"{t0 + span:g}"
    axis = f"{'':>{label}}  {t0:g}"
    return "\n".join(lines + [axis.ljust(label + 2 + cols - len(end)) + end])


def _columns_per_unit(events, span: float, width: int) -> float:
    if span <= 0:
        return 1.0
    whole = all(float(t).is_integer() for e in events for t in (e.start, e.end))
    if whole and span <= width:
        return float(width // span)
    return width / span


def _row(events, t0: float, scale: float, cols: int) -> str:
    cells = ["."] * cols
    for e in sorted(events, key=lambda e: e.start):
        lo = min(int((e.start - t0) * scale + 1e-9), cols - 1)
        hi = min(max(int((e.end - t0) * scale + 1e-9), lo + 1), cols)
        cells[lo:hi] = _label(e.action, hi - lo).ljust(hi - lo, "-")
    return "".join(cells)


def _label(action: str, room: int) -> str:
    try:
        a = Action.parse(action)
    except ScheduleError:
        return action[:room]
    if a.pair is not None:  # "F3B1": the forward of microbatch 3 beside the backward of 1
        f, b = a.pair
        text = f"F{f.microbatch}{b.kind.value}{b.microbatch}"
        return text if len(text) <= room else "FB"[:room]
    text = f"{a.kind.value}{a.microbatch}"
    return text if len(text) <= room else a.kind.value[:room]


_COLOURS = {"F": "#4878d0", "B": "#6acc64", "I": "#8fd18a", "W": "#ee854a", "OVERLAP": "#9d7fd4"}


def render_png(events: list[TimelineEvent], path: str, title: str = "", *,
               compare: list[tuple[str, list[TimelineEvent]]] | None = None, unit: str = "") -> None:
    """A Gantt chart PNG, one row per rank: F blue, B green, I light green, W orange, SEND/RECV grey,
    each box labelled with its microbatch. `compare`: more (label, events) panels drawn below on the
    same time axis (a measured step under its prediction, say); `title` then labels the first panel.
    `unit`: "ms" draws times (read as seconds) in milliseconds. Needs matplotlib (`pip install matplotlib`)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("drawing a PNG needs matplotlib: pip install matplotlib") from e
    panels = [(title, events), *(compare or [])]
    scale = 1e3 if unit == "ms" else 1.0
    heights = [len({e.rank for e in evs}) or 1 for _, evs in panels]
    fig, axes = plt.subplots(len(panels), 1, sharex=True, squeeze=False,
                             figsize=(12, sum(0.6 * h + 0.8 for h in heights) + 0.4),
                             gridspec_kw={"height_ratios": [h + 1 for h in heights]})
    for ax, (label, evs) in zip(axes[:, 0], panels):
        _draw(ax, evs, scale)
        ax.set_title(label, fontsize=10)
    axes[-1, 0].set_xlabel(f"time ({unit})" if unit else "time")
    fig.tight_layout()
    from ..atomic import write_atomic

    write_atomic(path, lambda fh: fig.savefig(fh, format="png", dpi=120))
    plt.close(fig)


def _draw(ax, events: list[TimelineEvent], scale: float) -> None:
    ranks = sorted({e.rank for e in events})
    for e in events:
        kind = _category(e.action)
        ax.barh(e.rank, (e.end - e.start) * scale, left=e.start * scale, height=0.8,
                color=_COLOURS.get(kind, "#a0a0a0"), edgecolor="white", linewidth=0.5)
        if kind in _COLOURS:
            ax.text((e.start + e.end) / 2 * scale, e.rank, str(Action.parse(e.action).microbatch),
                    ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
