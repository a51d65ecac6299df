"""Safe-merge guarantees: refuse unparseable files, back up, keep modes, no-op when unchanged,
respect location overrides, reference keys instead of pasting them, leave user changes alone."""

from __future__ import annotations

import json
import stat
import tomllib
from pathlib import Path

import pytest
import yaml

from mtplxctl.agents import manager
from mtplxctl.agents.jsonc import JsoncDocument
from mtplxctl.agents.record import load_record, record_path
from mtplxctl.agents.target import AgentTarget, NoModelLoaded

BROKEN = {
    "opencode": (".config/opencode/opencode.json", '{ "model": "x",, }'),
    "pi": (".pi/agent/models.json", '{ "providers": { "a": 1 '),
    "hermes": (".hermes/config.yaml", "model: [unclosed\n"),
    "codex": (".codex/config.toml", 'model = "gpt-5\n'),
    "claude": (".claude/settings.json", "not json"),
}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize("agent", list(BROKEN))
def test_unparseable_file_is_refused_untouched_with_a_clear_message(agent, env, mtplx_home, target, user_home):
    rel, text = BROKEN[agent]
    path = user_home / rel
    path.parent.mkdir(parents=True)
    path.write_text(text)
    result = manager.install_agent(agent, target, env, mtplx_home)
    assert result.status == "error"
    assert str(path) in result.error and "left it untouched" in result.error
    assert path.read_text() == text
    assert list(path.parent.iterdir()) == [path] or agent == "pi"  # no backup, no temp file
    assert not [p for p in path.parent.iterdir() if "backup" in p.name]
    assert agent not in load_record(mtplx_home)


def test_jsonc_parse_error_names_line_and_column():
    with pytest.raises(ValueError, match="line 3 column 3"):
        JsoncDocument('{\n  "a": 1\n  "b": 2\n}')


def test_reinstall_with_nothing_to_change_writes_nothing(env, mtplx_home, target, user_home):
    path = user_home / ".codex/config.toml"
    path.parent.mkdir()
    path.write_text('approval_policy = "never"\n')
    first = manager.install_agent("codex", target, env, mtplx_home)
    assert first.status == "installed" and first.files[0].backup is not None
    before = (path.stat().st_mtime_ns, sorted(p.name for p in path.parent.iterdir()))
    second = manager.install_agent("codex", target, env, mtplx_home)
    assert second.status == "unchanged" and second.files[0].action == "unchanged"
    assert (path.stat().st_mtime_ns, sorted(p.name for p in path.parent.iterdir())) == before


def test_backup_holds_the_original_and_keeps_its_mode(env, mtplx_home, target, user_home):
    path = user_home / ".hermes/config.yaml"
    path.parent.mkdir()
    path.write_text("terminal:\n  backend: local\n")
    path.chmod(0o640)
    result = manager.install_agent("hermes", target, env, mtplx_home)
    backup = result.files[0].backup
    assert backup.read_text() == "terminal:\n  backend: local\n"
    assert _mode(backup) == 0o640
    assert _mode(path) == 0o640  # rewritten with the original permissions


def test_new_files_are_0600_in_0700_dirs_and_the_record_is_0600(env, mtplx_home, target, user_home):
    manager.install_agent("pi", target, env, mtplx_home)
    for name in ("models.json", "settings.json"):
        assert _mode(user_home / ".pi/agent" / name) == 0o600
    assert _mode(user_home / ".pi") == 0o700
    assert _mode(record_path(mtplx_home)) == 0o600
    manager.uninstall_agent("pi", mtplx_home)
    assert not (user_home / ".pi").exists()  # created files and dirs go away again


def test_symlinked_config_is_written_through_the_link(env, mtplx_home, target, user_home):
    real = user_home / "dotfiles/opencode.json"
    real.parent.mkdir()
    real.write_text('{"theme": "x"}\n')
    link = user_home / ".config/opencode/opencode.json"
    link.parent.mkdir(parents=True)
    link.symlink_to(real)
    manager.install_agent("opencode", target, env, mtplx_home)
    assert link.is_symlink()
    assert json.loads(real.read_text())["model"] == "mtplx/mtplx-tiny-coder"


