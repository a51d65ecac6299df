"""User settings: one typed table of documented keys, read from `config.toml`.

Precedence, lowest to highest: the default, `config.toml`, the environment (`MTPLX_<KEY>` in
upper case), and for one run the command line. Every effective value remembers where it came
from, so `mtplxctl config get` and `status` can say why a value is what it is.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import tomli_w

from mtplxd.atomic import write_atomic


class ConfigError(ValueError):
    """A setting is unknown or has a value of the wrong kind; the message names the key."""


def as_whole_number(low: int, high: int) -> Callable[[Any], int]:
    """A parser for an integer from `low` to `high` whose error says so in words (settings and
    mtplxctl's integer options share it)."""

    def parse(value: Any) -> int:
        plain = f"must be a whole number from {low} to {high}"
        if isinstance(value, bool):
            raise ValueError(plain)
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ValueError(plain) from None
        if not low <= number <= high:
            raise ValueError(plain)
        return number

    return parse


def _as_depth(value: Any) -> str | int:
    """`auto` or a depth from 0 to 8."""
    return _as_auto_or_int(0, 8)(value)


def _as_auto_or_int(low: int, high: int) -> Callable[[Any], str | int]:
    as_int = as_whole_number(low, high)

    def parse(value: Any) -> str | int:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            return as_int(value)
        except ValueError:
            raise ValueError(f"must be auto or a whole number from {low} to {high}") from None

    return parse


def _as_kv_bits(value: Any) -> str | int:
    """`auto`, 0, 4 or 8."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    if isinstance(value, bool) or str(value).strip() not in ("0", "4", "8"):
        raise ValueError("must be auto, 0, 4 or 8")
    return int(value)


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in {"1", "true", "yes", "on"}:
        return True
    if text in {"0", "false", "no", "off"}:
        return False
    raise ValueError("must be true or false")


def _as_choice(*choices: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return text

    return parse


def _as_optional_str(value: Any) -> str | None:
    text = str(value).strip()
    return text or None


def _as_str(value: Any) -> str:
    return str(value)


def _as_memory_limit(value: Any) -> str | float:
    """`auto`, `max`, or a number of GiB."""
    if isinstance(value, str) and value.strip().lower() in {"auto", "max"}:
        return value.strip().lower()
    plain = "must be auto, max or a positive number of GiB"
    number = _as_number(value, plain)
    if number <= 0:
        raise ValueError(plain)
    return number


def _as_number(value: Any, plain: str) -> float:
    """float(value), with `plain` (what the setting takes) as the error instead of Python's."""
    if isinstance(value, bool):
        raise ValueError(plain)
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(plain) from None


def _as_auto_or_gib(value: Any) -> str | float:
    """`auto`, or a number of GiB (0 turns the thing off)."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return "auto"
    plain = "must be auto or a number of GiB (0 = off)"
    number = _as_number(value, plain)
    if number < 0:
        raise ValueError(plain)
    return number


def _as_str_list(value: Any) -> list[str]:
    if isinstance(value, str):
        return [item.strip() for item in value.split(",") if item.strip()]
    if isinstance(value, list) and all(isinstance(item, str) for item in value):
        return list(value)
    raise ValueError("must be a list of strings (or a comma-separated string)")


def _as_cohort_widths(value: Any) -> list[int]:
    """Cohort widths: whole numbers from 1 to 64, a list or a comma-separated string."""
    items = _as_str_list(value) if isinstance(value, str) else value
    as_width = as_whole_number(1, 64)
    if not isinstance(items, list) or not items:
        raise ValueError("must be a list of whole numbers from 1 to 64, such as 1,3,8")
    return sorted({as_width(item) for item in items})


@dataclass(frozen=True)
class Setting:
    """One documented configuration key."""

    name: str
    default: Any
    parse: Callable[[Any], Any]
    doc: str


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in [
        Setting("model", None, _as_optional_str,
                "Model to load at start: a served id, a Hub repo, or a local folder. "
                "Empty means the embedded demo model."),
        Setting("host", "127.0.0.1", _as_str, "HTTP bind address. Non-loopback needs an API key."),
        Setting("port", 8000, as_whole_number(0, 65535), "HTTP port (0 picks a free port)."),
        Setting("depth", "auto", _as_depth,
                "MTP draft depth: auto (the model's recommended depth for this backend, else "
                "3), 0 (plain AR) to 8."),
        Setting("decode_loop", "auto", _as_choice("auto", "fused", "stepwise"),
                "MTP decode loop: fused (each cycle one compiled device graph, read a cycle "
                "late), stepwise (the host reads every cycle), or auto (fused on CUDA and CPU, "
                "stepwise on Metal)."),
        Setting("cpu_attention", "auto", _as_choice("auto", "numpy", "mlx"),
                "Attention of long prefill chunks on the CPU backend: auto or numpy (block-wise "
                "in numpy, many times faster from a few hundred tokens) or mlx (MLX's own "
                "attention everywhere). Decode and verify steps always run MLX's."),
        Setting("quantize", "auto", _as_choice("auto", "none", "8bit", "4bit"),
                "Quantize an unquantized model as it loads: 8bit, 4bit, none, or auto (what the "
                "model's config asks for on CUDA; the embedded model asks for 8bit there)."),
        Setting("dequantize", "auto", _as_choice("auto", "on", "off"),
                "Linux CPU: serve a quantized model's weights as dense float32 (faster there, "
                "MTP on by default; 8x the memory of 4-bit weights): auto while they take at "
                "most half the memory limit (not a model the quantize setting quantized), on "
                "(up to the whole limit), or off. Elsewhere ignored."),
        Setting("kv_bits", "auto", _as_kv_bits,
                "Attention KV cache quantization: 8 or 4 bits, 0 (full precision), or auto (the "
                "model's config.json mtplx_kv_bits, else 0). Halves (8) or quarters (4) KV memory."),
        Setting("memory_limit", "auto", _as_memory_limit,
                "Memory limit: auto, max, or GiB."),
        Setting("fan_mode", "auto", _as_choice("auto", "max", "smart"),
                "Fan control: auto never touches fans; max and smart take manual control."),
        Setting("fan_idle_minutes", 5, as_whole_number(1, 1440),
                "In smart mode, minutes without requests before fans return to automatic."),
        Setting("fan_backend", "auto", _as_choice("auto", "hwmon", "smc", "none"),
                "Fan backend: auto (SMC helper on macOS, hwmon on Linux), hwmon, smc or none."),
        Setting("hwmon_root", "/sys/class/hwmon", _as_str,
                "Linux: the hwmon directory whose pwmN/pwmN_enable files control the fans."),
        Setting("smc_helper", "/usr/local/libexec/mtplx-fan-helper", _as_str,
                "macOS: the root-owned SMC fan helper run with `sudo -n` (docs/fans.md)."),
        Setting("cors_origins", [], _as_str_list,
                "Origins allowed to call the HTTP API from a browser (same-origin when empty)."),
        Setting("session_bank_ssd", True, _as_bool,
                "Keep conversation prefixes on disk so they survive a restart."),
        Setting("session_bank_bytes", "auto", _as_auto_or_gib,
                "RAM for reusable conversation prefixes: auto (from the memory plan, else "
                "2 GiB) or GiB; 0 turns prefix reuse off."),
        Setting("session_bank_ssd_bytes", "auto", _as_auto_or_gib,
                "Disk for the session bank under session-bank/: auto (32 GiB, never more "
                "than half the free disk) or GiB."),
        Setting("body_timeout_seconds", 30, as_whole_number(1, 3600),
                "How long a client may take to send a request body before it gets a 408 "
                "(a stalled or trickling upload must not hold a worker)."),
        Setting("max_concurrent", "auto", _as_auto_or_int(1, 64),
                "Generations decoding at once (scheduler rows, stepped a cycle at a time, "
                "verified together in cohorts): auto (8 on CUDA, 4 on Metal and CPU) or 1 to "
                "64; 1 serves one at a time."),
        Setting("cohorts", "auto", _as_choice("auto", "always", "off"),
                "MTP cohorts (several rows' drafts verified in one batched forward): auto "
                "(a request that starts beside others joins cohorts; a lone one keeps the "
                "single-stream loop), always, or off (rows interleave one at a time)."),
        Setting("cohort_widths", [1, 3, 8], _as_cohort_widths,
                "Rows per cohort forward; a cohort is sealed at the narrowest width that holds "
                "its rows (fixed widths keep GPU kernel shapes few). 1 is always included."),
        Setting("numerics", "auto", _as_choice("auto", "exact", "throughput"),
                "Cohort numerics: exact (each row's verify forward alone: bit-identical to "
                "solo decoding), throughput (one batched forward: may round apart from solo "
                "where batched matmuls do), or auto (docs/concurrency.md)."),
        Setting("cohort_cycle", "fused", _as_choice("fused", "phased"),
                "How a dense model's MTP cohort runs a cycle: fused (the whole cycle for all "
                "its rows as one compiled graph, read one cycle late) or phased (drafting, "
                "verify and settle as separate steps). Hybrid models, images and exact "
                "numerics always run phased (docs/concurrency.md)."),
        Setting("max_queued", 64, as_whole_number(0, 4096),
                "Requests that may wait for a free row; one more gets HTTP 429 with "
                "Retry-After."),
        Setting("prefill_chunk_tokens", 512, as_whole_number(64, 8192),
                "Prompt tokens per prefill forward. A long prompt is read one chunk per "
                "scheduler turn, so running streams pause at most one chunk's time for it."),
        Setting("hosts", None, _as_optional_str,
                "A host file (mlx.launch's hosts.json) to serve the model over several hosts "
                "with MLX distributed; rank 0 is this machine. Empty: one host "
                "(docs/distributed.md)."),
        Setting("pipeline_split", None, _as_optional_str,
                "Layers per rank for a distributed group, e.g. 20,12 (empty: in proportion to "
                "each host's memory)."),
        Setting("group_timeout_seconds", 60, as_whole_number(1, 3600),
                "Longest a distributed group's rank may take to answer one exchange before the "
                "group is declared lost (requests get 503 group_lost)."),
        Setting("group_port", 32323, as_whole_number(0, 65535),
                "First TCP port of a distributed group's ring (one port per rank); 0 picks free "
                "ports, for groups whose ranks all run on this machine."),
        Setting("embedding_model", [], _as_str_list,
                "Embedding models served at /v1/embeddings (Qwen3-Embedding kind): folders or "
                "pulled repo ids, loaded on first request."),
        Setting("reranker_model", [], _as_str_list,
                "Reranker models served at /v1/rerank (Qwen3-Reranker kind): folders or pulled "
                "repo ids, loaded on first request."),
        Setting("retrieval_resident_limit", 2, as_whole_number(1, 64),
                "Embedding and reranker models kept loaded at once (least recently used goes)."),
        Setting("retrieval_trust_remote_code", False, _as_bool,
                "Serve retrieval checkpoints that ship their own Python code (auto_map)."),
        Setting("repetition_guard", "auto", _as_choice("auto", "on", "off"),
                "Runaway-loop guard: ends a generation caught repeating one span (finish_reason "
                "length, stats repetition_stop): auto (for requests without an output cap or with "
                "one of 8,192 tokens or more, as agents send), on (every request) or off. A "
                "request's `repetition_guard` true/false overrides it."),
        Setting("repetition_min_tokens", 128, as_whole_number(16, 1_000_000),
                "Runaway-loop guard: the fewest tokens a repetition must cover to end the output."),
        Setting("repetition_min_repeats", 6, as_whole_number(2, 10_000),
                "Runaway-loop guard: the fewest times the repeated span must occur."),
        Setting("shutdown_grace_seconds", 10, as_whole_number(0, 600),
                "How long SIGTERM waits for in-flight requests before stopping."),
        Setting("log_prompts", False, _as_bool,
                "Add each request's last message (its first 200 characters) to its line in "
                "logs/mtplxd.log. Off by default: the log then holds no prompt text."),
        Setting("flight_recorder", True, _as_bool,
                "Keep one JSON line per request (timings, cache reuse, per-second decode "
                "samples, no prompt text) under metrics/ for `mtplxctl trace`."),
        Setting("flight_recorder_mb", 256, as_whole_number(1, 1_048_576),
                "Disk cap of the flight recorder's files in MB (rotated: the oldest go first)."),
        Setting("log_level", "info", _as_choice("debug", "info", "warning", "error"),
                "Daemon log level."),
    ]
}


def env_name(key: str) -> str:
    """The environment variable that overrides `key`."""
    return "MTPLX_" + key.upper()


@dataclass
class Config:
    """Effective settings and where each came from (default, file, env or cli)."""

    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["values"][name]
        except KeyError:
            raise AttributeError(name) from None

    def override(self, key: str, value: Any, source: str = "cli") -> None:
        """Set `key` for this run only (for example from a command-line flag)."""
        self.values[key] = parse_value(key, value)
        self.sources[key] = source

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {
            key: {"value": self.values[key], "source": self.sources[key]} for key in SETTINGS
        }


def unknown_setting(key: str) -> ConfigError:
    """The error for a key that is not a setting, listing the ones that are."""
    return ConfigError(f"there is no setting named {key}; the settings are "
                       f"{', '.join(sorted(SETTINGS))}")


def toml_value(value: Any) -> str:
    """`value` as config.toml writes it (what `config get` shows); "" for an unset key."""
    if value is None:
        return ""
    if isinstance(value, list):  # one line, where tomli_w would spread an array over several
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    return tomli_w.dumps({"v": value}).strip().removeprefix("v = ")


def invalid_value(key: str, value: Any, reason: Any, where: str = "") -> ConfigError:
    """The error for a bad value: the key, the value as written and what the key takes."""
    shown = value if isinstance(value, str) else toml_value(value)
    return ConfigError(f"{where}{key} cannot be \"{shown}\": it {reason}")


def parse_value(key: str, value: Any) -> Any:
    """Validate `value` for `key`; raise ConfigError naming the key on failure."""
    setting = SETTINGS.get(key)
    if setting is None:
        raise unknown_setting(key)
    try:
        return setting.parse(value)
    except (TypeError, ValueError) as exc:
        raise invalid_value(key, value, exc) from None


def read_file(path: Path) -> dict[str, Any]:
    """The raw table in `config.toml` ({} when the file does not exist)."""
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        return {}
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path} is not valid TOML: {exc}") from None


def load_config(path: Path, environ: dict[str, str] | None = None) -> Config:
    """Merge defaults, `path` and the environment into a validated Config."""
    environ = os.environ if environ is None else environ
    config = Config()
    raw = read_file(path)
    for key in raw:
        if key not in SETTINGS:
            raise ConfigError(f"{path}: {unknown_setting(key)}")
    for key, setting in SETTINGS.items():
        if env_name(key) in environ:
            value, source = environ[env_name(key)], "env"
        elif key in raw:
            value, source = raw[key], "file"
        else:
            config.values[key], config.sources[key] = setting.default, "default"
            continue
        try:
            config.values[key] = setting.parse(value)
        except (TypeError, ValueError) as exc:
            where = env_name(key) if source == "env" else f"{path}"
            raise invalid_value(key, value, exc, where=f"{where}: ") from None
        config.sources[key] = source
    return config


def settings_now(path: Path) -> dict[str, Any]:
    """The effective settings (defaults, `path`, the environment), or {} when they cannot be
    read: for comparing with what a running daemon saw (the daemon names a bad setting when it
    starts)."""
    try:
        return load_config(path).values
    except ConfigError:
        return {}


def set_in_file(path: Path, key: str, value: Any) -> Any:
    """Validate and persist one key in `config.toml` (atomic, other keys kept); return the value.

    An empty string removes the key, so the default applies again.
    """
    if key not in SETTINGS:
        raise unknown_setting(key)
    raw = read_file(path)
    parsed = None if value == "" else parse_value(key, value)
    if parsed is None:
        raw.pop(key, None)
    else:
        raw[key] = parsed
    write_atomic(path, tomli_w.dumps(raw).encode())
    return parsed
