"""models list|pull|check|update|rm: the model store from the command line.

Through the daemon when it runs (progress arrives as `models.progress` notifications on the
control socket); with no daemon, the same store code runs in this process, so models can be
pulled before the first `mtplxctl start`. Either way the progress events are the same dicts,
drawn as a rich progress bar or, with --json, printed one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from pathlib import Path
from typing import Any, Callable

from rich.progress import (BarColumn, DownloadColumn, Progress, TaskID, TextColumn,
                           TimeRemainingColumn, TransferSpeedColumn)

from mtplxd.models.hub import ModelStoreError
from mtplxd.models.methods import PROGRESS_METHOD
from mtplxd.models.progress import ProgressCallback, no_progress
from mtplxd.models.spec import absolute_spec
from mtplxd.models.store import ModelStore
from mtplxd.paths import Paths
from mtplxctl.client import ControlClient, ControlError, DaemonNotRunning
from mtplxctl.output import (
    EXIT_ERROR, EXIT_OK, console, err_console, fail, fitting_table, human_bytes, print_json,
    wrapping_table,
)

SPEC_HELP = "a Hugging Face repo id, org/name, optionally @REVISION (branch, tag or commit sha)"


def register(subparsers: argparse._SubParsersAction) -> None:
    models = subparsers.add_parser("models", help="pull, list, check, update and remove models")
    verbs = models.add_subparsers(dest="verb", metavar="VERB", required=True)

    list_ = verbs.add_parser("list", help="pulled models (or, with --available, recommended ones)")
    list_.add_argument("--available", action="store_true",
                       help="the recommended models for this machine's memory")
    list_.add_argument("--json", action="store_true", help="machine-readable output")
    list_.set_defaults(func=cmd_list)

    pull = verbs.add_parser("pull", help="download a model from the Hugging Face Hub, pinned to a commit")
    pull.add_argument("model", metavar="REPO[@REVISION]", help=SPEC_HELP)
    pull.add_argument("--json", action="store_true", help="print progress as JSON lines")
    pull.set_defaults(func=cmd_pull)

    check = verbs.add_parser(
        "check", help="is each pulled revision still the Hub's latest? (or: how a folder or "
                      "every family is served)")
    check.add_argument("model", nargs="?", metavar="REPO|PATH",
                       help="one repo (default: all), or a local checkpoint folder: is it served "
                            "MTP, AR or refused, and why")
    check.add_argument("--families", action="store_true",
                       help="every family mlx-lm or mlx-vlm can load: MTP (head depth), AR or "
                            "refused, with the reason")
    check.add_argument("--json", action="store_true", help="machine-readable output")
    check.set_defaults(func=cmd_check)

    update = verbs.add_parser("update", help="move a pulled model to the Hub's latest commit")
    update.add_argument("model", metavar="REPO")
    update.add_argument("--json", action="store_true", help="print progress as JSON lines")
    update.set_defaults(func=cmd_update)

    rm = verbs.add_parser("rm", help="remove a pulled model (or one REPO@REVISION of it)")
    rm.add_argument("model", metavar="REPO[@REVISION]")
    rm.add_argument("--force", action="store_true",
                    help="remove it even when it is the model the daemon serves (the next start "
                         "or restart then cannot load it)")
    rm.add_argument("--json", action="store_true", help="machine-readable output")
    rm.set_defaults(func=cmd_rm)


# ---------------------------------------------------------------- running an operation


class OperationFailed(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def run_operation(method: str, params: dict[str, Any], local: Callable[[ModelStore, ProgressCallback], Any],
                  on_event: ProgressCallback = no_progress) -> Any:
    """Ask the daemon, or run `local` on this process's store when no daemon answers.

    Raises OperationFailed(reason, message) for either side's errors.
    """
    def on_notification(name: str, params: dict[str, Any]) -> None:
        if name == PROGRESS_METHOD:
            on_event(params)

    try:
        try:
            return ControlClient.from_env(timeout=None).call(method, params, on_notification, timeout=None)
        except DaemonNotRunning:
            return local(ModelStore(Paths.from_env().models_dir), on_event)
    except ControlError as exc:
        raise OperationFailed(exc.reason, exc.message) from None
    except ModelStoreError as exc:
        raise OperationFailed(exc.reason, exc.message) from None


class ProgressView:
    """Draws store progress events: a rich bar per file plus a total, or JSON lines."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=err_console,
                                 transient=True)
        self.overall: TaskID | None = None
        self.files: dict[str, TaskID] = {}
        self.done: dict[str, int] = {}
        self.label = ""
        # Without a daemon the store reports from several download threads at once.
        self._lock = threading.Lock()

    def __enter__(self) -> "ProgressView":
        if not self.as_json:
            self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if not self.as_json:
            self.progress.stop()

    def __call__(self, event: dict[str, Any]) -> None:
        with self._lock:
            self._show(event)

    def _show(self, event: dict[str, Any]) -> None:
        if self.as_json:
            json_line(event)
            return
        phase = event.get("phase")
        if phase == "resolved":
            self.label = f"{event['repo']}@{event['revision'][:12]}"
            self.overall = self.progress.add_task(self.label, total=event.get("total"))
        elif phase == "downloading":
            self._file(event)
        elif phase == "verifying" and self.overall is not None:
            self.progress.update(self.overall, description=f"verifying {event['checked']}/{event['files']}")
        elif phase == "repairing":
            self.progress.console.print(f"[yellow]repairing {event['file']}:[/] {event['reason']}")
        elif phase == "inspecting" and self.overall is not None:
            self.progress.update(self.overall, description="checking the checkpoint")

    def _file(self, event: dict[str, Any]) -> None:
        name, downloaded, total = event["file"], event.get("downloaded") or 0, event.get("total")
        self.done[name] = downloaded
        if not event.get("cached"):
            if name not in self.files:
                self.files[name] = self.progress.add_task(f"  {name}", total=total)
            finished = total is not None and downloaded >= total
            self.progress.update(self.files[name], completed=downloaded, total=total, visible=not finished)
        if self.overall is not None:
            self.progress.update(self.overall, completed=sum(self.done.values()))