@pytest.mark.parametrize("agent, variable, rel", [
    ("opencode", "XDG_CONFIG_HOME", "opencode/opencode.json"),
    ("opencode", "OPENCODE_CONFIG", ""),
    ("pi", "PI_CODING_AGENT_DIR", "models.json"),
    ("hermes", "HERMES_HOME", "config.yaml"),
    ("codex", "CODEX_HOME", "config.toml"),
    ("claude", "CLAUDE_CONFIG_DIR", "settings.json"),
])
def test_location_overrides_are_respected(agent, variable, rel, env, mtplx_home, target, tmp_path, user_home):
    place = tmp_path / "elsewhere" / ("mtplx.json" if variable == "OPENCODE_CONFIG" else "")
    env = {**env, variable: str(place)}
    manager.install_agent(agent, target, env, mtplx_home)
    written = place / rel if rel else place
    assert written.is_file()
    assert not any(user_home.rglob("*.json")) and not any(user_home.rglob("*.toml"))
    manager.uninstall_agent(agent, mtplx_home)  # the record remembers where, without the variable
    assert not written.exists()


def test_opencode_writes_the_jsonc_file_that_exists(env, mtplx_home, target, user_home):
    directory = user_home / ".config/opencode"
    directory.mkdir(parents=True)
    (directory / "opencode.jsonc").write_text("{\n  // mine\n}\n")
    manager.install_agent("opencode", target, env, mtplx_home)
    assert not (directory / "opencode.json").exists()
    assert "// mine" in (directory / "opencode.jsonc").read_text()


def test_keyed_daemon_is_referenced_from_the_environment_never_pasted(env, mtplx_home, keyed_target, user_home):
    secret = "sk-this-must-not-appear"
    env = {**env, "MTPLX_API_KEY": secret}
    for agent in manager.AGENTS:
        assert manager.install_agent(agent, keyed_target, env, mtplx_home).status == "installed"
    for path in user_home.rglob("*"):
        if path.is_file():
            assert secret not in path.read_text()
    opencode = json.loads((user_home / ".config/opencode/opencode.json").read_text())
    assert opencode["provider"]["mtplx"]["options"]["apiKey"] == "{env:MTPLX_API_KEY}"
    codex = tomllib.loads((user_home / ".codex/config.toml").read_text())
    assert codex["model_providers"]["mtplx"]["env_key"] == "MTPLX_API_KEY"
    pi = json.loads((user_home / ".pi/agent/models.json").read_text())
    assert pi["providers"]["mtplx"]["apiKey"] == "!printenv MTPLX_API_KEY"
    hermes = yaml.safe_load((user_home / ".hermes/config.yaml").read_text())
    assert hermes["model"]["provider"] == "custom:mtplx"
    assert hermes["custom_providers"] == [{"name": "mtplx", "base_url": "http://127.0.0.1:8000/v1",
                                           "key_env": "MTPLX_API_KEY", "api_mode": "chat_completions",
                                           "models": {"mtplx-tiny-coder": {"context_length": 32768}}}]
    claude = json.loads((user_home / ".claude/settings.json").read_text())
    assert claude["apiKeyHelper"] == "printenv MTPLX_API_KEY" and "ANTHROPIC_AUTH_TOKEN" not in claude["env"]


def test_hermes_with_a_key_refuses_to_take_over_the_users_custom_providers(env, mtplx_home, keyed_target, user_home):
    path = user_home / ".hermes/config.yaml"
    path.parent.mkdir()
    path.write_text("custom_providers:\n  - name: work\n    base_url: https://gpu.example/v1\n")
    result = manager.install_agent("hermes", keyed_target, env, mtplx_home)
    assert result.status == "error" and "custom_providers" in result.error
    assert path.read_text() == "custom_providers:\n  - name: work\n    base_url: https://gpu.example/v1\n"


