"""Doctor checks for installed agents: does each config still point at what the daemon serves?

`check_agent` reads the files an install recorded, asks the agent module what they state
(base URL, model id, limits, key reference) and compares that with `daemon.status`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import AgentConfigError
from .manager import AGENTS
from .merge import load
from .target import AgentTarget, NoModelLoaded

OK, WARN, FAIL = "ok", "warn", "fail"


@dataclass(frozen=True)
class Check:
    """One finding: which agent, what was checked, the verdict and a sentence saying what to do."""

    agent: str
    name: str
    level: str  # "ok", "warn" or "fail"
    detail: str

    def to_json(self) -> dict[str, str]:
        """A JSON-ready copy."""
        return {"agent": self.agent, "check": self.name, "level": self.level, "detail": self.detail}


def check_agent(name: str, record: dict[str, Any], status: dict[str, Any] | None,
                env: Mapping[str, str]) -> list[Check]:
    """Check one installed agent against the live daemon's `status` (None: daemon not running)."""
    module = AGENTS[name]
    fix = f"run `mtplxctl agents install {name}`"
    docs = []
    for file_record in record["files"]:
        path = Path(file_record["path"])
        if not path.exists():
            return [Check(name, "config", FAIL, f"{path} is missing; {fix}")]
        try:
            docs.append(load(path, file_record["format"])[0])
        except AgentConfigError as exc:
            return [Check(name, "config", FAIL, str(exc))]
    out = [Check(name, "config", OK, "present and parseable: " + ", ".join(f["path"] for f in record["files"]))]
    facts = module.facts(docs)
    if facts.base_url is None:
        return out + [Check(name, "entry", FAIL, f"the mtplx entry is gone from the config; {fix}")]
    if status is None:
        return out + [Check(name, "daemon", WARN, "the daemon is not running: start it with `mtplxctl start`")]
    base_url = str((status.get("http") or {}).get("base_url", "")).rstrip("/")
    if facts.base_url.rstrip("/") != base_url:
        out.append(Check(name, "base_url", FAIL, f"points at {facts.base_url}, the daemon serves {base_url}; {fix}"))
    else:
        out.append(Check(name, "base_url", OK, f"points at {base_url}"))
    try:
        target = AgentTarget.from_status(status)
    except NoModelLoaded as exc:
        return out + [Check(name, "model", WARN, str(exc))]
    out.extend(_model_checks(name, facts, target, fix))
    out.extend(_key_checks(name, facts, target, env, fix))
    return out


def _model_checks(name: str, facts: Any, target: AgentTarget, fix: str) -> list[Check]:
    out = []
    if facts.model_id != target.model_id:
        out.append(Check(name, "model", FAIL, f"config names {facts.model_id!r}, the daemon serves {target.model_id!r}; {fix}"))
    else:
        out.append(Check(name, "model", OK, f"model {target.model_id}"))
    if not facts.selected:
        out.append(Check(name, "default", WARN, "mtplx is no longer the agent's default model (changed since install)"))
    if facts.context_window is not None and facts.context_window != target.context_window:
        level = FAIL if facts.context_window > target.context_window else WARN
        out.append(Check(name, "context", level,
                         f"config says a {facts.context_window}-token context, the daemon serves {target.context_window}; {fix}"))
    if facts.max_output_tokens is not None and facts.max_output_tokens != target.max_output_tokens:
        level = FAIL if facts.max_output_tokens > target.max_output_tokens else WARN
        out.append(Check(name, "output", level,
                         f"config caps output at {facts.max_output_tokens}, the model's ceiling is {target.max_output_tokens}; {fix}"))
    if name == "hermes" and target.context_window < 64_000:
        out.append(Check(name, "context", WARN, f"Hermes needs a context window of at least 64000 tokens; the daemon serves {target.context_window}"))
    if not any(c.level != OK for c in out if c.name in ("context", "output")):
        out.append(Check(name, "limits", OK, f"context {target.context_window}, output {target.max_output_tokens}"))
    return out


def _key_checks(name: str, facts: Any, target: AgentTarget, env: Mapping[str, str], fix: str) -> list[Check]:
    if target.api_key_env is None:
        return []
    if facts.key_env != target.api_key_env:
        return [Check(name, "api_key", FAIL, f"the daemon requires a key but the config does not reference ${target.api_key_env}; {fix}")]
    if not env.get(target.api_key_env):
        return [Check(name, "api_key", WARN, f"the config reads the key from ${target.api_key_env}, which is not set in this shell")]
    return [Check(name, "api_key", OK, f"key read from ${target.api_key_env}")]
