"""Hand-written SVG charts for the trace report: a turn timeline, stacked bars, line charts.

Why not a plotting library: the report must open from a file with no network, so a library's
JavaScript (plotly's is 3.5 MB) would be inlined into every report, and matplotlib would add
numpy and a 40 MB wheel to a CLI that draws three kinds of chart. These functions write
plain SVG strings with <title> tooltips (the browser shows them on hover, no script needed).
"""

from __future__ import annotations

import math
from html import escape
from typing import Sequence

WIDTH, HEIGHT = 880, 260
LEFT, RIGHT, TOP, BOTTOM = 56, 16, 16, 34
COLORS = {"queue": "#9aa3ad", "prefill": "#e8913a", "decode": "#3a7be8", "reused": "#3aa76d",
          "refused": "#d64545", "line2": "#8e44ad", "draft": "#8e44ad", "verify": "#3a7be8"}


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values covering low..high (1, 2, 5 x 10^n steps)."""
    if high <= low:
        high = low + 1
    raw = (high - low) / max(count, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    start = math.floor(low / step) * step
    ticks = [round(start, 10)]
    while ticks[-1] < high - step * 1e-9:  # the last tick covers `high`
        ticks.append(round(ticks[-1] + step, 10))
    return ticks


def _fmt(value: float) -> str:
    return f"{value:g}" if abs(value) < 1e5 else f"{value:.3g}"


class _Frame:
    """Axes and scales of one chart."""

    def __init__(self, x_max: float, y_max: float, x_label: str, y_label: str,
                 height: int = HEIGHT) -> None:
        self.height = height
        self.xt = nice_ticks(0, x_max or 1)
        self.yt = nice_ticks(0, y_max or 1)
        self.x_max, self.y_max = self.xt[-1], self.yt[-1]
        self.x_label, self.y_label = x_label, y_label

    def x(self, value: float) -> float:
        return LEFT + (WIDTH - LEFT - RIGHT) * value / self.x_max

    def y(self, value: float) -> float:
        return self.height - BOTTOM - (self.height - TOP - BOTTOM) * value / self.y_max

    def axes(self) -> list[str]:
        out = []
        for t in self.yt:
            y = self.y(t)
            out.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y:.1f}" y2="{y:.1f}" class="grid"/>')
            out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
        for t in self.xt:
            x = self.x(t)
            out.append(f'<text x="{x:.1f}" y="{self.height - BOTTOM + 16}" text-anchor="middle">{_fmt(t)}</text>')
        out.append(f'<text x="{(LEFT + WIDTH - RIGHT) / 2}" y="{self.height - 4}" text-anchor="middle" '
                   f'class="label">{escape(self.x_label)}</text>')
        out.append(f'<text x="12" y="{TOP + (self.height - TOP - BOTTOM) / 2:.1f}" class="label" '
                   f'transform="rotate(-90 12 {TOP + (self.height - TOP - BOTTOM) / 2:.1f})" '
                   f'text-anchor="middle">{escape(self.y_label)}</text>')
        return out


def _svg(parts: list[str], height: int, title: str) -> str:
    return (f'<svg viewBox="0 0 {WIDTH} {height}" role="img" aria-label="{escape(title)}" '
            f'xmlns="http://www.w3.org/2000/svg" class="chart">' + "".join(parts) + "</svg>")


def timeline(turns: Sequence[dict], title: str = "turn timeline") -> str:
    """One row per turn on a shared time axis: queue, prefill and decode as coloured spans,
    a refused request as a red tick."""
    rows = len(turns) or 1
    row_h = 18 if rows <= 20 else max(4, 360 // rows)
    height = TOP + BOTTOM + rows * row_h
    end = max((t["at"] + (t["duration_s"] or 0) for t in turns), default=1)
    frame = _Frame(end, rows, "seconds since the session began", "turn", height=height)
    parts = [p for p in frame.axes() if 'class="grid"' not in p and 'text-anchor="end"' not in p]
    for i, t in enumerate(turns):
        y = TOP + i * row_h + 2
        h = max(row_h - 4, 2)
        if row_h >= 12:
            parts.append(f'<text x="{LEFT - 6}" y="{y + h - 3}" text-anchor="end">{t["turn"]}</text>')
        if t["outcome"] == "refused":
            x = frame.x(t["at"])
            parts.append(f'<rect x="{x:.1f}" y="{y}" width="3" height="{h}" fill="{COLORS["refused"]}">'
                         f'<title>turn {t["turn"]}: refused {t["status"]} {escape(str(t["error"]))}</title></rect>')
            continue
        start = t["at"]
        for phase, seconds in (("queue", t["queue_s"]), ("prefill", t["prefill_s"]),
                               ("decode", t["decode_s"])):
            width = frame.x(start + seconds) - frame.x(start)
            tip = (f'turn {t["turn"]} {phase}: {seconds:.2f}s; prompt {t["prompt_tokens"]}, '
                   f'reused {t["reused_tokens"]}, out {t["completion_tokens"]}')
            parts.append(f'<rect x="{frame.x(start):.1f}" y="{y}" width="{max(width, 1):.1f}" height="{h}" '
                         f'fill="{COLORS[phase]}"><title>{escape(tip)}</title></rect>')
            start += seconds
    return _svg(parts, height, title)


def stacked_bars(labels: Sequence[str], series: Sequence[tuple[str, str, Sequence[float]]],
                 y_label: str, title: str) -> str:
    """Bars per label, each the stack of `series` (name, colour, values)."""
    n = len(labels) or 1
    y_max = max((sum(s[2][i] for s in series) for i in range(len(labels))), default=1)
    frame = _Frame(n, y_max, "turn", y_label)
    parts = [p for p in frame.axes() if f'y="{frame.height - BOTTOM + 16}"' not in p]
    slot = (WIDTH - LEFT - RIGHT) / n
    bar = max(slot * 0.7, 1)
    for i, label in enumerate(labels):
        base = 0.0
        x = LEFT + slot * i + (slot - bar) / 2
        for name, colour, values in series:
            value = values[i]
            if value > 0:
                top, bottom = frame.y(base + value), frame.y(base)
                parts.append(f'<rect x="{x:.1f}" y="{top:.1f}" width="{bar:.1f}" height="{bottom - top:.1f}" '
                             f'fill="{colour}"><title>turn {escape(label)} {escape(name)}: {_fmt(value)}</title></rect>')
            base += value
        if n <= 40 or i % max(n // 20, 1) == 0:
            parts.append(f'<text x="{x + bar / 2:.1f}" y="{frame.height - BOTTOM + 16}" '
                         f'text-anchor="middle">{escape(label)}</text>')
    return _svg(parts, frame.height, title)


def line_chart(segments: Sequence[Sequence[tuple[float, float]]], x_label: str, y_label: str,
               title: str, colour: str = COLORS["decode"]) -> str:
    """Lines with dots through (x, y) points, one line per segment (a turn: the line breaks
    between turns, where nothing was decoding); an empty chart says there is no data."""
    points = [p for segment in segments for p in segment]
    if not points:
        return _svg([f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">no decode '
                     'samples in this session</text>'], HEIGHT, title)
    frame = _Frame(max(p[0] for p in points), max(p[1] for p in points), x_label, y_label)
    parts = frame.axes()
    for segment in segments:
        path = " ".join(f"{'M' if i == 0 else 'L'}{frame.x(x):.1f},{frame.y(y):.1f}"
                        for i, (x, y) in enumerate(segment))
        if len(segment) > 1:
            parts.append(f'<path d="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
    for x, y in points:
        parts.append(f'<circle cx="{frame.x(x):.1f}" cy="{frame.y(y):.1f}" r="2.5" fill="{colour}">'
                     f'<title>{_fmt(round(x, 2))}s: {_fmt(round(y, 3))} {escape(y_label)}</title></circle>')
    return _svg(parts, HEIGHT, title)
