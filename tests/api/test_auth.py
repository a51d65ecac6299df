"""API keys (keyring or 0600 file), `mtplxctl key`, the non-loopback start rule, 401s, CORS."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import anthropic
import httpx
import keyring
import keyring.backend
import keyring.backends.fail
import openai
import pytest

from support.api_daemon import daemon_env, start_api_daemon
from mtplxd.api.auth import ENV_KEY, is_authorized, key_file, load_key, presented_keys, rotate_key, store_key
from mtplxd.paths import Paths
from mtplxctl.cli import main as ctl_main


class MemoryKeyring(keyring.backend.KeyringBackend):
    """Stands in for the OS keychain, which this Linux test machine does not have."""

    priority = 1

    def __init__(self) -> None:
        super().__init__()
        self.entries: dict[tuple[str, str], str] = {}

    def get_password(self, service, username):
        return self.entries.get((service, username))

    def set_password(self, service, username, password):
        self.entries[(service, username)] = password

    def delete_password(self, service, username):
        self.entries.pop((service, username), None)


@pytest.fixture
def no_keyring():
    previous = keyring.get_keyring()
    keyring.set_keyring(keyring.backends.fail.Keyring())
    yield
    keyring.set_keyring(previous)


@pytest.fixture
def memory_keyring():
    previous = keyring.get_keyring()
    backend = MemoryKeyring()
    keyring.set_keyring(backend)
    yield backend
    keyring.set_keyring(previous)


def test_without_a_keyring_the_key_goes_to_a_0600_file(no_keyring):
    paths = Paths.from_env()
    stored = rotate_key(paths)
    path = key_file(paths)
    assert stored.source == str(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert load_key(paths, environ={}) == stored
    assert rotate_key(paths).key != stored.key


def test_a_working_keyring_holds_the_key_per_home_and_no_file_is_left(memory_keyring):
    paths = Paths.from_env()
    assert store_key(paths, "mtplx-first") == "keyring"
    assert not key_file(paths).exists()
    assert load_key(paths, environ={}).key == "mtplx-first"
    assert load_key(paths, environ={}).source == "keyring"
    (account,) = [user for (_, user) in memory_keyring.entries]
    assert str(paths.home.resolve()) in account


def test_environment_key_wins(no_keyring):
    paths = Paths.from_env()
    rotate_key(paths)
    assert load_key(paths, environ={ENV_KEY: "from-env"}).source == "env"


def test_keys_are_read_from_bearer_and_x_api_key():
    assert presented_keys({"Authorization": "Bearer abc", "X-Api-Key": "def"}) == ["abc", "def"]
    assert presented_keys({"Authorization": "Basic abc"}) == []
    assert is_authorized({"Authorization": "Bearer right"}, "right")
    assert is_authorized({"X-Api-Key": "right"}, "right")
    assert not is_authorized({"Authorization": "Bearer wrong"}, "right")
    assert not is_authorized({}, "right")


def test_mtplxctl_key_show_and_rotate(no_keyring, capsys):
    assert ctl_main(["key", "show"]) == 1
    assert "mtplxctl key rotate" in capsys.readouterr().err
    assert ctl_main(["key", "rotate", "--json"]) == 0
    import json

    rotated = json.loads(capsys.readouterr().out)
    assert rotated["key"].startswith("mtplx-") and rotated["restart_required"] is False
    assert ctl_main(["key", "show", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["key"] == rotated["key"]


def test_daemon_refuses_a_non_loopback_bind_without_a_key(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mtplxd", "--host", "0.0.0.0", "--no-model"],
                          env=daemon_env(tmp_path / "home"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "without an API key" in done.stderr and "mtplxctl key rotate" in done.stderr


@pytest.fixture(scope="module")
def exposed(tmp_path_factory):
    """A daemon on 0.0.0.0 with a key in its 0600 file and one allowed browser origin."""
    home = tmp_path_factory.mktemp("exposed-home")
    key = "mtplx-test-key-123"
    (home / "secrets").mkdir(mode=0o700)
    (home / "secrets" / "api_key").write_text(key + "\n")
    os.chmod(home / "secrets" / "api_key", 0o600)
    daemon = start_api_daemon(home, "--host", "0.0.0.0", "--no-model", wait_model=False,
                              MTPLX_CORS_ORIGINS="http://app.example")
    try:
        yield daemon, key
    finally:
        daemon.stop()


def test_exposed_daemon_wants_the_key_in_each_dialect(exposed):
    daemon, key = exposed
    missing = httpx.get(daemon.base_url + "/v1/models")
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["type"] == "authentication_error"
    assert httpx.get(daemon.base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
    assert httpx.get(daemon.base_url + "/v1/models", headers={"x-api-key": key}).status_code == 200
    assert httpx.get(daemon.base_url + "/health").json()["api_key_required"] is True
    with pytest.raises(anthropic.AuthenticationError) as err:
        anthropic.Anthropic(base_url=daemon.base_url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    assert err.value.body["error"]["type"] == "authentication_error"
    with openai.OpenAI(base_url=daemon.base_url + "/v1", api_key=key, max_retries=0) as client:
        assert client.models.list().data == []
        with pytest.raises(openai.APIStatusError) as err:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        assert err.value.status_code == 503 and err.value.code == "model_not_loaded"


def test_cors_is_same_origin_by_default_with_an_allow_list(exposed):
    daemon, key = exposed
    auth = {"Authorization": f"Bearer {key}"}
    url = daemon.base_url + "/v1/models"
    evil = httpx.get(url, headers={**auth, "Origin": "http://evil.example"})
    assert evil.status_code == 403 and evil.json()["error"]["code"] == "cors_forbidden"
    assert "access-control-allow-origin" not in evil.headers  # its page cannot read the refusal
    evil_preflight = httpx.options(url, headers={"Origin": "http://evil.example",
                                                 "Access-Control-Request-Method": "POST"})
    assert evil_preflight.status_code == 403 and "access-control-allow-origin" not in evil_preflight.headers
    listed = httpx.get(url, headers={**auth, "Origin": "http://app.example"})
    assert listed.status_code == 200
    assert listed.headers["access-control-allow-origin"] == "http://app.example"
    same = httpx.get(url, headers={**auth, "Origin": f"http://127.0.0.1:{daemon.port}"})
    assert same.status_code == 200
    preflight = httpx.options(url, headers={"Origin": "http://app.example",
                                            "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 204
    assert "Authorization" in preflight.headers["access-control-allow-headers"]
    # What the SDKs send from a browser, and the session header the docs name, are allowed as asked.
    asked = "content-type,x-mtplx-session-id,x-stainless-os,x-stainless-retry-count"
    sdk = httpx.options(url, headers={"Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers": asked})
    assert sdk.status_code == 204 and sdk.headers["access-control-allow-headers"] == asked
    assert httpx.get(url, headers=auth).headers.get("access-control-allow-origin") is None
