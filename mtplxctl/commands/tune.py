"""tune: find the fastest MTP depth for the served model on this machine, and keep it.

It measures through the running daemon's own API, so the API keeps serving while it runs
(other traffic shares the engine then, and the report says so: `rows_max` above 1). Each
depth is warmed first (a fixed verify shape compiles once, on CUDA especially), then depths
0 (plain AR) to 6 are timed on a fixed set of coding prompts at the model's default sampling,
interleaved (every prompt runs every depth, in a rotating order) so drift in clocks and heat
hits them alike. The best median decode rate wins and is saved in MTPLX_HOME/tuning.json
under the key the daemon reports for this model on this machine; the daemon serves it from
the next load when `depth = auto`. It never runs by itself.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from mtplxd.api.auth import load_key
from mtplxd.paths import Paths
from mtplxd.tuning import save_tuned
from mtplxctl.client import ControlClient
from mtplxctl.output import console, fail, save_and_show, whole_number

# Short requests a coding agent sends: code to write, explain and fix.
PROMPTS = (
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "def merge_sorted(a, b):\n    \"\"\"Merge two sorted lists into one sorted list.\"\"\"\n",
    "Refactor this loop into a list comprehension: for x in xs: if x > 0: out.append(x * 2)",
    "Explain what this shell command does: find . -name '*.py' | xargs grep -n TODO",
    "Write a TypeScript interface for a user with id, name, email and an optional phone.",
    "Fix the bug: def mean(xs): return sum(xs) / len(xs) - 1",
)
WARMUP_TOKENS = 16


class TuneError(Exception):
    """The daemon refused a measurement request; the message is its own."""


def register(subparsers: argparse._SubParsersAction) -> None:
    tune = subparsers.add_parser("tune", help="measure MTP depths 0-6 on this machine and keep the fastest")
    tune.add_argument("--depths", default="0-6", help="depths to try: a range or a list (default 0-6)")
    tune.add_argument("--max-tokens", type=whole_number(8, 100_000), default=128,
                      help="tokens per timed request (default 128)")
    tune.add_argument("--repeats", type=whole_number(1, 100), default=2,
                      help="passes over the prompt set (default 2)")
    tune.add_argument("--no-save", action="store_true", help="measure and print only")
    tune.add_argument("--json-out", help="where to save the report (default metrics/tune-TIME.json)")
    tune.add_argument("--json", action="store_true", help="machine-readable output")
    tune.set_defaults(func=cmd_tune)


def parse_depths(text: str) -> list[int]:
    """"0-6" or "0,2,3" -> sorted depths (0 is always measured: the ratio needs AR)."""
    depths: set[int] = {0}
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            depths.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise ValueError(f"--depths {text} must be a range like 0-6 or a list like 0,2,3") from None
    if max(depths) > 8 or min(depths) < 0:
        raise ValueError("--depths must lie between 0 and 8")
    return sorted(depths)


def cmd_tune(args: argparse.Namespace) -> int:
    paths = Paths.from_env()
    try:
        depths = parse_depths(args.depths)
    except ValueError as exc:
        return fail(str(exc))
    status = ControlClient(paths.socket).call("daemon.status")
    model = status.get("model") or {}
    if model.get("state") != "loaded":
        return fail("no model is loaded, so there is nothing to tune", "`mtplxctl start` loads one")
    if model.get("mode") != "mtp":
        return fail(f"{model['id']} is served plain autoregressive ({model.get('ar_reason')}); "
                    "there is no depth to tune")
    stored = load_key(paths) if status["http"].get("key_required", True) else None
    api = _Api(status["http"]["url"], stored.key if stored else None)
    try:
        runs = _measure(api, depths, args.max_tokens, args.repeats, quiet=args.json)
    except TuneError as exc:
        return fail(f"the daemon refused a measurement: {exc}")
    report = _report(model, depths, runs, args)
    if not args.no_save:
        entry = {k: report[k] for k in ("depth", "by_depth", "measured_at", "max_tokens", "repeats")}
        report["saved_to"] = str(save_tuned(paths.home, model["tuning_key"], entry))
    out = Path(args.json_out) if args.json_out else paths.metrics_dir / f"tune-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return save_and_show(out, json.dumps(report, indent=2) + "\n", report, args.json, _print)


class _Api:
    """POSTs to the daemon's chat endpoint (stdlib only: tune needs no HTTP library)."""

    def __init__(self, root: str, key: str | None) -> None:
        self.root = root.rstrip("/")
        self.key = key

    def chat(self, prompt: str, depth: int, max_tokens: int, seed: int) -> dict[str, Any]:
        # No temperature/top_p: the model's default sampling, as agents get it.
        body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "mtp_depth": depth, "seed": seed}
        headers = {"Content-Type": "application/json", "User-Agent": "mtplxctl-tune"}
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        request = urllib.request.Request(self.root + "/v1/chat/completions", json.dumps(body).encode(),
                                         headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=600) as answer:
                return json.load(answer)["mtplx_stats"]
        except urllib.error.HTTPError as exc:
            try:
                message = json.load(exc)["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = f"HTTP {exc.code}"
            raise TuneError(message) from None
        except urllib.error.URLError as exc:
            raise TuneError(f"cannot reach {self.root}: {exc.reason}") from None


def _measure(api: _Api, depths: list[int], max_tokens: int, repeats: int,
             quiet: bool) -> list[dict[str, Any]]:
    schedule = [(r, p, depths[(i + p + r) % len(depths)])
                for r in range(repeats) for p in range(len(PROMPTS)) for i in range(len(depths))]
    runs: list[dict[str, Any]] = []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=quiet, transient=True) as progress:
        task = progress.add_task("warming up", total=len(depths) + len(schedule))
        for depth in depths:
            progress.update(task, description=f"warming up depth {depth}")
            api.chat(PROMPTS[0], depth, WARMUP_TOKENS, seed=0)
            progress.advance(task)
        for repeat, prompt, depth in schedule:
            progress.update(task, description=f"pass {repeat + 1}/{repeats} depth {depth}")
            stats = api.chat(PROMPTS[prompt], depth, max_tokens, seed=prompt)
            runs.append({"depth": depth, "prompt": prompt, "repeat": repeat,
                         "tok_s": stats["decode_tokens_per_second"],
                         "accepted_length": stats["mean_accepted_length"],
                         "completion_tokens": stats["completion_tokens"],
                         "rows_max": stats.get("rows_max", 1)})
            progress.advance(task)
    return runs