def json_line(data: dict[str, Any]) -> None:
    """One JSON object on one line of stdout (the --json progress format)."""
    sys.stdout.write(json.dumps(data, default=str) + "\n")
    sys.stdout.flush()


def _failed(exc: OperationFailed, as_json: bool) -> int:
    if as_json:
        json_line({"phase": "error", "reason": exc.reason, "message": exc.message})
        return EXIT_ERROR
    hints = {
        "not_pulled": "`mtplxctl models list` shows what is pulled",
        "invalid_spec": "write the repo as org/name, or org/name@REVISION",
        "offline": "unset HF_HUB_OFFLINE to reach the Hub",
        "unreachable": "check the network, HF_ENDPOINT and HF_HUB_OFFLINE",
    }
    return fail(exc.message, hints.get(exc.reason))


# ---------------------------------------------------------------- pull / update


def pull_with_progress(spec: str, as_json: bool = False) -> dict[str, Any] | None:
    """Pull `spec` showing progress; returns the pulled model, or None after printing the error.

    For other commands (e.g. `mtplxctl start` pulling the catalog's pick).
    """
    try:
        with ProgressView(as_json) as view:
            return run_operation("models.pull", {"model": spec},
                                 lambda store, emit: store.pull(spec, progress=emit), view)
    except OperationFailed as exc:
        _failed(exc, as_json)
        return None


