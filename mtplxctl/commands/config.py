"""config get|set: read and change config.toml (through the daemon when it runs)."""

from __future__ import annotations

import argparse
from typing import Any

from mtplxd.config import (
    SETTINGS, ConfigError, load_config, parse_value, set_in_file, toml_value, unknown_setting,
)
from mtplxd.paths import Paths
from mtplxctl.client import ControlClient, ControlError, DaemonNotRunning
from mtplxctl.output import EXIT_OK, console, fail, print_json, wrapping_table


def register(subparsers: argparse._SubParsersAction) -> None:
    config = subparsers.add_parser("config", help="read or change settings (config.toml)")
    verbs = config.add_subparsers(dest="verb", metavar="VERB", required=True)
    get = verbs.add_parser("get", help="show settings and where each value comes from")
    get.add_argument("key", nargs="?", help="one setting (default: all)")
    get.add_argument("--json", action="store_true", help="machine-readable output")
    get.set_defaults(func=cmd_get)
    set_ = verbs.add_parser("set", help="change a setting (an empty VALUE restores the default)")
    set_.add_argument("key", help=f"one of: {', '.join(SETTINGS)}")
    set_.add_argument("value")
    set_.add_argument("--json", action="store_true", help="machine-readable output")
    set_.set_defaults(func=cmd_set)


def _via_daemon(method: str, params: dict[str, Any]) -> dict[str, Any] | None:
    """The daemon's answer, or None when it is not running (then the file is used directly)."""
    try:
        return ControlClient.from_env().call(method, params)
    except DaemonNotRunning:
        return None


def cmd_get(args: argparse.Namespace) -> int:
    paths = Paths.from_env()
    try:
        answer = _via_daemon("config.get", {"key": args.key} if args.key else {})
        if answer is None:
            table = load_config(paths.config_file).to_dict()
            if args.key and args.key not in table:
                raise unknown_setting(args.key)
            settings = {args.key: table[args.key]} if args.key else table
            answer = {"settings": settings, "file": str(paths.config_file)}
    except (ConfigError, ControlError) as exc:
        return fail(str(exc))
    if args.json:
        print_json(answer)
        return EXIT_OK
    table = wrapping_table("setting", "value", "source", "meaning")
    table.columns[1].max_width = 24  # a long path folds; the meaning takes the rest
    for key, entry in answer["settings"].items():
        table.add_row(key, toml_value(entry["value"]) or "(unset)", entry["source"],
                      SETTINGS[key].doc)
    console.print(table)
    console.print(f"[dim]file: {answer['file']}; environment overrides: MTPLX_<SETTING>[/]")
    return EXIT_OK


def cmd_set(args: argparse.Namespace) -> int:
    paths = Paths.from_env()
    try:
        wanted = model_setting(args.key, args.value) if args.key in MODEL_SETTINGS else args.value
        answer = _via_daemon("config.set", {"key": args.key, "value": wanted})
        if answer is None:
            value = set_in_file(paths.config_file, args.key, wanted)
            answer = {"key": args.key, "value": value, "applies": "start", "restart_required": False}
    except (ConfigError, ControlError) as exc:
        hint = None if args.key not in SETTINGS else \
            f"`mtplxctl config get {args.key}` shows what it means and its current value"
        return fail(str(exc), hint)
    if args.json:
        print_json(answer)
    else:
        shown = "(default)" if answer["value"] is None else toml_value(answer["value"])
        console.print(f"{args.key} = {shown}", markup=False)
        console.print(WHEN[answer.get("applies", "start")])
    return EXIT_OK


# The settings that name models: a folder there is checked and made absolute as it is set.
MODEL_SETTINGS = ("model", "embedding_model", "reranker_model")


def model_setting(key: str, value: str) -> Any:
    """`value` for a model setting with each path made absolute (the daemon reads it from its
    own working folder); raises ConfigError for a path that names no folder, as `start
    --model` and `models pull` refuse it. A repo id is kept as given: it may be pulled later."""
    from mtplxd.models.spec import absolute_spec, missing_folder

    if value == "":
        return value  # removes the key
    specs = parse_value(key, value)
    for spec in [specs] if isinstance(specs, str) else specs:
        problem = missing_folder(spec)
        if problem is not None:
            raise ConfigError(f"{key}: {problem}")
    return absolute_spec(specs) if isinstance(specs, str) else [absolute_spec(s) for s in specs]


# What `config set` says about when the change takes effect (the daemon's "applies").
WHEN = {
    "now": "applied now",
    "next_load": "takes effect at the next model load (`mtplxctl restart`)",
    "restart": "takes effect at the next `mtplxctl restart`",
    "start": "takes effect when mtplxd starts (`mtplxctl start`)",
}
