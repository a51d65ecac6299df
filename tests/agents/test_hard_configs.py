"""User configs in the forms that are valid but hard to edit: TOML dotted keys and inline tables,
YAML anchors, CRLF line breaks. Each must install into data that is exactly the user's merged
with mtplx's entries, and uninstall back to the original bytes; a file an editor cannot edit
right is refused untouched, as that agent's error, and the other agents are still installed."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import yaml

from mtplxctl.agents import manager
from mtplxctl.agents.checks import FAIL, check_agent
from mtplxctl.agents.errors import ConfigEditError
from mtplxctl.agents.merge import _check_reads_as
from mtplxctl.agents.record import load_record
from mtplxctl.agents.target import AgentTarget
from mtplxctl.commands.agents import run_install

CODEX_DOTTED = """\
model = "gpt-5-codex"
model_providers.azure.name = "Azure"
model_providers.azure.base_url = "https://x/openai"
approval_policy = "on-request"
[mcp_servers.docs]
command = "docs-mcp"
"""


def _codex_keys(target: AgentTarget) -> dict:
    """What install adds to (or sets in) Codex's config.toml for `target`, as data."""
    return {
        "model": target.model_id,
        "model_provider": "mtplx",
        "model_context_window": target.context_window,
        "web_search": "disabled",
        "features": {"image_generation": False},
        "model_providers": {"mtplx": {"name": "mtplx (local)", "base_url": target.base_url,
                                      "wire_api": "responses", "stream_idle_timeout_ms": 3_600_000}},
    }


def _merged(user: dict, ours: dict) -> dict:
    """`user` with `ours` laid over it, tables merged key by key."""
    out = dict(user)
    for key, value in ours.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode())


def test_codex_config_with_dotted_keys_keeps_every_user_key_where_it_was(env, mtplx_home, target, user_home, status):
    path = user_home / ".codex/config.toml"
    _write(path, CODEX_DOTTED)
    result = manager.install_agent("codex", target, env, mtplx_home)
    assert result.status == "installed", result.error
    assert tomllib.loads(path.read_text()) == _merged(tomllib.loads(CODEX_DOTTED), _codex_keys(target))
    checks = check_agent("codex", load_record(mtplx_home)["codex"], status, env)
    assert not [c for c in checks if c.level == FAIL], checks
    undone = manager.uninstall_agent("codex", mtplx_home)
    assert undone.status == "uninstalled" and undone.notes == []
    assert path.read_bytes() == CODEX_DOTTED.encode()


def test_codex_dotted_keys_survive_a_reinstall_for_a_model_with_fewer_efforts(env, mtplx_home, target, user_home):
    path = user_home / ".codex/config.toml"
    _write(path, CODEX_DOTTED)
    manager.install_agent("codex", target, env, mtplx_home)
    lfm = AgentTarget(target.base_url, "lfm2-instruct", 65536, 4096, False, None, ("none",))
    assert manager.install_agent("codex", lfm, env, mtplx_home).status == "installed"
    expected = _merged(tomllib.loads(CODEX_DOTTED), {**_codex_keys(lfm), "model_reasoning_effort": "none"})
    assert tomllib.loads(path.read_text()) == expected
    manager.uninstall_agent("codex", mtplx_home)
    assert path.read_bytes() == CODEX_DOTTED.encode()


def test_codex_inline_table_of_providers_gets_the_provider_inline(env, mtplx_home, target, user_home):
    original = 'model_providers = { azure = { name = "Azure" } }\napproval_policy = "never"\n'
    path = user_home / ".codex/config.toml"
    _write(path, original)
    codex, opencode = run_install(["codex", "opencode"], target, env, mtplx_home, dry_run=False)
    assert codex.status == "installed", codex.error
    assert opencode.status == "installed"
    assert tomllib.loads(path.read_text()) == _merged(tomllib.loads(original), _codex_keys(target))
    manager.uninstall_agent("codex", mtplx_home)
    assert path.read_bytes() == original.encode()


def test_codex_file_it_cannot_edit_is_that_agents_error_and_the_others_still_install(env, mtplx_home, target,
                                                                                    user_home):
    original = '[[model_providers]]\nname = "azure"\n'  # an array of tables where Codex wants a table
    path = user_home / ".codex/config.toml"
    _write(path, original)
    codex, opencode = run_install(["codex", "opencode"], target, env, mtplx_home, dry_run=False)
    assert codex.status == "error"
    assert str(path) in codex.error and "model_providers is not a table" in codex.error
    assert "left the file untouched" in codex.error and "\n" not in codex.error
    assert "not valid" not in codex.error  # the file is valid TOML: the edit is what cannot be made
    assert path.read_bytes() == original.encode()
    assert [p.name for p in path.parent.iterdir()] == ["config.toml"]  # no backup, no temp file
    assert opencode.status == "installed"