def ensure_default_model(pull: bool = False,
                         confirm: Callable[[str], bool] | None = None) -> str | None:
    """For `mtplxctl start` with no model named: the catalog's pick, unless one is configured.

    Returns the repo id to load when the pick is already pulled, or after pulling it now with a
    progress bar — with `pull` (`start --recommended`), or when `confirm(question)` (an
    interactive start) says yes. Returns None to let the daemon load its configured model, or
    the embedded one: a plain `start` never downloads gigabytes unasked. None also means
    offline, the Hub did not answer, the pick is not on the Hub, the machine is too small, or
    the pull failed (its error is printed). Everything it shows goes to stderr, so
    `start --json` keeps a clean stdout.
    """
    from mtplxd.config import ConfigError, load_config
    from mtplxd.models.catalog import CPU_REASON, EMBEDDED_ID, accelerator, default_model_choice, recommended
    from mtplxd.models.store import resolve_pulled

    paths = Paths.from_env()
    try:
        if load_config(paths.config_file).model:
            return None
    except ConfigError:
        return None  # the daemon names the bad setting when it starts
    on = accelerator()  # read once: it lists installed packages and may ask the driver
    pick = recommended(on=on)
    if pick.id == EMBEDDED_ID:
        if pull and on == "cpu":  # `start --recommended` asked for one: say why not
            err_console.print(f"serving the embedded model: {CPU_REASON}")
        return None
    if resolve_pulled(pick.id, paths.models_dir) is not None:
        return pick.id
    if not pull and confirm is None:
        return None
    choice = default_model_choice(paths, pick)  # None when offline or the Hub does not know the repo
    if choice is None:
        return None
    if not pull and not confirm(f"No model is configured. Pull {choice} (about "
                                f"{pick.download_gb:.0f} GB), recommended for this machine, and serve it?"):
        err_console.print("serving the embedded demo model; `mtplxctl start --recommended` "
                          "pulls the recommended one later")
        return None
    err_console.print(f"no model configured: pulling the recommended {choice} "
                      "(`mtplxctl models list --available` shows the alternatives)")
    pulled = pull_with_progress(choice)
    return choice if pulled is not None and pulled.get("mode") != "refused" else None


def cmd_pull(args: argparse.Namespace) -> int:
    args.model = absolute_spec(args.model)  # a path is refused as one, from any working folder
    try:
        with ProgressView(args.json) as view:
            result = run_operation("models.pull", {"model": args.model},
                                   lambda store, emit: store.pull(args.model, progress=emit), view)
    except OperationFailed as exc:
        return _failed(exc, args.json)
    if args.json:
        json_line({"phase": "done", "model": result})
        return EXIT_OK if result["mode"] != "refused" else EXIT_ERROR
    fetched = len(result["downloaded"])
    console.print(f"pulled [bold]{result['id']}[/] @ {result['revision'][:12]} "
                  f"({human_bytes(result['size_bytes'])}, {fetched} file{'s' if fetched != 1 else ''} downloaded)")
    if result["repaired"]:
        console.print(f"[yellow]repaired:[/] {', '.join(result['repaired'])}")
    return _report_mode(result)


def _report_mode(result: dict[str, Any]) -> int:
    if result["mode"] == "refused":
        return fail(f"mtplx cannot serve {result['id']}: {result['reason']}")
    console.print(f"serving mode: {_mode_text(result)}")
    console.print(f"[dim]serve it: mtplxctl start --model {result['id']}[/]")
    return EXIT_OK


def _mode_text(row: dict[str, Any]) -> str:
    if row.get("mode") == "mtp":
        return "MTP"
    if row.get("mode") == "ar":
        return f"AR ({row.get('reason')})"
    return f"refused ({row.get('reason')})"


def cmd_update(args: argparse.Namespace) -> int:
    args.model = absolute_spec(args.model)
    try:
        with ProgressView(args.json) as view:
            result = run_operation("models.update", {"model": args.model},
                                   lambda store, emit: store.update(args.model, progress=emit), view)
    except OperationFailed as exc:
        return _failed(exc, args.json)
    if args.json:
        json_line({"phase": "done", "model": result})
        return EXIT_OK
    if not result["updated"]:
        console.print(f"{result['repo']} is up to date ({result['to'][:12]})")
        return EXIT_OK
    console.print(f"updated [bold]{result['id']}[/] {result['from'][:12]} → {result['to'][:12]}: "
                  f"{len(result['downloaded'])} changed file(s) downloaded, {len(result['reused'])} reused")
    for name in result["downloaded"]:
        console.print(f"  [dim]downloaded[/] {name}")
    return _report_mode(result)


