"""Property: for any user config, install then uninstall gives back the original bytes.

User configs are generated per format (JSON with comments and varied indentation, TOML with
comments, YAML with comments), including keys that collide with the ones mtplx owns, so
the record-and-restore path is exercised as well as plain insertion.
"""

from __future__ import annotations

import json
import tempfile
import tomllib
from pathlib import Path

import tomli_w
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from mtplxctl.agents import manager
from mtplxctl.agents.target import AgentTarget

TARGET = AgentTarget("http://127.0.0.1:8000/v1", "mtplx-tiny-coder", 32768, 8192, True, None)
KEYED = AgentTarget("http://127.0.0.1:8000/v1", "mtplx-tiny-coder", 32768, 8192, False, "MTPLX_API_KEY")
FILES = {
    "opencode": ".config/opencode/opencode.json",
    "pi": ".pi/agent/settings.json",
    "claude": ".claude/settings.json",
    "codex": ".codex/config.toml",
    "hermes": ".hermes/config.yaml",
}
OWNED_KEYS = ["model", "small_model", "provider", "providers", "defaultProvider", "defaultModel", "env",
              "model_provider", "web_search", "features", "model_providers", "custom_providers", "apiKeyHelper"]

keys = st.one_of(st.sampled_from(OWNED_KEYS), st.text("abcdefghij_", min_size=1, max_size=8))
scalars = st.one_of(st.booleans(), st.integers(-10**6, 10**6), st.text("abc xyz-_/.:", max_size=12))


def _configs(leaf):
    return st.recursive(leaf, lambda inner: st.dictionaries(keys, inner, max_size=4), max_leaves=12)


json_configs = st.dictionaries(keys, _configs(st.one_of(scalars, st.none(), st.lists(scalars, max_size=3))), max_size=6)
toml_configs = st.dictionaries(keys, _configs(st.one_of(scalars, st.lists(st.integers(0, 9), max_size=3))), max_size=6)
yaml_configs = json_configs


def _with_comments(text: str, marker: str, picks: list[bool]) -> str:
    """Put a comment line before some lines (between members, never inside a string)."""
    out = []
    for line, add in zip(text.splitlines(keepends=True), picks + [False] * len(text)):
        if add and not line.lstrip().startswith(("]", "}")):
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}{marker} user note\n")
        out.append(line)
    return "".join(out)


def _implicit_features_table(data: dict) -> bool:
    """A `features` table present only through sub-tables ([features.x]) and no plain keys.

    Adding `image_generation` makes tomlkit write an explicit `[features]` header, which stays
    after the key is removed: the parsed config is equal, the bytes differ by that header.
    """
    features = data.get("features")
    return isinstance(features, dict) and bool(features) and all(isinstance(v, dict) for v in features.values())


def _dotted_toml(data: dict) -> str:
    """`data` as TOML with every table written as dotted keys among the top-level keys
    (`a.b.c = 1`), the form in which tomlkit used to put new tables in the wrong place."""
    lines = []

    def leaves(node: dict, prefix: tuple[str, ...]) -> None:
        for key, value in node.items():
            if isinstance(value, dict) and value:
                leaves(value, prefix + (key,))
            else:
                spelled = " = {}\n" if value == {} else tomli_w.dumps({"v": value})[1:]
                lines.append(".".join(prefix + (key,)) + spelled)

    leaves(data, ())
    return "".join(lines)


def _with_entries(data: dict, agent: str, target: AgentTarget, home: Path) -> dict:
    """`data` with each entry of `agent`'s plan set: what the installed file must read as."""
    out = json.loads(json.dumps(data))
    for entry in manager.AGENTS[agent].plans(target, {"HOME": str(home)})[0].entries:
        node = out
        for key in entry.key[:-1]:
            node = node.setdefault(key, {})
        node[entry.key[-1]] = entry.value
    return out


