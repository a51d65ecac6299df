"""The HTTP application (quart-trio), served by hypercorn from the daemon's nursery.

Routes are thin: parse the body, hand it to the dialect module, render. Cross-cutting
concerns live in before/after hooks (CORS, auth, request metrics) and one set of error
handlers (every error in the calling dialect's JSON shape; never an HTML page).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Awaitable, Callable

from quart import Response, g, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from mtplxd import blas
from mtplxd.api import anthropic, openai, responses, retrieval, webui
from mtplxd.api.address import is_loopback
from mtplxd.api.auth import is_authorized, load_key
from mtplxd.api.cors import browser_origin, cors_headers, origin_allowed
from mtplxd.api.errors import APIError, dialect_for_path, from_http_status, render_error
from mtplxd.api.flight import FlightBoard
from mtplxd.api.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from mtplxd.api.metrics import Metrics
from mtplxd.api.schemas import require_json_object
from mtplxd.api.receipts import Client, Receipts, request_line
from mtplxd.api.service import Generations, LoopGuard, served_window, session_id_from_headers
from mtplxd.config import Config
from mtplxd.flight import FlightRecorder
from mtplxd.paths import Paths
from mtplxd.runtime import Runtime

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024  # Codex with many tools sends ~1 MB; long chats a few MB
KEEPALIVE_SECONDS = 5.0
# Answered without a key: liveness probes, and the chat page's files (they ask for the key).
OPEN_PATHS = {"/health"} | webui.PUBLIC_PATHS


def create_app(runtime: Runtime, config: Config, *, keepalive_seconds: float = KEEPALIVE_SECONDS,
               recorder: FlightRecorder | None = None) -> QuartTrio:
    """Build the app over the daemon's runtime (the model owner) and its settings; each
    request's line goes to the log and its record to `recorder` (when given)."""
    app = QuartTrio("mtplxd")
    app.config["MAX_CONTENT_LENGTH"] = MAX_BODY_BYTES
    app.config["RESPONSE_TIMEOUT"] = None  # generations stream for as long as they need
    # The whole body must arrive within this, however slowly it trickles (hypercorn already
    # closes a connection whose headers stall).
    app.config["BODY_TIMEOUT"] = config.body_timeout_seconds
    app.json.sort_keys = False  # type: ignore[attr-defined]
    app.json.ensure_ascii = False  # type: ignore[attr-defined]

    key_required = not is_loopback(config.host)
    stored = load_key(Paths.from_env()) if key_required else None
    api_key = stored.key if stored else None
    allowed_origins = list(config.cors_origins)
    metrics = Metrics(runtime, recorder)
    flights = FlightBoard()
    receipts = Receipts(recorder, log_prompts=config.log_prompts)
    gen = Generations(runtime, metrics, flights, lambda: app.nursery, keepalive_seconds, receipts,
                      LoopGuard.from_config(config))

    @app.before_request
    async def guard() -> Any:
        g.mtplx_client = Client(method=request.method, path=request.path,
                                user_agent=(request.headers.get("User-Agent") or "")[:256] or None,
                                session_id=session_id_from_headers(),
                                started=time.perf_counter(), wall=time.time())
        origin = browser_origin(request.headers)
        if origin is not None and not origin_allowed(origin, request.headers.get("Host"), allowed_origins):
            raise APIError(403, f"browser requests from {origin} are not allowed; add the origin "
                                "with `mtplxctl config set cors_origins ORIGIN`", code="cors_forbidden")
        if request.method == "OPTIONS" and origin is not None:
            return Response("", status=204, headers=cors_headers(
                origin, request.headers.get("Access-Control-Request-Headers")))
        if key_required and request.path not in OPEN_PATHS:
            if api_key is None or not is_authorized(request.headers, api_key):
                raise APIError(401, "missing or invalid API key: send `Authorization: Bearer KEY` or "
                                    "`x-api-key: KEY` (`mtplxctl key show` prints it)",
                               code="invalid_api_key")
        return None

    @app.after_request
    async def finish(response: Response) -> Response:
        origin = browser_origin(request.headers)
        # A refused origin's 403 gets no CORS headers: its page must not read the answer.
        if origin is not None and origin_allowed(origin, request.headers.get("Host"), allowed_origins):
            for name, value in cors_headers(origin).items():
                response.headers.setdefault(name, value)
        if request.url_rule is not None:
            metrics.observe_request(request.url_rule.rule, response.status_code)
        if response.status_code < 400 and g.get("mtplx_plan") is None and g.get("mtplx_client"):
            # A generation's line comes when it ends (Generations); this is everything else.
            # Probes and reads poll: their lines show at log_level = debug only.
            client = g.mtplx_client
            level = logging.INFO if request.method == "POST" else logging.DEBUG
            logging.getLogger("mtplxd.requests").log(level, "%s", request_line(
                {"method": client.method, "path": client.path, "status": response.status_code,
                 "outcome": "completed",
                 "duration_s": time.perf_counter() - client.started}))
        return response

    def _refused(error: APIError) -> None:
        # A refused request is otherwise invisible in `mtplxctl logs`: say what and why, so a
        # field an agent sends that we refuse shows up without capturing its traffic.
        client = g.get("mtplx_client") or Client(method=request.method, path=request.path,
                                                  started=time.perf_counter(), wall=time.time())
        receipts.refused(client, error.status, error.code, error.message, error.param,
                         plan=g.get("mtplx_plan"))

    @app.errorhandler(APIError)
    async def api_error(error: APIError) -> Response:
        _refused(error)
        await _drain_body()
        return _error_response(error)

    @app.errorhandler(HTTPException)
    async def http_error(error: HTTPException) -> Response:
        if error.code not in (408, 413):  # a body too slow or too large is not read on
            await _drain_body()
        answer = from_http_status(error.code or 500, error.description or error.name)
        allow = dict(error.get_headers()).get("Allow")
        if allow:  # a 405 names the methods the route takes (RFC 9110)
            answer.headers["Allow"] = allow
        _refused(answer)
        return _error_response(answer)

    async def _drain_body() -> None:
        # Answering before the request's body is read leaves its bytes on a keep-alive
        # connection, and hypercorn then stalls the client's next request on it: read what is
        # left (bounded by MAX_CONTENT_LENGTH and BODY_TIMEOUT) before any error answer.
        try:
            await request.get_data(cache=False)
        except HTTPException:
            pass

    @app.errorhandler(Exception)
    async def unexpected(error: Exception) -> Response:
        log.exception("unexpected error on %s %s", request.method, request.path)
        await _drain_body()
        internal = APIError(500, f"internal error: {type(error).__name__}: {error}",
                            code="internal_error")
        _refused(internal)
        return _error_response(internal)

    def _error_response(error: APIError) -> Response:
        body, status, headers = render_error(error, dialect_for_path(request.path))
        response = Response(body, status=status, headers=headers)
        if request.url_rule is None:
            metrics.observe_request("unmatched", status)
        return response

    def generation_route(path: str, handler: Callable[[Generations, dict[str, Any]], Awaitable[Any]]) -> None:
        async def route() -> Any:
            data = require_json_object(await request.get_data(cache=False))
            return await handler(gen, data)

        route.__name__ = "route_" + path.strip("/").replace("/", "_")
        app.add_url_rule(path, view_func=route, methods=["POST"])

    generation_route("/v1/chat/completions", openai.chat_completions)
    generation_route("/v1/completions", openai.completions)
    generation_route("/v1/responses", responses.responses)
    generation_route("/v1/messages", anthropic.messages)
    generation_route("/v1/messages/count_tokens", anthropic.count_tokens)

    webui.register(app)

    def retrieval_route(path: str, handler: Callable[..., Awaitable[Any]]) -> None:
        async def route() -> Any:
            data = require_json_object(await request.get_data(cache=False))
            return await handler(runtime, metrics, data)

        route.__name__ = "route_" + path.strip("/").replace("/", "_")
        app.add_url_rule(path, view_func=route, methods=["POST"])

    retrieval_route("/v1/embeddings", retrieval.embeddings)
    retrieval_route("/v1/rerank", retrieval.rerank)

    @app.get("/health")
    async def health() -> tuple[dict[str, Any], int]:
        info = runtime.info()
        degradations = []
        if info and info.get("mode") == "ar":
            degradations.append({"what": "mtp", "why": info.get("ar_reason") or "no MTP head"})
        elif info and info.get("depth_reason"):  # MTP loaded, off by default on this backend
            degradations.append({"what": "mtp_depth", "why": info["depth_reason"]})
        chosen = blas.status()
        if chosen is not None and chosen.degraded:
            degradations.append({"what": "blas", "why": chosen.degraded})
        if info and info.get("vision_reason"):
            degradations.append({"what": "vision", "why": info["vision_reason"]})
        bank_note = runtime.session_bank_note()
        if bank_note:
            degradations.append({"what": "session_bank", "why": bank_note})
        group = runtime.group_status()
        if group is not None and group.get("lost"):
            degradations.append({"what": "distributed_group", "why": group["lost"]})
        body = {
            "status": ("group_lost" if group is not None and group.get("lost") else
                       "ok" if runtime.state == "loaded" else "no_model"),
            "state": runtime.state,
            "model": info["id"] if info else None,
            "mode": info["mode"] if info else None,
            "ar_reason": info.get("ar_reason") if info else None,
            "depth": info["depth"] if info else None,
            "depth_reason": info.get("depth_reason") if info else None,
            # The server's window (memory-capped) beside the model's own.
            **(served_window(runtime).to_dict() if info else
               {"context_length": None, "model_context_length": None, "context_limited_by": None}),
            "degradations": degradations,
            # Which implementation each fast path runs here (custom kernel or MLX's own ops).
            "kernels": info.get("kernels") if info else None,
            "error": runtime.error,
            "active_requests": runtime.active_requests,
            "api_key_required": key_required,
            # The folder path stays off this unauthenticated page (`mtplxctl status` shows it).
            "model_info": {k: v for k, v in info.items() if k != "path"} if info else None,
            "memory": runtime.guard.status() if runtime.guard is not None else None,
            "group": public_group(group),
        }
        return body, 200

    @app.get("/v1/models")
    async def list_models() -> tuple[dict[str, Any], int]:
        # Chat models only, as agents expect; embedding and reranker models on request.
        capability = request.args.get("capability", "chat")
        if capability not in retrieval.CAPABILITIES:
            raise APIError(400, f"`capability` must be one of {', '.join(retrieval.CAPABILITIES)}",
                           code="invalid_request", param="capability")
        if capability != "chat":
            return {"object": "list", "data": retrieval.retrieval_cards(runtime, capability)}, 200
        info = runtime.info()
        return {"object": "list", "data": [_model_card(info, runtime)] if info else []}, 200

    @app.get("/v1/models/<path:model_id>")
    async def get_model(model_id: str) -> tuple[dict[str, Any], int]:
        info = runtime.info()
        if not info or info["id"] != model_id:
            raise APIError(404, f"the model {model_id!r} does not exist (see GET /v1/models)",
                           code="model_not_found", param="model")
        return _model_card(info, runtime), 200

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), status=200, content_type=METRICS_CONTENT_TYPE)

    @app.get("/v1/mtplx/flight")
    async def flight() -> tuple[dict[str, Any], int]:
        return flights.snapshot(runtime.scheduler_status()), 200

    return app