# ---------------------------------------------------------------- list / check / rm


def cmd_list(args: argparse.Namespace) -> int:
    try:
        answer = run_operation("models.list", {}, lambda store, emit: {"models": store.list_models()})
    except OperationFailed as exc:
        return _failed(exc, args.json)
    pulled = answer["models"]
    if args.available:
        return _list_available(pulled, args.json)
    if args.json:
        print_json(answer)
        return EXIT_OK
    if not pulled:
        console.print("no models pulled — `mtplxctl models list --available` shows recommended ones")
        return EXIT_OK
    rows = []
    for row in pulled:
        revision = row["revision"][:12] + (f" ({row['requested']})" if row.get("requested") else "")
        name = row["id"] if row["current"] else f"[dim]{row['id']}[/]"
        if not row["present"]:
            revision += " [red]missing[/]"
        rows.append((name, revision, human_bytes(row["size_bytes"]), row.get("family") or "-",
                     _mode_text(row), row.get("quantization") or "-", row.get("pulled_at", "")[:10]))
    # A repo id or a sha cut short is useless: they fold (every character kept) when a narrow
    # terminal has no room for them on one line, and the id keeps a readable width before the
    # date, quantization and family columns go (`--json` has them all).
    table = fitting_table(("model", "revision", "size", "family", "mode", "quant", "pulled"), rows,
                          console.width, keep_wide={"model": _id_width(pulled)},
                          optional=("pulled", "quant", "family"))
    console.print(table)
    return EXIT_OK


def _list_available(pulled: list[dict[str, Any]], as_json: bool) -> int:
    from mtplxd.models.catalog import available_models

    have = {row["id"].lower() for row in pulled}
    rows = [{**row, "pulled": row["id"].lower() in have} for row in available_models()]
    if as_json:
        print_json({"models": rows})
        return EXIT_OK
    machine = rows[-1]  # every row carries the machine's figures
    on_cpu = machine["accelerator"] == "cpu"
    table_rows = []
    for row in rows:
        marks = []
        if row["recommended"]:
            marks.append("[green]recommended[/]")
        if row["pulled"]:
            marks.append("pulled")
        if not row["fits"]:
            marks.append("[dim]needs more memory[/]")
        if not row["verified"]:
            marks.append("[dim]unverified id[/]")
        size = f"{row['download_gb']:.1f} GB" if row["download_gb"] else "built in"
        memory = f"{row['tier_gb']} GB+" if row["tier_gb"] else "any"
        # One mark a line: the column stays narrow, and the repo id keeps the room.
        table_rows.append((row["id"], memory, size, row["quantization"], "\n".join(marks)))
    title = (f"recommended for this machine ({machine['memory_gb']:.0f} GB "
             f"{machine['memory_kind']}{', CPU only' if on_cpu else ''})")
    table = fitting_table(("model", f"for {machine['memory_kind']}", "download", "quant", ""),
                          table_rows, console.width, title=title,
                          keep_wide={"model": _id_width(rows)}, optional=("quant",))
    console.print(table)
    if on_cpu:
        console.print(f"[yellow]{machine['cpu_reason']}[/]")
    console.print("[dim]pull one: mtplxctl models pull REPO — the embedded model works offline[/]")
    return EXIT_OK


def _id_width(rows: list[dict[str, Any]]) -> int:
    """The width a model id column keeps before other columns wrap: its longest id, at most 24."""
    return min(max((len(row["id"]) for row in rows), default=10), 24)


