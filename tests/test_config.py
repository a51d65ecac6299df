"""config.toml: typed keys, environment overrides, errors that name the key, atomic writes."""

from __future__ import annotations

import os
import stat

import pytest
import tomllib

from mtplxd.config import ConfigError, load_config, set_in_file
from mtplxd.paths import Paths


def test_defaults_then_file_then_environment(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('port = 9000\ndepth = 2\n')
    config = load_config(path, environ={"MTPLX_DEPTH": "4"})
    assert (config.port, config.sources["port"]) == (9000, "file")
    assert (config.depth, config.sources["depth"]) == (4, "env")
    assert (config.host, config.sources["host"]) == ("127.0.0.1", "default")


@pytest.mark.parametrize("text, named", [
    ("port = 'eighty'\n", 'port cannot be "eighty"'),
    ("depth = 99\n", 'depth cannot be "99": it must be auto or a whole number from 0 to 8'),
    ("fan_mode = 'loud'\n", 'fan_mode cannot be "loud"'),
    ("colour = 'blue'\n", "no setting named colour"),
    ("port = \n", "not valid TOML"),
    ("cohort_widths = [3, 0]\n", "cohort_widths cannot be .*whole number from 1 to 64"),
    ("cohort_widths = []\n", "cohort_widths cannot be .*such as 1,3,8"),
    ("numerics = 'fast'\n", 'numerics cannot be "fast"'),
    ("cohort_cycle = 'fast'\n", 'cohort_cycle cannot be "fast"'),
])
def test_invalid_file_names_the_key(tmp_path, text, named):
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=named):
        load_config(path, environ={})


def test_cohort_settings_read_a_toml_list_or_a_comma_separated_variable(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("cohort_widths = [8, 3, 3]\nnumerics = 'exact'\n")
    config = load_config(path, environ={"MTPLX_COHORTS": "always"})
    assert (config.cohort_widths, config.numerics, config.cohorts) == ([3, 8], "exact", "always")
    config = load_config(path, environ={"MTPLX_COHORT_WIDTHS": "1, 3,8"})
    assert (config.cohort_widths, config.sources["cohort_widths"]) == ([1, 3, 8], "env")
    assert load_config(tmp_path / "none.toml", environ={}).cohort_widths == [1, 3, 8]
    assert load_config(tmp_path / "none.toml", environ={}).cohort_cycle == "fused"
    config = load_config(path, environ={"MTPLX_COHORT_CYCLE": "phased"})
    assert (config.cohort_cycle, config.sources["cohort_cycle"]) == ("phased", "env")


def test_invalid_environment_value_names_the_variable(tmp_path):
    with pytest.raises(ConfigError, match="MTPLX_PORT"):
        load_config(tmp_path / "none.toml", environ={"MTPLX_PORT": "-1"})


def test_set_keeps_other_keys_and_the_file_mode(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('host = "127.0.0.1"\nmodel = "/models/x"\n')
    os.chmod(path, 0o600)
    set_in_file(path, "port", "8123")
    assert tomllib.loads(path.read_text()) == {"host": "127.0.0.1", "model": "/models/x", "port": 8123}
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    set_in_file(path, "model", "")
    assert "model" not in tomllib.loads(path.read_text())
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_daemon_refuses_to_start_on_an_invalid_config():
    import subprocess
    import sys

    paths = Paths.from_env()
    paths.home.mkdir(parents=True, exist_ok=True)
    paths.config_file.write_text("depth = 'deep'\n")
    result = subprocess.run([sys.executable, "-m", "mtplxd", "--no-model"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert 'depth cannot be "deep"' in result.stderr
