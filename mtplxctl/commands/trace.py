"""trace: what the daemon did in a coding session, from the flight recorder's files.

`mtplxctl trace` lists the sessions on record; `mtplxctl trace SESSION` prints the diagnosis
of one (1 is the latest, or an id from the list) and writes its HTML report. A local task: it
reads MTPLX_HOME/metrics/ and works whether the daemon runs or not.
"""

from __future__ import annotations

import argparse
import datetime as _dt
from pathlib import Path
from typing import Any

from rich.table import Table

from mtplxd.config import ConfigError, load_config
from mtplxd.flight import read_records
from mtplxd.paths import Paths
from mtplxctl.output import EXIT_OK, console, fail, print_json, save_and_show, whole_number
from mtplxctl.trace.report import render_html
from mtplxctl.trace.sessions import DEFAULT_STALL_SECONDS, analyse, group_sessions, summary_row


def register(subparsers: argparse._SubParsersAction) -> None:
    trace = subparsers.add_parser("trace", help="diagnose a coding session from the flight recorder")
    trace.add_argument("session", nargs="?",
                       help="a session from the list: its number (1 = latest) or its id; "
                            "leave out to list the sessions")
    trace.add_argument("--html", metavar="FILE",
                       help="where to write the report (default metrics/trace-ID.html)")
    trace.add_argument("--stall-seconds", type=whole_number(1, 86400),
                       default=int(DEFAULT_STALL_SECONDS),
                       help=f"flag a wait or decode gap longer than this (default {int(DEFAULT_STALL_SECONDS)})")
    trace.add_argument("-n", "--limit", type=whole_number(1, 100_000), default=20,
                       help="sessions to list (default 20)")
    trace.add_argument("--json", action="store_true", help="machine-readable output")
    trace.set_defaults(func=cmd_trace)


def cmd_trace(args: argparse.Namespace) -> int:
    paths = Paths.from_env()
    sessions = group_sessions(read_records(paths.metrics_dir))
    newest_first = sorted(sessions, key=lambda s: s.last, reverse=True)
    if args.session is None:
        return _list(newest_first[:args.limit], paths, args.json)
    session = _pick(newest_first, args.session)
    if session is None:
        return fail(f"there is no session {args.session} on record",
                    "`mtplxctl trace` lists them (1 is the latest)")
    analysis = analyse(session, float(args.stall_seconds))
    out = Path(args.html).expanduser() if args.html else paths.metrics_dir / f"trace-{session.id}.html"
    return save_and_show(out, render_html(analysis), analysis, args.json, _summary)


def _pick(sessions: list, wanted: str):
    if wanted.isdigit() and 1 <= int(wanted) <= len(sessions):
        return sessions[int(wanted) - 1]
    matches = [s for s in sessions if s.id.startswith(wanted.lower())]
    return matches[0] if len(matches) == 1 else None


def _list(sessions: list, paths: Paths, as_json: bool) -> int:
    rows = [summary_row(s) for s in sessions]
    if as_json:
        print_json({"metrics_dir": str(paths.metrics_dir), "recorder": _recorder_setting(paths),
                    "sessions": rows})
        return EXIT_OK
    if not rows:
        console.print(f"No requests on record in {paths.metrics_dir}.")
        if _recorder_setting(paths) is False:
            console.print("The flight recorder is off: `mtplxctl config set flight_recorder true`.")
        return EXIT_OK
    table = Table(title="sessions on record (newest first)")
    for header in ("#", "id", "started", "turns", "reuse", "agent"):
        table.add_column(header, overflow="fold")
    for i, row in enumerate(rows, 1):
        reuse = f"{row['cache_reuse'] * 100:.0f}%" if row["cache_reuse"] is not None else "–"
        table.add_row(str(i), row["id"], _when(row["started"]), str(row["turns"]), reuse,
                      (row["agent"] or "?")[:40])
    console.print(table)
    console.print("[dim]`mtplxctl trace 1` diagnoses the latest one and writes its HTML report[/]")
    return EXIT_OK


def _recorder_setting(paths: Paths) -> bool | None:
    try:
        return bool(load_config(paths.config_file).flight_recorder)
    except ConfigError:
        return None


def _when(epoch: float | None) -> str:
    return _dt.datetime.fromtimestamp(epoch).strftime("%m-%d %H:%M") if epoch else "?"


def _summary(analysis: dict[str, Any]) -> None:
    session, totals = analysis["session"], analysis["totals"]
    reuse = totals["cache_reuse"]
    console.print(f"[bold]session {session['id']}[/] · {session['agent'] or 'unknown client'} · "
                  f"{session['turns']} requests from {_when(session['started'])}")
    console.print(f"time: queue {totals['queue_s']:.1f}s, prefill {totals['prefill_s']:.1f}s, "
                  f"decode {totals['decode_s']:.1f}s · cache reuse "
                  f"{f'{reuse * 100:.0f}%' if reuse is not None else '–'} "
                  f"({totals['reused_tokens']:,} of {totals['prompt_tokens']:,} prompt tokens) · "
                  f"decode {totals['decode_tok_s'] or 0:.1f} tok/s")
    table = Table()
    for header in ("#", "status", "prompt", "reused", "prefill s", "ttft s", "tok/s", "acc",
                   "draft/verify ms", "flags"):
        table.add_column(header, overflow="fold")
    for t in analysis["turns"]:
        table.add_row(str(t["turn"]), f"{t['status']}", str(t["prompt_tokens"]),
                      f"{t['reused_tokens']} {t['restored_from'] or ''}".strip(),
                      f"{t['prefill_s']:.2f}", _num(t["ttft_s"]), _num(t["tok_s"], 1),
                      _num(t["accepted_length"]), _split(t), " ".join(f["kind"] for f in t["flags"]))
    console.print(table)
    for flag in analysis["flags"]:
        console.print(f"[red]turn {flag['turn']} {flag['kind']}[/]: {flag['text']}")
    misses = [t for t in analysis["turns"] if t["cache"].startswith(("miss", "diverged"))]
    for t in misses:
        console.print(f"[yellow]turn {t['turn']} cache[/]: {t['cache']}")
    if not analysis["flags"] and not misses:
        console.print("[green]nothing flagged[/]")
    console.print(f"report: {analysis['report']}")


def _split(turn: dict[str, Any]) -> str:
    """A turn's draft/verify ms per cycle (sampled cycles), or nothing for AR."""
    if turn["draft_ms"] is None:
        return ""
    return f"{turn['draft_ms']:.1f}/{turn['verify_ms']:.1f}"


def _num(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:.{digits}f}"