def cmd_check(args: argparse.Namespace) -> int:
    if args.families:
        return _check_families(args.json)
    if args.model and Path(args.model).expanduser().is_dir():
        return _check_folder(Path(args.model).expanduser(), args.json)
    if args.model:
        args.model = absolute_spec(args.model)  # a folder that is not there: "no such folder"
    params = {"model": args.model} if args.model else {}
    try:
        answer = run_operation("models.check", params, lambda store, emit: {"models": store.check(args.model)})
    except OperationFailed as exc:
        return _failed(exc, args.json)
    if args.json:
        print_json(answer)
        return EXIT_OK
    if not answer["models"]:
        console.print("no models pulled")
        return EXIT_OK
    styles = {"latest": "green", "outdated": "yellow", "unknown": "red"}
    table = wrapping_table("model", "revision", "follows", "hub", "status")
    for row in answer["models"]:
        status = f"[{styles[row['status']]}]{row['status']}[/]"
        if row["status"] == "unknown":
            status += f" [dim]({row['reason']})[/]"
        follows = row["tracking"] + (" (pinned)" if row["pinned"] else "")
        table.add_row(row["repo"], row["revision"][:12], follows,
                      (row["hub_revision"] or "?")[:12], status)
    console.print(table)
    if any(r["status"] == "outdated" for r in answer["models"]):
        console.print("[dim]update one: mtplxctl models update REPO[/]")
    return EXIT_OK


def _check_families(as_json: bool) -> int:
    """The honest registry: every loadable family and how it is served (local, no daemon)."""
    from mtplxd.engine.model.family_table import CHECKPOINT_REFUSALS, family_table

    rows = family_table()
    if as_json:
        print_json({"families": [r.to_dict() for r in rows],
                    "checkpoint_refusals": list(CHECKPOINT_REFUSALS)})
        return EXIT_OK
    styles = {"mtp": "green", "ar": "yellow", "refused": "red"}
    table = wrapping_table("family", "loaders", "served", "why / notes")
    for row in rows:
        served = f"[{styles[row.mode]}]{row.mode.upper()}[/]"
        if row.mode == "mtp":
            served += f" head {row.mtp_head_layers} layer, depth {row.draft_depth}"
        if row.vision:
            served += " +images"
        notes = row.reason or ""
        if row.reasoning_effort:
            notes += f" [dim](reasoning effort: {row.reasoning_effort})[/]"
        table.add_row(row.model_type, ", ".join(row.loaders), served, notes)
    console.print(table)
    counts = {mode: sum(r.mode == mode for r in rows) for mode in styles}
    console.print(f"{counts['mtp']} MTP, {counts['ar']} AR, {counts['refused']} refused. Any checkpoint "
                  "is refused for: " + "; ".join(CHECKPOINT_REFUSALS) + ".")
    return EXIT_OK


def _check_folder(path: Path, as_json: bool) -> int:
    """How one local checkpoint folder would be served (config.json and headers only)."""
    from mtplxd.engine import ModelLoadError, inspect_checkpoint

    try:
        report = inspect_checkpoint(path).to_dict()
    except ModelLoadError as exc:
        return fail(str(exc))
    code = EXIT_OK if report["mode"] != "refused" else EXIT_ERROR
    if as_json:
        print_json(report)
        return code
    console.print(f"{path}: [bold]{report['mode'].upper()}[/] ({report['model_type']})"
                  + (f": {report['reason']}" if report["reason"] else ""))
    if report["vision"]:
        console.print("images: served through the checkpoint's vision tower")
    elif report["vision_reason"]:
        console.print(f"images: not served: {report['vision_reason']}")
    return code


def cmd_rm(args: argparse.Namespace) -> int:
    args.model = absolute_spec(args.model)
    try:
        result = run_operation("models.rm", {"model": args.model, "force": args.force},
                               lambda store, emit: store.remove(args.model))
    except OperationFailed as exc:
        return _failed(exc, args.json)
    if args.json:
        print_json(result)
        return EXIT_OK
    if result.get("damaged"):
        what = "damaged manifest"
    else:
        what = ", ".join(sha[:12] for sha in result["removed"]) or "partial download"
    console.print(f"removed {result['repo']} ({what}), freed {human_bytes(result['freed_bytes'])}")
    if result.get("was_serving"):
        err_console.print("[yellow]it was the model mtplxd serves: the next start or restart "
                          "needs another (`--model`)[/yellow]")
    return EXIT_OK
