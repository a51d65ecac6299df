"""Run a command as our child and record its pid and exit statuses (what launchd/systemd keep).

Usage: supervise.py PROC_DIR LOG_FILE -- ARGV...   (LOG_FILE may be empty: output discarded)
"""

import subprocess
import sys
from pathlib import Path


def main() -> int:
    proc_dir, log_file = Path(sys.argv[1]), sys.argv[2]
    argv = sys.argv[sys.argv.index("--") + 1:]
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=out)
    tmp = proc_dir / "main.pid.tmp"
    tmp.write_text(str(child.pid))
    tmp.replace(proc_dir / "main.pid")
    code = child.wait()
    with open(proc_dir / "exits", "a") as exits:
        exits.write(f"{code}\n")
    (proc_dir / "main.pid").unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
