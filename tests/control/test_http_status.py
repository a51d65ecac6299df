"""The API base URL the daemon reports is one a client on this machine can use."""

from __future__ import annotations

import pytest

from mtplxd.config import load_config
from mtplxd.daemon import Daemon
from mtplxd.paths import Paths


@pytest.mark.parametrize("host, url, key", [
    ("127.0.0.1", "http://127.0.0.1:8123/v1", False),
    ("::1", "http://[::1]:8123/v1", False),
    ("0.0.0.0", "http://127.0.0.1:8123/v1", True),  # every interface: loopback reaches it
    ("::", "http://[::1]:8123/v1", True),
    ("192.168.7.9", "http://192.168.7.9:8123/v1", True),
])
def test_base_url_and_key_requirement_follow_the_bind_address(host, url, key, tmp_path):
    paths = Paths.from_env()
    config = load_config(paths.config_file, environ={"MTPLX_HOST": host, "MTPLX_PORT": "8123"})
    http = Daemon(config, paths, load_model=False).http_status()
    assert (http["base_url"], http["key_required"]) == (url, key)
