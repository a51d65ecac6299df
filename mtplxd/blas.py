"""Which BLAS MLX's CPU backend calls, chosen before MLX is imported.

MLX's Linux CPU wheel links the netlib reference BLAS it bundles: every float32 matmul runs
at a few GFLOP/s, ~30x below an optimized BLAS on the same cores. libmlx resolves
`cblas_sgemm` (and the LAPACK routines it uses) through the dynamic linker, and for a library
that Python loads with dlopen the linker searches the process's global scope before the
library's own dependencies. So loading the distribution's OpenBLAS with RTLD_GLOBAL before
`import mlx.core` makes libmlx bind to it: an in-process preload with the effect of
LD_PRELOAD, that needs no wrapper around whoever spawns the daemon (`mtplxctl start`, the
systemd unit, a shell, the tests) and no re-exec.

A library that loads but crashes or computes wrong on this CPU (old OpenBLAS builds do on new
processors) must never reach the daemon: a child process loads it first and checks a few
matmuls against exact integer references computed by numpy (`self_check`). Only when the
child answers "right" does this process load it; otherwise MLX keeps its bundled BLAS and
`activate` says so in one line, with the fix. macOS keeps Accelerate: there is nothing to load.

`MTPLX_BLAS` overrides the choice: "bundled" keeps MLX's own BLAS (for before/after
measurements), a path loads that CBLAS library instead of the distribution's OpenBLAS.
This module imports neither MLX nor trio at import time.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import platform as platform_module
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Mapping

ENV = "MTPLX_BLAS"
ACCELERATE, OPENBLAS, BUNDLED = "accelerate", "openblas", "bundled"
# Debian/Ubuntu: libopenblas0-pthread ships the library under openblas-pthread/ and points
# the libopenblas.so.0 alternative at it; Fedora/RHEL name theirs libopenblasp.so.0.
APT_PACKAGE = "libopenblas0-pthread"
APT_FIX = f"sudo apt-get install {APT_PACKAGE}"
FIX = (f"run `mtplxctl blas --install` ({APT_FIX} on Debian/Ubuntu; dnf install "
       f"openblas-threads on Fedora) or set {ENV} to a CBLAS library, then restart the daemon")
PROBE_TIMEOUT_S = 60.0
# Shapes of the self-check: a decode row against transposed weights, odd sizes, a block.
CHECK_SHAPES = ((1, 96, 160), (7, 300, 129), (64, 256, 64))
SPEED_SHAPE = (512, 512, 512)


@dataclass(frozen=True)
class Plan:
    """What to try: `kind` is accelerate | openblas | bundled; `library` the file to load."""

    kind: str
    library: str | None = None
    reason: str | None = None  # why the bundled BLAS, when it is planned


@dataclass
class BlasStatus:
    """The BLAS this process's MLX calls, as `daemon.status`, `/health` and doctor show it."""

    kind: str
    library: str | None
    gflops: float | None
    degraded: str | None = None  # one line with the fix when MLX runs on the reference BLAS

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy."""
        return asdict(self)

    def summary(self) -> str:
        """One line: what runs and how fast, or the degradation."""
        speed = f", {self.gflops:.0f} GFLOP/s float32" if self.gflops else ""
        if self.degraded:
            return f"{self.kind}{speed}: {self.degraded}"
        where = f" ({self.library})" if self.library else ""
        return f"{self.kind}{where}{speed}"


def candidates(machine: str, find: Callable[[str], str | None] = ctypes.util.find_library
               ) -> list[str]:
    """Where the distribution's multithreaded OpenBLAS lives, most specific first; last, what
    the linker's cache knows as libopenblas (`find`)."""
    multiarch = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu",
                 "arm64": "aarch64-linux-gnu"}.get(machine, f"{machine}-linux-gnu")
    paths = [f"/usr/lib/{multiarch}/openblas-pthread/libopenblas.so.0",
             f"/usr/lib/{multiarch}/libopenblas.so.0",
             "/usr/lib64/libopenblasp.so.0", "/usr/lib64/libopenblas.so.0"]
    found = find("openblas")
    if found and found not in paths:
        paths.append(found)
    return paths


