"""Control methods `fans.status` and `fans.set`."""

from __future__ import annotations

from typing import Any

from mtplxd.control.protocol import app_error, invalid_params
from mtplxd.control.registry import MethodRegistry, Notify
from mtplxd.fans.base import FanError
from mtplxd.fans.controller import MODES, FanController


def register_fan_methods(registry: MethodRegistry, controller: FanController) -> None:
    """Add fans.status and fans.set to `registry`."""

    async def fans_status(params: dict[str, Any], notify: Notify) -> dict[str, Any]:
        """Fan mode, who holds control, speeds and temperatures (read now)."""
        await controller.refresh()
        return controller.snapshot()

    async def fans_set(params: dict[str, Any], notify: Notify) -> dict[str, Any]:
        """Switch the fan mode for this run: auto, max or smart (config key fan_mode persists it)."""
        mode = params.get("mode")
        if mode not in MODES:
            raise invalid_params(f"mode must be one of {', '.join(MODES)}")
        try:
            await controller.set_mode(mode)
        except FanError as exc:
            raise app_error("fan_control_failed", str(exc), fans=controller.snapshot()) from None
        return controller.snapshot()

    registry.add("fans.status", fans_status)
    registry.add("fans.set", fans_set)
