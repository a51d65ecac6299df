"""Install, uninstall and report agents: the plans of each agent module run through the safe merge.

Pure over its inputs (target, environment mapping, MTPLX_HOME) so tests need no daemon; the
`mtplxctl agents` command feeds it the daemon's status and the process environment.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from . import claude, codex, hermes, opencode, pi
from .base import detected
from .errors import AgentConfigError
from .merge import FileResult, install_file, load, uninstall_file
from .record import load_record, now_utc, save_record
from .target import AgentTarget

AGENTS = {module.name: module for module in (opencode, pi, hermes, codex, claude)}
# `all` on install means these; Claude Code is opt-in by name, because pointing it at the
# daemon takes it off Anthropic's service for every session.
DEFAULT_AGENTS = ("opencode", "pi", "hermes", "codex")


@dataclass
class AgentResult:
    """The outcome for one agent."""

    agent: str
    status: str  # "installed", "unchanged", "uninstalled", "not-installed", "skipped", "error"
    files: list[FileResult] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary."""
        return {
            "agent": self.agent,
            "status": self.status,
            "files": [f.to_json() for f in self.files],
            "notes": self.notes,
            "error": self.error,
        }


def resolve_names(names: list[str], for_install: bool, env: Mapping[str, str], mtplx_home: Path) -> list[str]:
    """Expand `all` (and an empty list) into agent names; reject unknown names.

    For install, `all` means the default agents that look installed on this machine; for
    uninstall and status it means every agent.
    """
    if not names or "all" in names:
        if for_install:
            return [n for n in DEFAULT_AGENTS if detected(AGENTS[n], env)]
        return list(AGENTS)
    unknown = [n for n in names if n not in AGENTS]
    if unknown:
        raise AgentConfigError(f"unknown agent {', '.join(unknown)}; choose from {', '.join(AGENTS)} or all")
    return list(dict.fromkeys(names))


def not_found_reason(name: str, env: Mapping[str, str]) -> str:
    """Why `name` does not look installed here (its binary and config folder are missing)."""
    module = AGENTS[name]
    return f"not found: no `{module.binary}` on PATH and no {module.config_dir(env)}"


def skipped_by_all(env: Mapping[str, str]) -> list[AgentResult]:
    """What `agents install all` leaves out, each with why and how to install it anyway."""
    skipped = [AgentResult(n, "skipped", notes=[f"{not_found_reason(n, env)}; "
                                                f"`mtplxctl agents install {n}` writes it anyway"])
               for n in DEFAULT_AGENTS if not detected(AGENTS[n], env)]
    opt_in = [n for n in AGENTS if n not in DEFAULT_AGENTS]
    skipped += [AgentResult(n, "skipped", notes=[f"opt-in: `mtplxctl agents install {n}` installs it "
                                                 f"(it would stop using its own provider's service)"])
                for n in opt_in]
    return skipped


def install_agent(name: str, target: AgentTarget, env: Mapping[str, str], mtplx_home: Path,
                  dry_run: bool = False) -> AgentResult:
    """Write one agent's config for `target`; keep the record unless `dry_run`.

    Every file of the agent is parsed and edited in memory (and checked for conflicts) before
    any is written, the files of an earlier install that this one no longer writes included,
    so a file that cannot be edited leaves all of the agent's files untouched and is reported
    as this agent's error.
    """
    module = AGENTS[name]
    found = detected(module, env)  # before writing: the write creates its config folder
    records = load_record(mtplx_home)
    prior = records.get(name, {})
    prior_files = {f["path"]: f for f in prior.get("files", [])}
    plans = module.plans(target, env)
    try:
        docs = [load(plan.path, plan.fmt)[0] for plan in plans]
        conflict = getattr(module, "conflicts", lambda *_: None)(target, docs)
        if conflict:
            raise AgentConfigError(conflict)
        results, file_records = [], []
        for plan in plans:
            result, file_record = install_file(plan, prior_files.pop(str(plan.path), None), dry_run=True)
            results.append(result)
            file_records.append(file_record)
        # Files of an earlier install that this one no longer writes (a moved override).
        stale = list(prior_files.values())
        for file_record in stale:
            _check_cleanup(file_record)
        if not dry_run:
            for file_record in stale:
                uninstall_file(file_record)
            results = [install_file(plan, prior_record_for(prior, plan.path))[0] for plan in plans]
    except AgentConfigError as exc:
        return AgentResult(name, "error", error=str(exc))
    if not dry_run:
        records[name] = {"installed_at": prior.get("installed_at") or now_utc(), "target": target.to_json(),
                         "files": file_records}
        save_record(mtplx_home, records)
    changed = any(r.action != "unchanged" for r in results)
    notes = list(module.notes(target))
    if not found:
        notes.insert(0, f"{not_found_reason(name, env)} yet; the config is written and takes "
                        f"effect once it is installed")
    return AgentResult(name, "installed" if changed else "unchanged", results, notes)


def _check_cleanup(file_record: dict[str, Any]) -> None:
    """Raise AgentConfigError, saying it is the earlier install's file, unless its entries can
    be taken out of it."""
    try:
        uninstall_file(file_record, dry_run=True)
    except AgentConfigError as exc:
        raise AgentConfigError(f"cannot remove the earlier install from {file_record['path']}: {exc}") from None


def prior_record_for(prior: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """The earlier install's record of `path`, if any."""
    return next((f for f in prior.get("files", []) if f["path"] == str(path)), None)


def uninstall_agent(name: str, mtplx_home: Path, dry_run: bool = False) -> AgentResult:
    """Remove what the recorded install of `name` added; drop its record unless `dry_run`."""
    records = load_record(mtplx_home)
    if name not in records:
        return AgentResult(name, "not-installed")
    try:
        # Check that every file still parses and can be restored before changing any of them.
        for file_record in records[name]["files"]:
            uninstall_file(file_record, dry_run=True)
        results = [uninstall_file(f, dry_run=dry_run) for f in records[name]["files"]]
    except AgentConfigError as exc:
        return AgentResult(name, "error", error=str(exc))
    if not dry_run:
        del records[name]
        save_record(mtplx_home, records)
    notes = [f"left {key} in {r.path}: you changed it after install" for r in results for key in r.kept]
    return AgentResult(name, "uninstalled", results, notes)


def agent_status(name: str, env: Mapping[str, str], mtplx_home: Path) -> dict[str, Any]:
    """What is known about one agent: detected here, installed, for which target, which files."""
    record = load_record(mtplx_home).get(name)
    module = AGENTS[name]
    return {
        "agent": name,
        "title": module.title,
        "detected": detected(module, env),
        "installed": record is not None,
        "installed_at": record.get("installed_at") if record else None,
        "target": record.get("target") if record else None,
        "files": [f["path"] for f in record["files"]] if record else [p.path.as_posix() for p in _plan_paths(module, env)],
    }


def _plan_paths(module: Any, env: Mapping[str, str]) -> list[Any]:
    # Any target gives the same paths; placeholders keep this independent of the daemon.
    placeholder = AgentTarget("http://127.0.0.1:8000/v1", "model", 1, 1)
    return module.plans(placeholder, env)