def public_group(group: dict[str, Any] | None) -> dict[str, Any] | None:
    """The distributed group as /health shows it: ranks, split, link, what was lost (no log
    paths or pids: the page needs no key)."""
    if group is None:
        return None
    ranks = [{k: v for k, v in rank.items() if k not in ("log", "pid")} for rank in group.get("ranks", [])]
    return {"size": group["size"], "lost": group["lost"], "ranks": ranks,
            "split": group.get("split"), "link": group.get("link")}


def _model_card(info: dict[str, Any], runtime: Runtime) -> dict[str, Any]:
    """An OpenAI model object, with the context window the agents probe for (the server's:
    memory may cap it below the model's, which `mtplx.model_context_length` keeps)."""
    window = served_window(runtime)
    return {
        "id": info["id"],
        "object": "model",
        "created": int(runtime.loaded_at or time.time()),
        "owned_by": "mtplx",
        "context_length": window.served,
        "max_model_len": window.served,
        # What the prompt may carry (agents such as Pi read this to offer image input).
        "modalities": {"input": ["text", "image"] if info.get("vision") else ["text"]},
        "supports_vision": bool(info.get("vision")),
        "mtplx": {"mode": info["mode"], "depth": info["depth"], "family": info["family"],
                  "quantization": info["quantization"], "ar_reason": info["ar_reason"],
                  "model_context_length": window.model,
                  "context_limited_by": window.limited_by},
    }
