"""`launchctl print` / `print-disabled` parsing, against samples in launchctl's real format."""

from __future__ import annotations

from pathlib import Path

from mtplxctl.launchd.print_parser import parse_disabled, parse_print

DATA = Path(__file__).resolve().parent / "data"


def _sample(name: str) -> str:
    return (DATA / name).read_text()


def test_running_job_reports_pid_state_and_never_exited():
    job = parse_print(_sample("print_running.txt"))
    assert job.running and job.pid == 4711 and job.state == "running"
    assert job.last_exit == "(never exited)" and job.last_exit_code is None
    assert job.last_signal is None
    assert job.runs == 1 and job.exit_timeout == 30
    assert job.arguments == ["/Users/dev/.venvs/mtplx/bin/python", "-m", "mtplxd"]
    assert job.environment["XPC_SERVICE_NAME"] == "com.mtplx.mtplxd"
    assert job.properties == ["keepalive", "runatload", "inferred program"]
    assert job.path == "/Users/dev/Library/LaunchAgents/com.mtplx.mtplxd.plist"


def test_nested_blocks_do_not_leak_into_top_level_fields():
    # "activation rate" and the environment's PATH live in nested blocks; state/pid stay top-level.
    job = parse_print(_sample("print_running.txt").replace(
        "\tproperties =", "\tendpoints = {\n\t\t\"x\" = {\n\t\t\tstate = active\n\t\t\tpid = 1\n\t\t}\n\t}\n\tproperties ="))
    assert job.state == "running" and job.pid == 4711


def test_clean_exit_is_loaded_but_not_running_with_exit_code_0():
    job = parse_print(_sample("print_exited_clean.txt"))
    assert not job.running and job.pid is None and job.state == "not running"
    assert job.last_exit_code == 0 and job.runs == 2


def test_signal_death_reports_the_signal_and_no_exit_code():
    job = parse_print(_sample("print_crashed_signal.txt"))
    assert not job.running and job.state == "spawn scheduled"
    assert job.last_signal == "Segmentation fault: 11" and job.last_signal_number == 11
    assert job.last_exit is None and job.last_exit_code is None


def test_ex_config_exit_keeps_number_and_name():
    job = parse_print(_sample("print_ex_config.txt"))
    assert job.last_exit == "78: EX_CONFIG" and job.last_exit_code == 78


def test_garbage_gives_empty_fields_not_errors():
    job = parse_print("nothing useful\n\tpid = not-a-number\n")
    assert job.pid is None and not job.running


def test_print_disabled_both_dialects():
    assert parse_disabled(_sample("print_disabled_sonoma.txt")) == {
        "com.apple.ftpd": True, "com.mtplx.mtplxd": True, "com.openssh.sshd": False}
    legacy = parse_disabled(_sample("print_disabled_legacy.txt"))
    assert legacy["com.mtplx.mtplxd"] is False and legacy["org.cups.cupsd"] is True
