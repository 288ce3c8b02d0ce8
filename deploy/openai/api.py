"""The FastAPI application every host serves (the Serve ingress, the single-engine
server): OpenAI routes and Anthropic's ``/v1/messages`` and ``/v1/messages/count_tokens``
(``deploy/openai/messages/api.py``) over an ``OpenAIServing``, the API key check, the body-size
cap, the error envelope, and client-disconnect aborts.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
from typing import Any, Awaitable, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvroute.deploy.openai.errors import APIError, error_body
from kvroute.deploy.openai.messages.api import count_tokens, create_message
from kvroute.deploy.openai.messages.answer import error_body as messages_error_body
from kvroute.deploy.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from kvroute.deploy.openai.request_fields import field_of
from kvroute.deploy.openai.responses.store import MemoryResponseStore, ResponseStore
from kvroute.deploy.openai.responses.api import add_responses_routes
from kvroute.deploy.openai.serving import OpenAIServing

log = logging.getLogger(__name__)

MetricsProvider = Callable[[], Awaitable[tuple[bytes, str]]]


def build_api(
    serving: OpenAIServing,
    metrics: MetricsProvider,
    extra_routes: Optional[Callable[[FastAPI], None]] = None,
    response_store: Optional[ResponseStore] = None,
) -> FastAPI:
    """The ASGI app. ``metrics()`` returns (body, content type) for ``GET /metrics``;
    ``extra_routes(app)`` adds host-specific routes; ``response_store`` keeps what
    ``/v1/responses`` stores (None: one in this process, within the limits' bounds)."""
    app = FastAPI(title="kvroute", version="0.1.0", docs_url=None, redoc_url=None)
    _error_handlers(app)
    _openai_routes(app, serving)
    store = response_store or MemoryResponseStore(serving.limits.response_store_bounds())
    add_responses_routes(app, serving, store, _respond)

    @app.get("/health")
    async def health() -> Response:
        state = {**await serving.backend.health(), "auth": "api_key" if serving.limits.api_key else "none"}
        if state["ready"]:
            return JSONResponse({"status": "ok", **state})
        if state.get("refused_replicas"):
            log.warning("/health: replicas refused by the routers: %s", state["refused_replicas"])
        return JSONResponse({**error_body(503, "no replica is ready"), **state}, status_code=503, headers={"Retry-After": "1"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        body, content_type = await metrics()
        return Response(body, media_type=content_type)

    if extra_routes is not None:
        extra_routes(app)
    app.add_middleware(_Guard, api_key=serving.limits.api_key, max_body_bytes=serving.limits.max_body_bytes)
    return app


def warn_if_open(api_key: Optional[str], host: Optional[str]) -> bool:
    """Log a WARNING when ``/v1`` is served without an API key on an address other
    machines may reach (anything but loopback; an unknown address counts as reachable);
    whether it warned. ``/health`` shows ``"auth": "none"`` then too."""
    if api_key:
        return False
    if host is not None:
        try:
            if host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback:
                return False
        except ValueError:
            pass  # a host name: it may resolve to any interface
    log.warning("serving /v1 WITHOUT an API key on %s: anyone who reaches it can use the model; set --api-key, "
                "KVROUTE_API_KEY or ingress.api_key", host or "an address this process cannot tell")
    return True


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers())

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(_validation_body(exc), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s %s failed", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}"), status_code=500)


def _openai_routes(app: FastAPI, serving: OpenAIServing) -> None:
    # The raw body (read already, to parse the model) goes along for a backend that forwards it.
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await _respond(request, serving.completions(body, await request.body()))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await _respond(request, serving.chat(body, await request.body()))

    # Anthropic's Messages API through the chat path. It reads its own body (Anthropic's
    # fields and error envelope), which FastAPI's generated OpenAPI would misdescribe as an
    # OpenAI route without a body: it stays out of /openapi.json.
    @app.post("/v1/messages", include_in_schema=False)
    async def messages(request: Request) -> Response:
        return await _respond(request, create_message(serving, await request.body()))

    @app.post("/v1/messages/count_tokens", include_in_schema=False)
    async def count_message_tokens(request: Request) -> Response:
        return await _respond(request, count_tokens(serving, await request.body()))

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return await serving.models()

    @app.get("/v1/models/{model_id:path}")
    async def model_card(model_id: str) -> dict[str, Any]:
        return await serving.model_card(model_id)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return serving.version()

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
        return PlainTextResponse(await serving.load_lora_adapter(body))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
        return PlainTextResponse(await serving.unload_lora_adapter(body))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await serving.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await serving.detokenize(body)


async def _respond(request: Request, work: Awaitable[Any]) -> Response:
    """Run ``work`` until it finishes or the client disconnects (then it is cancelled,
    which aborts every engine request it started)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return Response(status_code=499)  # nobody reads it: the client is gone
    result = task.result()
    if isinstance(result, dict):
        return JSONResponse(result)
    # StreamingResponse cancels the iterator when the client disconnects mid-stream.
    return StreamingResponse(result, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _validation_body(exc: RequestValidationError) -> dict[str, Any]:
    errors = exc.errors()
    if not errors:
        return error_body(400, "invalid request")
    if errors[0].get("type") == "json_invalid":
        first = errors[0]
        return error_body(400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}")
    # A field typed as a union (prompt: text, texts, ids or lists of ids) fails once per
    # member; the member that was meant is the one whose check ran past the type test.
    first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), errors[0])
    param = _param_of(first.get("loc", ()))
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if param is None:  # a check over several fields names the one it is about first
        param = field_of(msg)
    if first.get("type") == "missing":
        message = f"{param} is required" if param else "the request body is empty; send a JSON object"
    elif first.get("type") == "extra_forbidden":
        message = f"{param}: unknown field; kvroute does not implement it (docs/api.md lists the fields it takes)"
    elif param is None and first.get("type") == "model_attributes_type":
        message = "the request body must be a JSON object, sent as Content-Type: application/json"
    elif param and not msg.startswith(f"{param}:"):
        message = f"{param}: {msg}"
    else:
        message = msg
    others = sorted({_field_of(e) for e in errors} - {_field_of(first)})
    if others:
        message += f" (also invalid: {', '.join(others)})"
    return error_body(400, message, param=param)


def _param_of(loc: Any) -> Optional[str]:
    """``("body", "prompt", "list[function-after[...]]", 1)`` -> ``"prompt[1]"``: the
    field path, without the body root and pydantic's union-member tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part == "body" and not out:
            continue
        elif "[" in part or part in _TYPE_TAGS:
            continue
        else:
            out += f".{part}" if out else part
    return out or None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-wrap"}


def _field_of(error: dict[str, Any]) -> str:
    """The top-level field an error is about."""
    param = _param_of(error.get("loc", ())) or "body"
    return param.split("[")[0].split(".")[0]


class _Guard:
    """Pure ASGI middleware: the API key on /v1 and /admin routes (constant-time comparison) and
    the body-size cap (413 as soon as the declared or received size passes it; the rest
    of the body is never read)."""

    def __init__(self, app: Any, api_key: Optional[str], max_body_bytes: int) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):  # mounted under a prefix (Serve's route_prefix)
            path = path[len(root) :]
        if self.api_key is not None and path.startswith(("/v1", "/admin")):
            if not self._authorized(scope, path):
                message = "invalid or missing API key (send Authorization: Bearer <key>)"
                if path.startswith("/v1/messages"):
                    body = messages_error_body(401, message.replace("(send ", "(send x-api-key: <key> or "))
                else:
                    body = error_body(401, message, code="invalid_api_key")
                await _send_json(send, 401, body, {"WWW-Authenticate": "Bearer"})
                return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            declared = _header(scope, b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
                await _send_json(send, 413, self._too_large(path))
                return
            chunks, size = [], 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return
                body = message.get("body", b"")
                size += len(body)
                if size > self.max_body_bytes:
                    await _send_json(send, 413, self._too_large(path))
                    return
                chunks.append(body)
                if not message.get("more_body", False):
                    break
            receive = _replay(b"".join(chunks), receive)
        await self.app(scope, receive, send)

    def _authorized(self, scope: dict, path: str) -> bool:
        """A Bearer token, or on /v1/messages also ``x-api-key`` (how Anthropic's clients send it)."""
        value = _header(scope, b"authorization") or ""
        scheme, _, token = value.partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key):
            return True
        key = _header(scope, b"x-api-key") if path.startswith("/v1/messages") else None
        return key is not None and hmac.compare_digest(key.strip().encode(), self.api_key)

    def _too_large(self, path: str) -> dict[str, Any]:
        message = f"request body exceeds the server's limit of {self.max_body_bytes} bytes"
        if path.startswith("/v1/messages"):
            return messages_error_body(413, message)
        return error_body(413, message, code="request_too_large")


def _header(scope: dict, name: bytes) -> Optional[str]:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1")
    return None


def _replay(body: bytes, receive: Callable) -> Callable:
    sent = False

    async def replayed() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _send_json(send: Callable, status: int, body: dict[str, Any], headers: Optional[dict[str, str]] = None) -> None:
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
