"""Which BLAS MLX's CPU backend calls: the choice per OS, the self-check, the one-line fallback."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from mtplxd import blas
from support.daemon import run_ctl, start_daemon

DEBIAN = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


def only(*paths: str):
    """A fake filesystem in which only `paths` exist."""
    return lambda path: path in paths


def good_probe(library):
    return {"exact": True, "max_error": 0.0, "gflops": 120.0, "provider": library}


def fail(*_args):
    raise AssertionError("must not be called")


def test_macos_keeps_accelerate_and_loads_nothing():
    assert blas.plan("darwin", "arm64", {}, only(DEBIAN)).kind == blas.ACCELERATE
    assert blas.plan("darwin", "arm64", {blas.ENV: DEBIAN}, only(DEBIAN)).kind == blas.ACCELERATE
    status = blas.resolve(blas.plan("darwin", "arm64", {}, only()), good_probe, fail, lambda: False)
    assert status.kind == blas.ACCELERATE and status.degraded is None and status.gflops == 120.0


def test_linux_finds_the_distributions_openblas_per_architecture():
    assert blas.plan("linux", "x86_64", {}, only(DEBIAN)) == blas.Plan(blas.OPENBLAS, DEBIAN)
    arm = "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0"
    assert blas.plan("linux", "aarch64", {}, only(arm)).library == arm
    fedora = "/usr/lib64/libopenblasp.so.0"
    assert blas.plan("linux", "x86_64", {}, only(fedora)).library == fedora
    assert blas.plan("linux", "x86_64", {}, only(), find=lambda name: "libopenblas.so.0").library \
        == "libopenblas.so.0"  # elsewhere: whatever the linker's cache calls libopenblas


def test_environment_overrides_the_choice():
    assert blas.plan("linux", "x86_64", {blas.ENV: "bundled"}, only(DEBIAN)).kind == blas.BUNDLED
    assert blas.plan("linux", "x86_64", {blas.ENV: "/opt/my/libblis.so"},
                     only(DEBIAN, "/opt/my/libblis.so")).library == "/opt/my/libblis.so"
    missing = blas.plan("linux", "x86_64", {blas.ENV: "/nope.so"}, only(DEBIAN))
    assert missing.kind == blas.BUNDLED and "/nope.so" in missing.reason


def test_asked_for_bundled_is_not_a_degradation():
    chosen = blas.plan("linux", "x86_64", {blas.ENV: "bundled"}, only(DEBIAN))
    status = blas.resolve(chosen, fail, fail, lambda: False)
    assert status.kind == blas.BUNDLED and status.degraded is None


def bundled_probe(library):
    assert library is None
    return {"exact": True, "max_error": 0.0, "gflops": 4.0, "provider": None, "gpu": False}


def test_missing_openblas_falls_back_in_one_line_with_the_fix():
    chosen = blas.plan("linux", "x86_64", {}, only(), find=lambda name: None)
    status = blas.resolve(chosen, bundled_probe, fail, lambda: False)
    assert status.kind == blas.BUNDLED and status.gflops == 4.0
    assert "\n" not in status.degraded and blas.APT_FIX in status.degraded
    assert "4 GFLOP/s" in status.summary()


def test_missing_openblas_is_no_degradation_when_a_gpu_does_the_matmuls():
    chosen = blas.plan("linux", "x86_64", {}, only(), find=lambda name: None)
    status = blas.resolve(chosen, lambda lib: {**bundled_probe(lib), "gpu": True}, fail, lambda: False)
    assert status.kind == blas.BUNDLED and status.degraded is None


@pytest.mark.parametrize("answer", [
    {"exact": False, "max_error": 3.0, "gflops": 99.0, "provider": DEBIAN},  # wrong results
    {"exact": False, "error": "self-check failed (Illegal instruction)"},     # crashed the child
    {"exact": True, "max_error": 0.0, "gflops": 5.0, "provider": None},       # not in effect
])
def test_wrong_or_crashing_library_is_never_loaded(answer):
    loaded = []
    status = blas.resolve(blas.Plan(blas.OPENBLAS, DEBIAN), lambda lib: answer, loaded.append,
                            lambda: False)
    assert loaded == [] and status.kind == blas.BUNDLED and DEBIAN in status.degraded


def test_checked_library_is_loaded_and_reported():
    loaded = []
    status = blas.resolve(blas.Plan(blas.OPENBLAS, DEBIAN), good_probe, loaded.append, lambda: False)
    assert loaded == [DEBIAN]
    assert (status.kind, status.library, status.gflops, status.degraded) == (blas.OPENBLAS, DEBIAN, 120.0, None)
    assert DEBIAN in status.summary() and "120 GFLOP/s" in status.summary()


def test_too_late_after_mlx_was_imported():
    status = blas.resolve(blas.Plan(blas.OPENBLAS, DEBIAN), fail, fail, lambda: True)
    assert status.kind == blas.BUNDLED and "imported before" in status.degraded


def test_probe_runs_the_self_check_in_a_child():
    bundled = blas.probe(None)
    assert bundled["exact"] is True and bundled["max_error"] == 0.0 and bundled["gflops"] > 0
    broken = blas.probe("/nonexistent/libopenblas.so.0")
    assert broken["exact"] is False and "self-check failed" in broken["error"]


def test_this_process_runs_on_what_activate_chose():
    chosen = blas.status()
    assert chosen is not None  # tests/conftest.py activated it before MLX was imported
    if chosen.kind == blas.OPENBLAS:
        assert os.path.realpath(blas.sgemm_provider()) == os.path.realpath(chosen.library)
    elif chosen.kind == blas.BUNDLED:
        assert blas.sgemm_provider() is None


def test_daemon_reports_a_fallback_in_status_health_and_doctor():
    running = start_daemon("--no-model", env={blas.ENV: "/nonexistent/libopenblas.so.0"})
    try:
        status = running.client.call("daemon.status")
        base = status["http"]["base_url"].removesuffix("/v1")
        health = httpx.get(f"{base}/health", timeout=10).json()
        shown = run_ctl("status")
        doctor = json.loads(run_ctl("doctor", "--json").stdout)
    finally:
        running.stop()
    assert status["blas"]["kind"] == blas.BUNDLED and "nonexistent" in status["blas"]["degraded"]
    assert {"what": "blas", "why": status["blas"]["degraded"]} in health["degradations"]
    assert "BLAS" in shown.stdout and "bundled" in shown.stdout
    (check,) = [c for c in doctor["checks"] if c["check"] == "blas"]
    assert check["level"] == "warn" and blas.APT_FIX in check["detail"]


def test_daemon_reports_its_blas():
    running = start_daemon("--no-model")
    try:
        status = running.client.call("daemon.status")
    finally:
        running.stop()
    assert status["blas"]["kind"] == blas.activate().kind


def test_install_uses_apt_as_root_sudo_otherwise_and_nothing_elsewhere():
    tools = {"apt-get": "/usr/bin/apt-get", "sudo": "/usr/bin/sudo"}
    root = blas.install_commands("linux", 0, tools.get)
    assert root[0] == ["apt-get", "install", "-y", "-q", "--no-install-recommends", blas.APT_PACKAGE]
    assert root[1] == ["apt-get", "update", "-q"] and root[2] == root[0]
    assert blas.install_commands("linux", 1000, tools.get)[0][:2] == ["sudo", "apt-get"]
    assert blas.install_commands("linux", 1000, {"apt-get": "/usr/bin/apt-get"}.get) is None
    assert blas.install_commands("linux", 0, {}.get) is None  # not an apt system
    assert blas.install_commands("darwin", 0, tools.get) is None


def test_blas_command_reports_the_self_check():
    shown = json.loads(run_ctl("blas", "--json").stdout)
    assert shown["kind"] == blas.activate().kind and shown["install"] is None
    assert shown["summary"]
