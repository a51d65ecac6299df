"""Safe merge: apply an agent's owned entries to one config file, and take them away again.

An install touches only the entries (key paths) an agent owns. For each it records what the
file held there before (the exact source text) and which parent objects it had to create, so
that uninstall restores the file to what it was. An entry the user has changed since install
is theirs: uninstall leaves it. Nothing is written when nothing would change; an existing file
is backed up before it is rewritten; a file that does not parse is refused untouched.

Before anything is written, the new text is parsed again and must read as exactly the data
the file held with the entries set (or restored): an editor that would change anything else
of the user's (a TOML table header landing among another table's keys) gets the file refused,
untouched, instead. Files are edited with LF line breaks and written back with their own.
"""

from __future__ import annotations

import copy
import hashlib
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from tomlkit.exceptions import TOMLKitError

from . import files
from .data import same_data
from .errors import AgentConfigError, ConfigEditError, ConfigParseError, SyntaxProblem
from .jsonc import MISSING as JSON_MISSING, JsoncDocument
from .tomldoc import MISSING as TOML_MISSING, TomlDocument
from .yamlblocks import MISSING as YAML_MISSING, YamlDocument

FORMATS = {"jsonc": JsoncDocument, "toml": TomlDocument, "yaml": YamlDocument}
_MISSING = (JSON_MISSING, TOML_MISSING, YAML_MISSING)
_PRISTINE_EMPTY = ("", "{}")


def is_missing(value: Any) -> bool:
    """True for the "no such key" marker of any document format."""
    return any(value is marker for marker in _MISSING)


@dataclass(frozen=True)
class Entry:
    """One key path an agent owns in a file, and the value it sets there."""

    key: tuple[str, ...]
    value: Any


@dataclass(frozen=True)
class FilePlan:
    """The entries an agent wants in one file of a given format."""

    path: Path
    fmt: str
    entries: tuple[Entry, ...]


@dataclass
class FileResult:
    """What an install or uninstall did (or, in a dry run, would do) to one file."""

    path: Path
    action: str  # "created", "updated", "unchanged", "deleted", "missing"
    backup: Path | None = None
    kept: list[str] = field(default_factory=list)
    text: str | None = None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary (without the file text)."""
        return {
            "path": str(self.path),
            "action": self.action,
            "backup": str(self.backup) if self.backup else None,
            "kept_user_changes": self.kept,
        }


class Loaded(NamedTuple):
    """A parsed config file: the document, its text with LF line breaks (None when the file
    does not exist), and the line break the file uses, to write it back with."""

    doc: Any
    text: str | None
    newline: str


def load(path: Path, fmt: str) -> Loaded:
    """Parse `path` as `fmt`.

    Raises ConfigParseError naming the file when it does not parse.
    """
    cls = FORMATS[fmt]
    raw = files.read_text(path)
    newline = files.line_break(raw or "")
    text = files.with_lf(raw, newline) if raw is not None else None
    try:
        return Loaded(cls(text) if text is not None else cls.empty(), text, newline)
    except SyntaxProblem as exc:
        raise ConfigParseError(str(path), cls.fmt, str(exc)) from None


def _put(data: dict, key: tuple[str, ...], value: Any) -> None:
    """Set `key` in plain `data`, creating parent dicts."""
    node = data
    for part in key[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[key[-1]] = copy.deepcopy(value)


def _drop(data: dict, key: tuple[str, ...]) -> None:
    """Delete `key` from plain `data` when it is there."""
    node: Any = data
    for part in key[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(key[-1], None)


def _after_reverts(before: dict, doc: Any, reverted: list[dict[str, Any]]) -> dict:
    """`before` with each reverted entry as `doc` now holds it: restored, kept, or removed
    (with the parents it had created, where the revert removed them too)."""
    expected = copy.deepcopy(before)
    for entry in reverted:
        key = tuple(entry["key"])
        value = doc.get(key)
        if is_missing(value):
            _drop(expected, key)
        else:
            _put(expected, key, value)
        for parent in reversed([tuple(p) for p in entry.get("created_parents", [])]):
            if is_missing(doc.get(parent)):
                _drop(expected, parent)
    return expected


def _check_reads_as(path: Path, fmt: str, text: str, expected: dict) -> None:
    """Raise ConfigEditError unless `text`, parsed afresh, is exactly `expected`.

    The last guard before a write: whatever an editor did, the file must hold the user's
    settings unchanged beside (or restored around) the entries.
    """
    cls = FORMATS[fmt]
    try:
        reading = cls(text).data()
    except SyntaxProblem as exc:
        raise ConfigEditError(str(path), cls.fmt, f"the edited text would not parse: {exc}") from None
    if not same_data(reading, expected):
        moved = sorted(k for k in set(reading) | set(expected) if not same_data(reading.get(k), expected.get(k)))
        raise ConfigEditError(str(path), cls.fmt, f"the edit would also change {', '.join(moved)}")


def _revert(doc: Any, entry: dict[str, Any], kept: list[str]) -> None:
    """Undo one recorded entry in `doc` unless the user changed it since."""
    key = tuple(entry["key"])
    current = doc.get(key)
    if is_missing(current):
        pass
    elif current != entry["value"]:
        kept.append(".".join(key))
        return
    elif entry["previous"] is not None:
        doc.set(key, None, raw=entry["previous"])
    else:
        doc.remove(key)
    for parent in reversed([tuple(p) for p in entry.get("created_parents", [])]):
        if doc.get(parent) == {}:
            doc.remove(parent)


def _shape(text: str | None) -> dict[str, Any] | None:
    """The original's whitespace runs and hash: enough to restore its spacing, not its content."""
    if text is None:
        return None
    return {"sha256": hashlib.sha256(text.encode()).hexdigest(), "spaces": re.findall(r"\s+", text),
            "lead": text[:1].isspace(), "trail": text[-1:].isspace()}


