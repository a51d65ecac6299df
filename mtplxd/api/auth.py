"""The HTTP API key: where it lives, and how a request proves it has it.

Precedence when reading: `MTPLX_API_KEY` in the daemon's environment, then the OS keychain
(through `keyring`, service "mtplx", one entry per MTPLX_HOME), then the 0600 file
`$MTPLX_HOME/secrets/api_key` (the fallback when no keyring backend works, e.g. headless
Linux). Requests present it as `Authorization: Bearer KEY` or `x-api-key: KEY`; it is
compared in constant time. A daemon bound to loopback needs no key; bound anywhere else it
refuses to start without one (see `mtplxd.__main__`).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from mtplxd.atomic import write_atomic
from mtplxd.paths import Paths

log = logging.getLogger(__name__)

ENV_KEY = "MTPLX_API_KEY"
KEYRING_SERVICE = "mtplx"
KEY_PREFIX = "mtplx-"


@dataclass(frozen=True)
class StoredKey:
    """A key and where it was found (`env`, `keyring` or the file path)."""

    key: str
    source: str


def key_file(paths: Paths) -> Path:
    """The fallback file holding the key."""
    return paths.secrets_dir / "api_key"


def keyring_account(paths: Paths) -> str:
    """The keyring entry name: one per MTPLX_HOME, so test homes never share the user's key."""
    return f"api-key:{paths.home.expanduser().resolve()}"


def load_key(paths: Paths, environ: Mapping[str, str] | None = None) -> StoredKey | None:
    """The effective API key, or None when none is configured anywhere."""
    environ = os.environ if environ is None else environ
    if environ.get(ENV_KEY):
        return StoredKey(environ[ENV_KEY], "env")
    from_keyring = _keyring_get(paths)
    if from_keyring:
        return StoredKey(from_keyring, "keyring")
    path = key_file(paths)
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    if os.stat(path).st_mode & 0o077:
        os.chmod(path, 0o600)  # a key readable by others is tightened, not trusted as is
    return StoredKey(text, str(path)) if text else None


def new_key() -> str:
    """A fresh random key (192 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(24)


def store_key(paths: Paths, key: str) -> str:
    """Save `key` in the keychain, else in the 0600 file; return where it went."""
    if _keyring_set(paths, key):
        try:
            key_file(paths).unlink()  # one place only: a stale file would confuse `key show`
        except FileNotFoundError:
            pass
        return "keyring"
    path = key_file(paths)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    write_atomic(path, (key + "\n").encode(), mode=0o600)
    return str(path)


def rotate_key(paths: Paths) -> StoredKey:
    """Replace the stored key with a fresh one."""
    key = new_key()
    return StoredKey(key, store_key(paths, key))


def _keyring_get(paths: Paths) -> str | None:
    try:
        import keyring

        return keyring.get_password(KEYRING_SERVICE, keyring_account(paths))
    except Exception as exc:  # no backend, locked keychain, dbus missing: all mean "not there"
        log.debug("keyring unavailable: %s", exc)
        return None


def _keyring_set(paths: Paths, key: str) -> bool:
    try:
        import keyring

        keyring.set_password(KEYRING_SERVICE, keyring_account(paths), key)
        return keyring.get_password(KEYRING_SERVICE, keyring_account(paths)) == key
    except Exception as exc:
        log.debug("keyring unavailable, using the 0600 file: %s", exc)
        return False


def presented_keys(headers: Mapping[str, str]) -> list[str]:
    """Keys a request presents (Bearer token and x-api-key)."""
    keys = []
    authorization = headers.get("Authorization") or ""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        keys.append(token.strip())
    if headers.get("X-Api-Key"):
        keys.append(headers["X-Api-Key"].strip())
    return keys


def is_authorized(headers: Mapping[str, str], expected: str) -> bool:
    """True when one presented key equals `expected` (constant-time comparison)."""
    wanted = expected.encode()
    matched = False
    for key in presented_keys(headers):
        matched |= hmac.compare_digest(key.encode(), wanted)
    return matched
