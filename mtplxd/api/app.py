"""The HTTP application (quart-trio), served by hypercorn from the daemon's nursery."""

from __future__ import annotations

from typing import Any

from quart_trio import QuartTrio

from mtplxd.config import Config
from mtplxd.runtime import Runtime


def create_app(runtime: Runtime, config: Config) -> QuartTrio:
    """Build the app over the daemon's runtime (the model owner) and its settings."""
    app = QuartTrio("mtplxd")

    @app.get("/health")
    async def health() -> tuple[dict[str, Any], int]:
        info = runtime.info()
        body = {
            "status": "ok" if runtime.state == "loaded" else "no_model",
            "state": runtime.state,
            "model": info,
            "error": runtime.error,
        }
        return body, 200

    return app