def _report(model: dict[str, Any], depths: list[int], runs: list[dict[str, Any]],
            args: argparse.Namespace) -> dict[str, Any]:
    by_depth = {}
    for depth in depths:
        mine = [r for r in runs if r["depth"] == depth and r["tok_s"] > 0]
        by_depth[str(depth)] = {
            "tok_s_median": round(statistics.median(r["tok_s"] for r in mine), 2) if mine else 0.0,
            "accepted_length": round(statistics.fmean(r["accepted_length"] for r in mine), 3) if mine else None,
            "runs": len(mine),
        }
    ar = by_depth["0"]["tok_s_median"]
    for entry in by_depth.values():
        entry["ratio_to_ar"] = round(entry["tok_s_median"] / ar, 3) if ar else None
    best = max(depths, key=lambda d: (by_depth[str(d)]["tok_s_median"], -d))
    return {
        "model": model["id"], "tuning_key": model["tuning_key"], "depth": best,
        "by_depth": by_depth, "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "max_tokens": args.max_tokens, "repeats": args.repeats, "prompts": len(PROMPTS),
        "sampling": "the model's defaults", "shared_engine": max(r["rows_max"] for r in runs) > 1,
        "runs": runs,
    }


def _print(report: dict[str, Any]) -> None:
    table = Table(title=f"{report['model']}, median of {report['repeats'] * report['prompts']} runs")
    for header in ("depth", "tok/s", "accepted length", "vs AR"):
        table.add_column(header, justify="right")
    for depth, entry in report["by_depth"].items():
        mark = " ←" if int(depth) == report["depth"] else ""
        table.add_row("0 (AR)" if depth == "0" else depth, f"{entry['tok_s_median']:.1f}",
                      "–" if depth == "0" or entry["accepted_length"] is None else f"{entry['accepted_length']:.2f}",
                      f"{entry['ratio_to_ar']:.2f}x{mark}" if entry["ratio_to_ar"] else "–")
    console.print(table)
    if report["shared_engine"]:
        console.print("[yellow]other requests ran during the measurement; the figures include "
                      "their share of the engine[/]")
    if "saved_to" in report:
        console.print(f"best: depth {report['depth']}, saved in {report['saved_to']}; the daemon "
                      "serves it from the next load with depth = auto (`mtplxctl restart`)")
    else:
        console.print(f"best: depth {report['depth']} (not saved)")
    console.print(f"report: {report['report']}")