def plan(system: str, machine: str, env: Mapping[str, str],
         exists: Callable[[str], bool] = os.path.exists,
         find: Callable[[str], str | None] = ctypes.util.find_library) -> Plan:
    """Decide which BLAS to try on `system` ("darwin", "linux", ...) without touching it.
    `exists` and `find` are the filesystem and the linker's cache (fakes in tests)."""
    if system == "darwin":
        return Plan(ACCELERATE, reason="macOS: MLX uses Accelerate")
    wanted = env.get(ENV, "").strip()
    if wanted == BUNDLED:
        return Plan(BUNDLED, reason=f"{ENV}=bundled")
    if system != "linux":
        return Plan(BUNDLED, reason=f"no optimized BLAS is chosen on {system}")
    if wanted and wanted != "auto":
        if exists(wanted):
            return Plan(OPENBLAS, wanted)
        return Plan(BUNDLED, reason=f"{ENV}={wanted} does not exist")
    for path in candidates(machine, find):
        if path.startswith("/") and not exists(path):
            continue
        return Plan(OPENBLAS, path)
    return Plan(BUNDLED, reason="OpenBLAS is not installed")


# --- the self-check ----------------------------------------------------------------------


def self_check() -> dict[str, Any]:
    """Run in the process whose MLX is checked: exact matmuls and float32 GFLOP/s of the CPU,
    and whether MLX's default device is a GPU (CUDA: then the CPU BLAS barely matters).

    Integer-valued inputs keep every product and sum exact in float32, so the reference
    (numpy's int64 matmul, which no BLAS computes) must be matched bit for bit.
    """
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    worst = 0.0
    with mx.stream(mx.cpu):
        for m, k, n in CHECK_SHAPES:
            a = rng.integers(-3, 4, size=(m, k))
            w = rng.integers(-3, 4, size=(n, k))  # weights are (out, in): x @ w.T, as nn.Linear
            got = np.array(mx.array(a, dtype=mx.float32) @ mx.array(w, dtype=mx.float32).T)
            worst = max(worst, float(np.abs(got - (a @ w.T)).max()))
        gflops = _measure_gflops(mx)
    return {"exact": worst == 0.0, "max_error": worst, "gflops": round(gflops, 1),
            "provider": sgemm_provider(), "gpu": mx.default_device() != mx.cpu}


def _measure_gflops(mx: Any) -> float:
    m, k, n = SPEED_SHAPE
    a, b = mx.random.normal((m, k)), mx.random.normal((k, n))
    mx.eval(a @ b)
    runs, start = 0, time.perf_counter()
    while runs < 3 or time.perf_counter() - start < 0.05:
        mx.eval(a @ b)
        runs += 1
    return 2 * m * k * n * runs / (time.perf_counter() - start) / 1e9


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def sgemm_provider() -> str | None:
    """The file whose `cblas_sgemm` the process's global scope resolves (Linux), else None.

    That scope is searched before libmlx's own dependencies, so this is the file libmlx calls.
    """
    try:
        process = ctypes.CDLL(None)
        address = ctypes.cast(process.cblas_sgemm, ctypes.c_void_p)
        info = _DlInfo()
        if not process.dladdr(address, ctypes.byref(info)) or not info.dli_fname:
            return None
        return os.fsdecode(info.dli_fname)
    except (AttributeError, OSError):
        return None


def probe(library: str | None, timeout: float = PROBE_TIMEOUT_S) -> dict[str, Any]:
    """Load `library` (None: none) in a child process and run `self_check` there.

    Returns the check's answer, or {"exact": False, "error": ...} when the child crashed,
    hung or answered nonsense: a broken library can only take the child down.
    """
    command = [sys.executable, "-m", "mtplxd.blas", "--probe", library or ""]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"exact": False, "error": f"self-check did not finish: {exc}"}
    try:
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"exact": False, "error": f"self-check failed ({tail})"}
    return answer if isinstance(answer, dict) else {"exact": False, "error": "bad answer"}


def load_global(library: str) -> None:
    """dlopen `library` into the global symbol scope (before MLX is imported)."""
    ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)


# --- activation --------------------------------------------------------------------------

_active: BlasStatus | None = None


def activate() -> BlasStatus:
    """Choose, check and load the BLAS for this process; idempotent; never raises.

    Call it before anything imports MLX (mtplxd.engine's package init does).
    """
    global _active
    if _active is None:
        chosen = plan(sys.platform, platform_module.machine(), os.environ)
        _active = resolve(chosen, probe, load_global, lambda: "mlx.core" in sys.modules)
    return _active


def diagnose(env: Mapping[str, str] | None = None) -> BlasStatus:
    """What `activate` would choose in a new daemon, checked in a child; loads nothing here."""
    chosen = plan(sys.platform, platform_module.machine(), os.environ if env is None else env)
    return resolve(chosen, probe, load=lambda _library: None, mlx_imported=lambda: False)


