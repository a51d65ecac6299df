"""Browser access: same-origin by default, plus the `cors_origins` allow-list.

Requests without an `Origin` header (agents, curl, SDKs) are not browser requests and pass.
A browser request from another origin is refused with 403 unless its origin is listed, so a
web page cannot drive the local model behind the user's back.
"""

from __future__ import annotations

from typing import Mapping
from urllib.parse import urlsplit

ALLOWED_HEADERS = ("Authorization, Content-Type, X-Api-Key, Anthropic-Version, Anthropic-Beta, "
                   "OpenAI-Organization, OpenAI-Project, X-Stainless-Lang, X-Stainless-Package-Version")
ALLOWED_METHODS = "GET, POST, OPTIONS"
EXPOSED_HEADERS = "X-MTPLX-Request-Id, X-MTPLX-Max-Tokens, X-MTPLX-Max-Tokens-Clamped-From, X-MTPLX-Ignored-Tools"


def origin_allowed(origin: str, host: str | None, allowed: list[str]) -> bool:
    """Whether a browser at `origin` may call this server (reached as `host`)."""
    if origin in allowed or "*" in allowed:
        return True
    netloc = urlsplit(origin).netloc
    return bool(host) and netloc.lower() == host.lower()


def cors_headers(origin: str, requested_headers: str | None = None) -> dict[str, str]:
    """Headers that let the browser at `origin` (an allowed one) read the answer. A preflight's
    `Access-Control-Request-Headers` are allowed as asked: the origin is trusted, and the SDKs
    send headers of their own (`x-stainless-*`, the session headers) that no fixed list keeps
    up with."""
    return {
        "Access-Control-Allow-Origin": origin,
        "Access-Control-Allow-Methods": ALLOWED_METHODS,
        "Access-Control-Allow-Headers": requested_headers or ALLOWED_HEADERS,
        "Access-Control-Expose-Headers": EXPOSED_HEADERS,
        "Access-Control-Max-Age": "600",
        "Vary": "Origin",
    }


def browser_origin(headers: Mapping[str, str]) -> str | None:
    """The request's Origin, or None for non-browser clients."""
    return headers.get("Origin") or None