def _round_trip(agent: str, text: str, target: AgentTarget, exact: bool = True, crlf: bool = False) -> None:
    if crlf:
        text = text.replace("\n", "\r\n")
    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        path = home / FILES[agent]
        path.parent.mkdir(parents=True)
        path.write_bytes(text.encode())
        env = {"HOME": str(home), "PATH": ""}
        result = manager.install_agent(agent, target, env, Path(tmp) / "mtplx")
        if result.status == "error":
            # Only a user value of the wrong type where mtplx needs an object may stop it.
            assert any(reason in result.error for reason in
                       ("is not an object", "is not a table", "where mtplx writes", "custom_providers")), result.error
            assert path.read_bytes() == text.encode()
            return
        installed = path.read_bytes()
        assert (crlf and "\n" in text) == (installed.count(b"\r\n") == installed.count(b"\n"))
        if agent == "codex":
            assert tomllib.loads(installed.decode()) == _with_entries(tomllib.loads(text), agent, target, home)
        manager.uninstall_agent(agent, Path(tmp) / "mtplx")
        if exact:
            assert path.read_bytes() == text.encode()
        else:
            assert tomllib.loads(path.read_text()) == tomllib.loads(text)
            assert [l for l in path.read_text().splitlines() if "#" in l] == [l for l in text.splitlines() if "#" in l]


settings_ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@settings_
@given(data=json_configs, indent=st.sampled_from([None, 2, 4, "\t"]), agent=st.sampled_from(["opencode", "pi", "claude"]),
       picks=st.lists(st.booleans(), max_size=40), keyed=st.booleans(), crlf=st.booleans())
def test_json_install_then_uninstall_is_identity(data, indent, agent, picks, keyed, crlf):
    text = json.dumps(data, indent=indent) + "\n"
    if indent is not None:
        text = _with_comments(text, "//", picks)
    _round_trip(agent, text, KEYED if keyed else TARGET, crlf=crlf)


@settings_
@given(data=toml_configs, picks=st.lists(st.booleans(), max_size=40), keyed=st.booleans(), crlf=st.booleans())
def test_toml_install_then_uninstall_is_identity(data, picks, keyed, crlf):
    text = _with_comments(tomli_w.dumps(data), "#", picks)
    _round_trip("codex", text, KEYED if keyed else TARGET, exact=not _implicit_features_table(data), crlf=crlf)


@settings_
@given(data=toml_configs, picks=st.lists(st.booleans(), max_size=40), keyed=st.booleans())
def test_toml_written_with_dotted_keys_installs_into_the_merged_data_and_uninstalls_to_itself(data, picks, keyed):
    _round_trip("codex", _with_comments(_dotted_toml(data), "#", picks), KEYED if keyed else TARGET)


@settings_
@given(data=yaml_configs, picks=st.lists(st.booleans(), max_size=40), keyed=st.booleans(), crlf=st.booleans())
def test_yaml_install_then_uninstall_is_identity(data, picks, keyed, crlf):
    text = _with_comments(yaml.safe_dump(data, sort_keys=False), "#", picks)
    _round_trip("hermes", text, KEYED if keyed else TARGET, crlf=crlf)


@settings_
@given(data=json_configs, agent=st.sampled_from(["opencode", "pi", "claude"]),
       added=st.dictionaries(st.text("klmnop", min_size=1, max_size=5).map(lambda k: "user_" + k), scalars, min_size=1, max_size=3))
def test_settings_the_user_adds_while_installed_survive_uninstall(data, agent, added):
    from mtplxctl.agents.jsonc import JsoncDocument

    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp) / "home"
        path = home / FILES[agent]
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(data, indent=2) + "\n")
        env = {"HOME": str(home), "PATH": ""}
        if manager.install_agent(agent, TARGET, env, Path(tmp) / "mtplx").status == "error":
            return
        doc = JsoncDocument(path.read_text())
        for key, value in added.items():
            doc.set((key,), value)
        path.write_text(doc.dumps())
        manager.uninstall_agent(agent, Path(tmp) / "mtplx")
        assert JsoncDocument(path.read_text()).data() == {**data, **added}