def resolve(chosen: Plan, run_probe: Callable[[str | None], dict[str, Any]],
            load: Callable[[str], None], mlx_imported: Callable[[], bool]) -> BlasStatus:
    """Carry out `chosen`: check the library with `run_probe` (a child process), `load` it
    when it passed, else report the fallback. The callables are the OS boundary."""
    if chosen.kind == ACCELERATE:
        return BlasStatus(ACCELERATE, None, run_probe(None).get("gflops"))
    if chosen.kind == BUNDLED:
        if chosen.reason == f"{ENV}=bundled":
            return BlasStatus(BUNDLED, None, None)
        answer = run_probe(None)  # the bundled BLAS's speed, and whether a GPU does the matmuls
        if answer.get("gpu"):
            return BlasStatus(BUNDLED, None, answer.get("gflops"))
        return BlasStatus(BUNDLED, None, answer.get("gflops"),
                          _degraded(chosen.reason or "no optimized BLAS"))
    if mlx_imported():
        return BlasStatus(BUNDLED, None, None, _degraded("MLX was imported before the BLAS choice"))
    answer = run_probe(chosen.library)
    if not answer.get("exact"):
        why = answer.get("error") or f"wrong results (max error {answer.get('max_error')})"
        return BlasStatus(BUNDLED, None, None, _degraded(f"{chosen.library}: {why}"))
    if not _same_file(answer.get("provider"), chosen.library):
        why = f"loaded, but cblas_sgemm came from {answer.get('provider')}"
        return BlasStatus(BUNDLED, None, None, _degraded(f"{chosen.library}: {why}"))
    try:
        load(chosen.library or "")
    except OSError as exc:
        return BlasStatus(BUNDLED, None, None, _degraded(f"{chosen.library}: {exc}"))
    return BlasStatus(OPENBLAS, chosen.library, answer.get("gflops"))


def _same_file(a: str | None, b: str | None) -> bool:
    return bool(a and b) and os.path.realpath(a) == os.path.realpath(b)


def _degraded(why: str) -> str:
    return f"MLX runs on its bundled reference BLAS (~30x slower on CPU): {why}; fix: {FIX}"


# --- installing the distribution's OpenBLAS ----------------------------------------------


def install_commands(system: str, uid: int,
                     which: Callable[[str], str | None] = shutil.which) -> list[list[str]] | None:
    """The commands that install the distribution's OpenBLAS on this machine, in order (the
    second, an index refresh, runs only when the first fails), or None where this cannot
    (not an apt system, or neither root nor sudo)."""
    if system != "linux" or which("apt-get") is None:
        return None
    prefix = [] if uid == 0 else ["sudo"] if which("sudo") else None
    if prefix is None:
        return None
    install = [*prefix, "apt-get", "install", "-y", "-q", "--no-install-recommends", APT_PACKAGE]
    return [install, [*prefix, "apt-get", "update", "-q"], install]


def install(run: Callable[[list[str]], int] | None = None) -> tuple[bool, str]:
    """Install the distribution's OpenBLAS when none is found; (found afterwards, one line).

    Never raises: a machine where it cannot be installed keeps MLX's bundled BLAS.
    """
    def found() -> bool:
        return plan(sys.platform, platform_module.machine(), {}).kind != BUNDLED

    if sys.platform == "darwin":
        return True, "macOS: MLX uses Accelerate; nothing to install"
    if found():
        return True, f"OpenBLAS already installed: {plan(sys.platform, platform_module.machine(), {}).library}"
    commands = install_commands(sys.platform, os.getuid())
    if commands is None:
        return False, f"cannot install OpenBLAS here (no apt-get, or neither root nor sudo); {FIX}"
    run = run or _run_quietly
    first, refresh, again = commands
    if run(first) != 0 and not (run(refresh) == 0 and run(again) == 0):
        return False, f"`{' '.join(first)}` failed; {FIX}"
    return (True, f"installed {APT_PACKAGE}") if found() else (False, f"installed, not found; {FIX}")


def _run_quietly(command: list[str]) -> int:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        return subprocess.run(command, env=env, stdout=subprocess.DEVNULL, check=False).returncode
    except OSError:
        return 127


def status() -> BlasStatus | None:
    """What `activate` chose in this process (None before it ran)."""
    return _active


def snapshot() -> dict[str, Any] | None:
    """`status()` as JSON with its summary line (daemon.status, benchmarks); None before
    `activate` ran."""
    return {**_active.to_dict(), "summary": _active.summary()} if _active is not None else None


def _probe_main(library: str) -> int:
    if library:
        load_global(library)
    print(json.dumps(self_check()))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        sys.exit(_probe_main(sys.argv[2]))
    print(json.dumps(activate().to_dict()))
