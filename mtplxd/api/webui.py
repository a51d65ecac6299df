"""The chat page at `GET /`: static files shipped in the package (mtplxd/api/static/), no CDN,
no build step.

The page and its scripts hold nothing secret, so they load without a key; everything they do
goes through the API under its own rules (keyless on loopback; with a key the page asks for
it and sends it as a bearer token). Its Content-Security-Policy keeps it to its own origin:
scripts, styles and requests from this server only, and it cannot be framed by another page.
"""

from __future__ import annotations

from pathlib import Path

from quart import Response
from quart_trio import QuartTrio

from mtplxd.api.errors import APIError

STATIC = Path(__file__).parent / "static"
ASSETS = {"chat.css": "text/css", "chat.js": "text/javascript", "markdown.js": "text/javascript"}
PUBLIC_PATHS = {"/"} | {f"/ui/{name}" for name in ASSETS}
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
       "img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")


def _serve(name: str, content_type: str) -> Response:
    response = Response((STATIC / name).read_bytes(), status=200, content_type=content_type)
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["Cache-Control"] = "no-cache"
    return response


def register(app: QuartTrio) -> None:
    """Add `GET /` and `GET /ui/<asset>` to `app`."""

    @app.get("/")
    async def chat_page() -> Response:
        return _serve("index.html", "text/html; charset=utf-8")

    @app.get("/ui/<name>")
    async def chat_asset(name: str) -> Response:
        if name not in ASSETS:
            raise APIError(404, f"there is no page asset {name}", code="not_found")
        return _serve(name, ASSETS[name] + "; charset=utf-8")
