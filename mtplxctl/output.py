"""How mtplxctl talks to people and scripts: rich for humans, JSON for `--json`."""

from __future__ import annotations

import argparse
import io
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from rich.console import Console
from rich.segment import Segment
from rich.table import Table

from mtplxd.config import as_whole_number

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NOT_RUNNING = 3

console = Console(highlight=False)
err_console = Console(stderr=True, highlight=False)


def key_value_table() -> Table:
    """A borderless two-column table (bold labels, values) for `status`-style views; a long
    value (path, URL) folds onto the next line rather than being cut at the terminal's edge."""
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    return table


def wrapping_table(*headers: str, title: str | None = None) -> Table:
    """A table that keeps every character at any width (80 columns included): words wrap and
    a long word (a path, URL or repo id) folds instead of ending in an ellipsis."""
    table = Table(title=title)
    for header in headers:
        table.add_column(header, overflow="fold")
    return table


def fitting_table(headers: Sequence[str], rows: Sequence[Sequence[str]], width: int, *,
                  title: str | None = None, keep_wide: dict[str, int] | None = None,
                  optional: Sequence[str] = ()) -> Table:
    """A wrapping_table of `rows` that fits `width` columns without cutting anything off.

    `keep_wide` {header: characters}: a column that keeps that width before the others wrap
    (a repo id folded into a narrow column is hard to read). Rich keeps such a min_width even
    where the other columns leave it no room, and the console then cuts the table's right side
    off; so while the table would not fit, the `optional` columns go, in the order given, and
    if it still would not, the widths kept go too (every column then wraps or folds)."""
    for dropped in range(len(optional) + 1):
        table = _table_of(headers, rows, set(optional[:dropped]), keep_wide or {}, title)
        if table_fits(table, width):
            return table
    return _table_of(headers, rows, set(optional), {}, title)


def _table_of(headers: Sequence[str], rows: Sequence[Sequence[str]], dropped: set[str],
              keep_wide: dict[str, int], title: str | None) -> Table:
    shown = [i for i, header in enumerate(headers) if header not in dropped]
    table = wrapping_table(*(headers[i] for i in shown), title=title)
    for column, i in zip(table.columns, shown):
        column.min_width = keep_wide.get(headers[i])
    for row in rows:
        table.add_row(*(row[i] for i in shown))
    return table


def table_fits(table: Table, width: int) -> bool:
    """Whether rich lays `table` out within `width` columns (a console of that width would
    otherwise cut its right side off)."""
    probe = Console(width=width, file=io.StringIO())
    lines = Segment.split_lines(probe.render(table, probe.options))
    return all(Segment.get_line_length(line) <= width for line in lines)


def print_json(data: Any) -> None:
    """One JSON document on stdout."""
    sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    sys.stdout.flush()


def save_and_show(path: Path, text: str, answer: dict[str, Any], as_json: bool,
                  show: Callable[[dict[str, Any]], None]) -> int:
    """Write a command's report file (`text` to `path`, folders made), name it in `answer`
    as `report`, then print `answer` as JSON or through `show`; exit code 0."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    answer["report"] = str(path)
    if as_json:
        print_json(answer)
    else:
        show(answer)
    return EXIT_OK


def fail(message: str, hint: str | None = None, code: int = EXIT_ERROR) -> int:
    """Print an error (and what to do next) on stderr; return the exit code."""
    err_console.print(f"[bold red]error:[/] {message}")
    if hint:
        err_console.print(f"[dim]→ {hint}[/]")
    return code


def not_running(as_json: bool = False) -> int:
    """The standard answer when no daemon is up (exit code 3)."""
    if as_json:
        print_json({"running": False})
        return EXIT_NOT_RUNNING
    return fail("mtplxd is not running", "start it with `mtplxctl start`", EXIT_NOT_RUNNING)


def human_bytes(count: float | None) -> str:
    if count is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


def human_duration(seconds: float) -> str:
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h"
    if hours:
        return f"{hours}h {minutes}m"
    if minutes:
        return f"{minutes}m {secs}s"
    return f"{secs}s"


def whole_number(low: int, high: int) -> Callable[[str], int]:
    """An argparse type for an integer option whose error says what it takes, in words
    (argparse's own reads "invalid int value: 'abc'")."""
    parse_number = as_whole_number(low, high)

    def parse(text: str) -> int:
        try:
            return parse_number(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{exc}, not {text}") from None

    return parse