def test_text_that_would_not_read_as_the_merged_data_is_refused_before_writing(tmp_path):
    # What tomlkit made of CODEX_DOTTED before the fix: a [model_providers.mtplx] header among
    # the top-level keys, which then read as that table's keys.
    broken = CODEX_DOTTED.replace('approval_policy', '[model_providers.mtplx]\nname = "m"\napproval_policy', 1)
    expected = _merged(tomllib.loads(CODEX_DOTTED), {"model_providers": {"mtplx": {"name": "m"}}})
    path = tmp_path / "config.toml"
    with pytest.raises(ConfigEditError) as refused:
        _check_reads_as(path, "toml", broken, expected)
    assert str(path) in str(refused.value) and "approval_policy" in str(refused.value)
    assert "left the file untouched" in str(refused.value)


def test_codex_config_holding_nan_still_reads_as_itself(env, mtplx_home, target, user_home):
    original = 'model = "gpt-5"\n\n[tui]\nratio = nan\n'
    path = user_home / ".codex/config.toml"
    _write(path, original)
    assert manager.install_agent("codex", target, env, mtplx_home).status == "installed"
    manager.uninstall_agent("codex", mtplx_home)
    assert path.read_bytes() == original.encode()


HERMES_ANCHORED = "defaults: &d\n  provider: openrouter\nmodel:\n  <<: *d\n  default: x\n"


def test_hermes_model_block_with_an_alias_uninstalls_to_the_original_bytes(env, mtplx_home, target, user_home):
    path = user_home / ".hermes/config.yaml"
    _write(path, HERMES_ANCHORED)
    assert manager.install_agent("hermes", target, env, mtplx_home).status == "installed"
    assert yaml.safe_load(path.read_text())["defaults"] == {"provider": "openrouter"}
    undone = manager.uninstall_agent("hermes", mtplx_home)
    assert undone.status == "uninstalled", undone.error
    assert path.read_bytes() == HERMES_ANCHORED.encode()


def test_hermes_reinstall_into_another_home_cleans_up_an_aliased_earlier_install(env, mtplx_home, target,
                                                                                 user_home, tmp_path):
    first = user_home / ".hermes/config.yaml"
    _write(first, HERMES_ANCHORED)
    manager.install_agent("hermes", target, env, mtplx_home)
    elsewhere = tmp_path / "hermes-b"
    result = manager.install_agent("hermes", target, {**env, "HERMES_HOME": str(elsewhere)}, mtplx_home)
    assert result.status == "installed", result.error
    assert first.read_bytes() == HERMES_ANCHORED.encode()
    assert yaml.safe_load((elsewhere / "config.yaml").read_text())["model"]["default"] == target.model_id


def test_an_earlier_install_that_cannot_be_cleaned_up_is_that_agents_error_only(env, mtplx_home, target,
                                                                                user_home, tmp_path):
    first = user_home / ".hermes/config.yaml"
    manager.install_agent("hermes", target, env, mtplx_home)
    _write(first, "model: [unclosed\n")  # the user broke it since
    moved = {**env, "HERMES_HOME": str(tmp_path / "hermes-b")}
    hermes, pi = run_install(["hermes", "pi"], target, moved, mtplx_home, dry_run=False)
    assert hermes.status == "error" and "earlier install" in hermes.error and str(first) in hermes.error
    assert not (tmp_path / "hermes-b").exists() and first.read_text() == "model: [unclosed\n"
    assert pi.status == "installed"
    first.unlink()  # moved aside, as the message says: the install goes ahead
    assert manager.install_agent("hermes", target, moved, mtplx_home).status == "installed"


CRLF_FILES = {
    "opencode": (".config/opencode/opencode.json", '{\r\n  // mine\r\n  "theme": "dark"\r\n}\r\n'),
    "codex": (".codex/config.toml", '# mine\r\nmodel = "gpt-5"\r\n\r\n[tui]\r\nnotifications = true\r\n'),
    "hermes": (".hermes/config.yaml", "# mine\r\nterminal:\r\n  backend: local\r\n"),
}


@pytest.mark.parametrize("agent", list(CRLF_FILES))
def test_crlf_file_keeps_its_line_breaks_and_uninstalls_to_the_original_bytes(agent, env, mtplx_home, target,
                                                                              user_home):
    rel, original = CRLF_FILES[agent]
    path = user_home / rel
    _write(path, original)
    result = manager.install_agent(agent, target, env, mtplx_home)
    assert result.status == "installed", result.error
    written = path.read_bytes()
    assert written.count(b"\n") == written.count(b"\r\n") > original.count("\n")
    assert result.files[0].backup.read_bytes() == original.encode()
    manager.uninstall_agent(agent, mtplx_home)
    assert path.read_bytes() == original.encode()


def test_file_mixing_line_breaks_is_edited_as_it_is(env, mtplx_home, target, user_home):
    original = '{\r\n  "theme": "dark",\n  "x": 1\r\n}\n'
    path = user_home / ".config/opencode/opencode.json"
    _write(path, original)
    manager.install_agent("opencode", target, env, mtplx_home)
    assert json.loads(path.read_text())["theme"] == "dark"
    manager.uninstall_agent("opencode", mtplx_home)
    assert path.read_bytes() == original.encode()
