"""A stand-in for mtplxd in the command-sequence tests: cheap, and it behaves like the daemon
towards its service manager (READY=1 when NOTIFY_SOCKET is set, exit 0 on SIGTERM)."""

import signal
import sys
import time

from mtplxd.supervisor import sd_notify

signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
sd_notify("READY=1")
while True:
    time.sleep(1)
