"""Image parts of a chat message, in each dialect's spelling, read into bytes.

OpenAI chat `{"type": "image_url", "image_url": {"url": ...}}`, Responses
`{"type": "input_image", "image_url": ...}` and Anthropic
`{"type": "image", "source": {"type": "base64", "media_type": ..., "data": ...}}` all become
one internal part, `{"type": "image", "data": <bytes>}`, kept in the message's content list
in order. URLs are `data:` URLs or local `file://` paths only: the daemon never fetches from
the network, and a remote URL is a 400 that says so.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from mtplxd.api.errors import invalid

IMAGE_PART_TYPES = ("image_url", "input_image", "image")
# Bytes of one image part (the engine caps decoded pixels itself).
MAX_IMAGE_BYTES = 20 * 1024 * 1024


def image_part(kind: str, part: dict[str, Any], where: str) -> dict[str, Any]:
    """The internal image part for a dialect's image part (`kind` is its `type`)."""
    if kind == "image":
        return {"type": "image", "data": _anthropic_source(part.get("source"), f"{where}.source")}
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if kind == "input_image" and url is None and part.get("file_id"):
        raise invalid(f"`{where}.file_id`: uploaded files are not supported; send the image as a "
                      "data: URL", f"{where}.file_id", code="unsupported_image_url")
    if not isinstance(url, str) or not url:
        raise invalid(f"`{where}.image_url` must be a data: or file:// URL", f"{where}.image_url")
    return {"type": "image", "data": read_image_url(url, f"{where}.image_url")}


def read_image_url(url: str, where: str) -> bytes:
    """The bytes a data: or file:// URL holds; any other URL is a 400."""
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, where)
    if scheme == "file":
        return _file_url(url, where)
    if scheme in ("http", "https"):
        raise invalid(f"`{where}`: remote image URLs are not fetched (mtplx never reaches the "
                      "network); send the image inline as a data: URL (base64) or as a local "
                      "file:// URL", where, code="unsupported_image_url")
    raise invalid(f"`{where}` must be a data: URL or a file:// URL", where, code="unsupported_image_url")


def _data_url(url: str, where: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header.lower():
        raise invalid(f"`{where}`: a data: URL must be base64 (data:image/png;base64,...)", where,
                      code="invalid_image")
    return _base64(payload, where)


def _file_url(url: str, where: str) -> bytes:
    parsed = urlparse(url)
    if parsed.netloc not in ("", "localhost"):
        raise invalid(f"`{where}`: a file:// URL must name a local path", where,
                      code="unsupported_image_url")
    path = Path(unquote(parsed.path))
    try:
        size = path.stat().st_size
        if not path.is_file():
            raise OSError("not a regular file")
        if size > MAX_IMAGE_BYTES:
            raise invalid(f"`{where}`: {path} is {size} bytes; images of at most "
                          f"{MAX_IMAGE_BYTES} bytes are accepted", where, code="invalid_image")
        return path.read_bytes()
    except OSError as exc:
        raise invalid(f"`{where}`: cannot read {path}: {exc.strerror or exc}", where,
                      code="invalid_image") from None


def _anthropic_source(source: Any, where: str) -> bytes:
    if not isinstance(source, dict):
        raise invalid(f"`{where}` must be an object", where)
    kind = source.get("type")
    if kind == "base64":
        data = source.get("data")
        if not isinstance(data, str):
            raise invalid(f"`{where}.data` must be a base64 string", f"{where}.data")
        return _base64(data, f"{where}.data")
    if kind == "url":
        raise invalid(f"`{where}`: remote image URLs are not fetched (mtplx never reaches the "
                      "network); send the image as a base64 source", where,
                      code="unsupported_image_url")
    raise invalid(f"`{where}.type` must be \"base64\"", f"{where}.type")


def _base64(payload: str, where: str) -> bytes:
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise invalid(f"`{where}`: the image is larger than {MAX_IMAGE_BYTES} bytes", where,
                      code="invalid_image")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid(f"`{where}` is not valid base64", where, code="invalid_image") from None


def message_images(messages: list[dict[str, Any]]) -> list[bytes]:
    """Every image's bytes, in the order the template renders them."""
    return [part["data"] for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if part.get("type") == "image"]


def without_image_bytes(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as the chat template sees them: image parts with no payload."""
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            m = {**m, "content": [{"type": "image"} if p.get("type") == "image" else p for p in content]}
        out.append(m)
    return out