def _heal_whitespace(text: str, shape: dict[str, Any] | None) -> str:
    """`text` with the original's spacing when that rebuilds the original exactly.

    tomlkit can leave a blank line where it had separated a removed key or table; when the
    words of the text are the original's, the original's whitespace (checked by hash) wins.
    """
    if not shape:
        return text
    words = re.split(r"\s+", text.strip())
    spaces = shape["spaces"]
    lead = spaces[0] if shape["lead"] and spaces else ""
    trail = spaces[-1] if shape["trail"] and spaces else ""
    inner = spaces[int(shape["lead"]): len(spaces) - int(shape["trail"])]
    if len(inner) != len(words) - 1:
        return text
    candidate = lead + "".join(w + s for w, s in zip(words, inner + [""])) + trail
    if hashlib.sha256(candidate.encode()).hexdigest() == shape["sha256"]:
        return candidate
    return text


def _trailing(text: str) -> str:
    """The whitespace a file ends with."""
    return text[len(text.rstrip()):]


def _type_clash(doc: Any, current: Any, value: Any) -> bool:
    """True when a TOML table would replace a plain value or the other way round.

    JSONC and YAML restore a replaced value from its exact text, whatever its type; tomlkit
    cannot put a table back where a plain value stood (or the reverse) without moving it.
    """
    return isinstance(doc, TomlDocument) and not is_missing(current) and isinstance(current, dict) != isinstance(value, dict)


# What an editor raises for a file it cannot edit; each becomes a ConfigEditError naming the file.
EDIT_FAILURES = (ValueError, TOMLKitError)


def _edit_error(path: Path, fmt: str, exc: Exception) -> AgentConfigError:
    """The error to report for an editor's failure on the parsed file at `path`."""
    if isinstance(exc, SyntaxProblem):
        return ConfigParseError(str(path), FORMATS[fmt].fmt, str(exc))
    return ConfigEditError(str(path), FORMATS[fmt].fmt, str(exc) or type(exc).__name__)