def test_uninstall_leaves_an_entry_the_user_changed_after_install(env, mtplx_home, target, user_home):
    path = user_home / ".pi/agent/settings.json"
    path.parent.mkdir(parents=True)
    path.write_text('{"defaultProvider": "anthropic", "defaultModel": "claude"}\n')
    manager.install_agent("pi", target, env, mtplx_home)
    text = path.read_text().replace('"defaultModel": "mtplx-tiny-coder"', '"defaultModel": "other"')
    path.write_text(text)
    result = manager.uninstall_agent("pi", mtplx_home)
    assert any("defaultModel" in note for note in result.notes)
    assert json.loads(path.read_text()) == {"defaultProvider": "anthropic", "defaultModel": "other"}


def test_reinstall_for_a_new_model_keeps_the_users_original_for_uninstall(env, mtplx_home, target, user_home):
    path = user_home / ".codex/config.toml"
    path.parent.mkdir()
    original = 'model = "gpt-5"  # mine\n'
    path.write_text(original)
    manager.install_agent("codex", target, env, mtplx_home)
    bigger = AgentTarget(target.base_url, "mtplx-big", 65536, 16384, True, None)
    assert manager.install_agent("codex", bigger, env, mtplx_home).status == "installed"
    assert tomllib.loads(path.read_text())["model"] == "mtplx-big"
    manager.uninstall_agent("codex", mtplx_home)
    assert path.read_text() == original


def test_dry_run_writes_nothing_and_keeps_no_record(env, mtplx_home, target, user_home):
    result = manager.install_agent("opencode", target, env, mtplx_home, dry_run=True)
    assert result.files[0].action == "created" and '"mtplx"' in result.files[0].text
    assert not (user_home / ".config").exists() and not record_path(mtplx_home).exists()


def test_install_all_picks_the_agents_found_here_and_leaves_claude_to_be_named(env, mtplx_home, user_home):
    (user_home / ".codex").mkdir()
    (user_home / ".claude").mkdir()
    assert manager.resolve_names(["all"], True, env, mtplx_home) == ["codex"]
    assert manager.resolve_names(["all"], False, env, mtplx_home) == list(manager.AGENTS)


def test_target_from_status_needs_a_loaded_model():
    status = {"http": {"base_url": "http://127.0.0.1:8000/v1", "key_required": False}, "model": None}
    with pytest.raises(NoModelLoaded):
        AgentTarget.from_status(status)
    status["model"] = {"id": "x", "state": "loading"}
    with pytest.raises(NoModelLoaded, match="loading"):
        AgentTarget.from_status(status)


def test_a_created_file_the_user_added_to_is_kept_on_uninstall(env, mtplx_home, target, user_home):
    manager.install_agent("claude", target, env, mtplx_home)
    path = user_home / ".claude/settings.json"
    data = json.loads(path.read_text())
    data["theme"] = "dark"
    path.write_text(json.dumps(data, indent=2) + "\n")
    result = manager.uninstall_agent("claude", mtplx_home)
    assert result.files[0].action == "updated"
    assert path.read_text() == '{\n  "theme": "dark"\n}\n'


def test_hermes_string_model_setting_is_replaced_and_restored(env, mtplx_home, target, user_home):
    path = user_home / ".hermes/config.yaml"
    path.parent.mkdir()
    original = "# mine\nmodel: anthropic/claude-opus-4   # set by `hermes config set model`\n"
    path.write_text(original)
    assert manager.install_agent("hermes", target, env, mtplx_home).status == "installed"
    assert yaml.safe_load(path.read_text())["model"]["default"] == "mtplx-tiny-coder"
    manager.uninstall_agent("hermes", mtplx_home)
    assert path.read_text() == original


def test_codex_table_where_a_plain_value_goes_is_refused(env, mtplx_home, target, user_home):
    path = user_home / ".codex/config.toml"
    path.parent.mkdir()
    path.write_text("[web_search]\nmode = 1\n")
    result = manager.install_agent("codex", target, env, mtplx_home)
    assert result.status == "error" and "web_search holds a table" in result.error
    assert path.read_text() == "[web_search]\nmode = 1\n"
