"""agents install|uninstall|status: point coding agents at the daemon, and take that back."""

from __future__ import annotations

import argparse
import difflib
import os
from pathlib import Path
from typing import Any, Mapping

from mtplxd.paths import Paths
from mtplxctl.agents import manager
from mtplxctl.agents.errors import AgentConfigError
from mtplxctl.agents.files import read_text
from mtplxctl.agents.manager import AgentResult
from mtplxctl.agents.target import AgentTarget
from mtplxctl.client import ControlClient, ControlError
from mtplxctl.output import EXIT_ERROR, EXIT_OK, console, fail, print_json, wrapping_table

CHOICES = [*manager.AGENTS, "all"]


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `agents` command group."""
    agents = subparsers.add_parser("agents", help="write coding-agent configs that use the daemon")
    verbs = agents.add_subparsers(dest="verb", metavar="VERB", required=True)
    for verb, help_text in (
        ("install", "write each agent's config for the model the daemon serves"),
        ("uninstall", "remove exactly what install added"),
        ("status", "which agents are installed, and for what"),
    ):
        sub = verbs.add_parser(verb, help=help_text)
        # No `choices`: argparse rejects an empty `*` list against them; names are checked later.
        sub.add_argument("names", nargs="*", metavar="AGENT",
                         help=f"{', '.join(CHOICES)} (default: all)")
        sub.add_argument("--json", action="store_true", help="machine-readable output")
        if verb != "status":
            sub.add_argument("--dry-run", action="store_true", help="show what would change; write nothing")
        sub.set_defaults(func=cmd_agents)


def cmd_agents(args: argparse.Namespace) -> int:
    """Dispatch `agents <verb>`; exit 0 when every agent succeeded, 1 otherwise."""
    home = Paths.from_env().home
    env = dict(os.environ)
    try:
        if args.verb == "status":
            return show_status(manager.resolve_names(args.names, False, env, home), env, home, args.json)
        if args.verb == "install":
            names = manager.resolve_names(args.names, True, env, home)
            everything = not args.names or "all" in args.names
            skipped = manager.skipped_by_all(env) if everything else []
            if not names:
                report(skipped, args.json, args.dry_run)
                return fail("no supported agent found on this machine",
                            "name one to write its config anyway, e.g. `mtplxctl agents install opencode`")
            # Raises DaemonNotRunning when the daemon is down; cli.main answers with exit 3.
            status = ControlClient.from_env().call("daemon.status")
            target = AgentTarget.from_status(status)
            results = run_install(names, target, env, home, args.dry_run) + skipped
        else:
            results = [manager.uninstall_agent(n, home, args.dry_run)
                       for n in manager.resolve_names(args.names, False, env, home)]
    except AgentConfigError as exc:
        return fail(str(exc))
    except ControlError as exc:
        return fail(f"the daemon answered: {exc.message}", "see `mtplxctl status` and `mtplxctl logs`")
    report(results, args.json, args.dry_run)
    return EXIT_ERROR if any(r.status == "error" for r in results) else EXIT_OK


def run_install(names: list[str], target: AgentTarget, env: Mapping[str, str], home: Path,
                dry_run: bool) -> list[AgentResult]:
    """Install each named agent for `target`; a dry run shows diffs and writes nothing."""
    return [manager.install_agent(name, target, env, home, dry_run=dry_run) for name in names]


def report(results: list[AgentResult], as_json: bool, dry_run: bool) -> None:
    """Print the results: a table (with diffs for a dry run) or one JSON document."""
    if as_json:
        print_json({"dry_run": dry_run, "agents": [r.to_json() for r in results]})
        return
    table = wrapping_table("agent", "result", "file", "change", "backup",
                           title="agents (dry run: nothing written)" if dry_run else "agents")
    for result in results:
        if result.error:
            table.add_row(result.agent, "[red]error[/]", "", result.error, "")
            continue
        if not result.files:
            table.add_row(result.agent, result.status, "", "", "")
        for i, f in enumerate(result.files):
            table.add_row(result.agent if i == 0 else "", result.status if i == 0 else "", str(f.path), f.action,
                          str(f.backup.name) if f.backup else "")
    console.print(table)
    for result in results:
        for note in result.notes:
            console.print(f"[dim]{result.agent}:[/] {note}")
        if dry_run:
            for f in result.files:
                _print_diff(f.path, f.text)


def _tilde(path: str, home_dir: str) -> str:
    """`path` with the home folder written ~ (narrow terminals keep more of what matters)."""
    return "~" + path[len(home_dir):] if home_dir and path.startswith(home_dir + "/") else path


def _print_diff(path: Path, new_text: str | None) -> None:
    old = read_text(path) or ""
    if new_text is None or new_text == old:
        return
    diff = difflib.unified_diff(old.splitlines(keepends=True), new_text.splitlines(keepends=True),
                                fromfile=str(path), tofile=f"{path} (after)")
    console.print("".join(diff), markup=False, end="")


def show_status(names: list[str], env: Mapping[str, str], home: Path, as_json: bool) -> int:
    """Print which agents are detected and installed, for which model and where."""
    rows = [manager.agent_status(name, env, home) for name in names]
    if as_json:
        print_json({"agents": rows})
        return EXIT_OK
    table = wrapping_table("agent", "detected", "installed", "model", "base URL", "files",
                           title="agents")
    home_dir = env.get("HOME", "")
    for row in rows:
        target: dict[str, Any] = row["target"] or {}
        table.add_row(row["title"], "yes" if row["detected"] else "no",
                      row["installed_at"] or "no", target.get("model_id", ""), target.get("base_url", ""),
                      "\n".join(_tilde(f, home_dir) for f in row["files"]))
    console.print(table)
    return EXIT_OK