def install_file(plan: FilePlan, prior: dict[str, Any] | None, dry_run: bool = False) -> tuple[FileResult, dict[str, Any]]:
    """Merge `plan` into its file; return what happened and the record to keep for uninstall.

    `prior` is this file's record from an earlier install (None the first time): entries still
    holding the value written then keep their original `previous`, so repeated installs never
    lose what the user had before the first one.
    """
    doc, original, newline = load(plan.path, plan.fmt)
    before = doc.data()
    # A file holding no settings (blank, comments only, `{}`) is given back as it was.
    empty_original = original if original is not None and doc.data() == {} else None
    prior_entries = {tuple(e["key"]): e for e in (prior or {}).get("entries", [])}
    wanted = {entry.key for entry in plan.entries}
    kept: list[str] = []
    reverted = [old for key, old in prior_entries.items() if key not in wanted]
    try:
        for old in reverted:
            _revert(doc, old, kept)
        entries = []
        for entry in plan.entries:
            current = doc.get(entry.key)
            old = prior_entries.get(entry.key)
            if _type_clash(doc, current, entry.value):
                kinds = ("a table", "a plain value")
                raise AgentConfigError(
                    f"{plan.path}: {'.'.join(entry.key)} holds {kinds[not isinstance(current, dict)]} where mtplx "
                    f"writes {kinds[not isinstance(entry.value, dict)]}; mtplxctl left the file untouched. "
                    "Rename or remove that setting, then run the command again.")
            still_ours = old is not None and not is_missing(current) and current == old["value"]
            previous = old["previous"] if still_ours else doc.raw(entry.key)
            created = old.get("created_parents", []) if still_ours else []
            if is_missing(current) or current != entry.value:
                created = created + [list(p) for p in doc.set(entry.key, entry.value)]
            entries.append({"key": list(entry.key), "value": entry.value, "previous": previous,
                            "created_parents": created})
    except EDIT_FAILURES as exc:
        raise _edit_error(plan.path, plan.fmt, exc) from None
    record = {
        "path": str(plan.path),
        "format": plan.fmt,
        "created_file": prior["created_file"] if prior else original is None,
        "created_dirs": prior["created_dirs"] if prior else [str(d) for d in files.missing_dirs(files.real_path(plan.path))],
        "entries": entries,
        # tomlkit can leave a blank line behind where it separated a removed table.
        "trailing": prior.get("trailing") if prior else (None if original is None else _trailing(original)),
        "empty_original": prior.get("empty_original") if prior else empty_original,
        "original_shape": prior.get("original_shape") if prior else _shape(original),
    }
    text = doc.dumps()
    if original is not None and text == original:
        return FileResult(plan.path, "unchanged", text=files.with_newline(text, newline)), record
    expected = _after_reverts(before, doc, reverted)
    for entry in plan.entries:
        _put(expected, entry.key, entry.value)
    _check_reads_as(plan.path, plan.fmt, text, expected)
    action = "created" if original is None else "updated"
    text = files.with_newline(text, newline)
    saved = None if dry_run else files.write_config(plan.path, text, existed=original is not None)
    return FileResult(plan.path, action, backup=saved, kept=kept, text=text), record


def uninstall_file(record: dict[str, Any], dry_run: bool = False) -> FileResult:
    """Remove what `record` says an install added to its file, restoring what was there.

    A file that install created and that holds nothing else afterwards is deleted, with the
    directories install created for it when they are empty.
    """
    path, fmt = Path(record["path"]), record["format"]
    doc, original, newline = load(path, fmt)
    if original is None:
        return FileResult(path, "missing")
    before = doc.data()
    kept: list[str] = []
    try:
        for entry in reversed(record["entries"]):
            _revert(doc, entry, kept)
    except EDIT_FAILURES as exc:
        raise _edit_error(path, fmt, exc) from None
    text = doc.dumps()
    if record.get("trailing") is not None:
        text = text.rstrip() + record["trailing"]
    if doc.data() == {} and record.get("empty_original") is not None:
        text = record["empty_original"]
    text = _heal_whitespace(text, record.get("original_shape"))
    if record["created_file"] and doc.data() == {}:
        if dry_run:
            return FileResult(path, "deleted", kept=kept, text="")
        saved = files.delete_config(path, keep_backup=text.strip() not in _PRISTINE_EMPTY)
        files.remove_empty_dirs([Path(d) for d in record.get("created_dirs", [])])
        return FileResult(path, "deleted", backup=saved, kept=kept, text="")
    if text == original:
        return FileResult(path, "unchanged", kept=kept, text=files.with_newline(text, newline))
    _check_reads_as(path, fmt, text, _after_reverts(before, doc, list(reversed(record["entries"]))))
    text = files.with_newline(text, newline)
    saved = None if dry_run else files.write_config(path, text, existed=True)
    return FileResult(path, "updated", backup=saved, kept=kept, text=text)
