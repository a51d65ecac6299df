"""Auto-start at login: a LaunchAgent on macOS, a systemd user unit on Linux.

Imported as `mtplxctl.launchd`. `service_manager()` returns the manager for this platform (or
None), with `is_installed()`, `install()`, `uninstall()`, `start()`, `stop()` and `status()`.
See docs/service.md.
"""

from .base import ChangeReport, ServiceManager, ServiceStatus
from .manager import OVERRIDE_ENV, manager_name, service_manager
from .runner import ServiceError

__all__ = ["ChangeReport", "OVERRIDE_ENV", "ServiceError", "ServiceManager", "ServiceStatus",
           "manager_name", "service_manager"]
