"""The OpenAI Responses API (``POST /v1/responses``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``) as a translation onto
the chat path.

A request becomes a chat request (``responses_request.chat_body``) that
``OpenAIServing.prepare_chat`` checks, templates and tokenizes, and the serving's
``Backend`` answers like any chat request: tools, forced calls, structured outputs,
routing, overload and deadlines are the chat path's own. The chat answer is shaped back
into a response object (``responses/output``) or, streamed, into the Responses events
(``responses/stream``). A check the chat path fails names the Responses field
(``max_output_tokens``, ``text.format``, ``input``), not the chat one.

With ``store`` (the default, as OpenAI has it) the response and its conversation (the
previous response's, this input, this output) go to a ``ResponseStore``
(``deploy/openai/responses/store.py``), from which ``GET`` returns the response (and
``input_items`` the conversation up to its output) and
``previous_response_id`` continues the conversation: the stored items are rendered in
front of the new input, so the continuation's prompt starts with the previous prompt and
is routed to the replica holding its KV. A response the store no longer has (deleted,
evicted, expired) is a 404, and continuing it a 400.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Awaitable, Callable, Mapping, Optional

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import ValidationError

from kvroute.deploy.openai.errors import APIError, bad_request
from kvroute.deploy.openai.protocol import Answer, ChatCompletionRequest
from kvroute.deploy.openai.request_fields import field_of
from kvroute.deploy.openai.responses.store import ResponseStore
from kvroute.deploy.openai.responses.output import conversation_of, created_at, from_chat, input_item, new_id
from kvroute.deploy.openai.responses.request import ResponsesRequest, chat_body
from kvroute.deploy.openai.responses.stream import response_events
from kvroute.deploy.openai.serving import OpenAIServing

log = logging.getLogger(__name__)

# The chat path's field names, as a Responses request spells them (most specific first).
_RENAMES = (
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
    ("messages", "input"),
)


def _renamed(text: Optional[str]) -> Optional[str]:
    if text is None:
        return None
    for chat, responses in _RENAMES:
        text = text.replace(chat, responses)
    return text


def _responses_error(exc: APIError) -> APIError:
    """``exc`` from the chat path, naming the Responses fields."""
    renamed = APIError(exc.status, _renamed(exc.message) or "", param=_renamed(exc.param), code=exc.code,
                       retry_after_s=exc.retry_after_s)  # fmt: skip
    return renamed


class ResponsesAPI:
    """The routes' work over ``serving`` (its ``prepare_chat`` and backend) and
    ``store``."""

    def __init__(self, serving: OpenAIServing, store: ResponseStore) -> None:
        self.serving = serving
        self.store = store

    async def create(self, req: ResponsesRequest) -> Answer:
        """The response to ``req``: its object, or the SSE bytes of its events."""
        previous = await self._conversation(req.previous_response_id)
        items = req.conversation_items()
        try:
            chat = chat_body(req, previous, items)
        except ValueError as exc:
            raise bad_request(str(exc), param=field_of(str(exc), "input")) from None
        try:
            chat_req = ChatCompletionRequest.model_validate(chat)
        except ValidationError as exc:
            first = exc.errors()[0]
            message = str(first["msg"]).removeprefix("Value error, ")
            raise bad_request(_renamed(message) or message, param=_renamed(field_of(message))) from None
        rid, created = new_id("resp"), created_at()
        conversation = previous + items
        try:
            prepared = await self.serving.prepare_chat(chat_req, json.dumps(chat).encode())
            answer = await self.serving.backend.answer(prepared)
        except APIError as exc:
            raise _responses_error(exc) from None
        except ValueError as exc:  # what a backend could not serve (ARCHITECTURE.md §2)
            raise bad_request(_renamed(str(exc)) or "invalid request") from None
        # the response echoes what it was sampled with (the model's defaults where the request gave none)
        req = req.model_copy(update={"temperature": prepared.params[0].temperature, "top_p": prepared.params[0].top_p})
        if isinstance(answer, dict):
            response = from_chat(req, rid, prepared.model, created, answer)
            await self._save(req, response, conversation)
            return response

        async def finished(response: dict[str, Any]) -> None:
            await self._save(req, response, conversation)

        return response_events(req, rid, prepared.model, created, answer, finished)

    async def retrieve(self, response_id: str) -> dict[str, Any]:
        record = await self._record(response_id)
        if record is None:
            raise _not_found(response_id)
        return record["response"]

    async def delete(self, response_id: str) -> dict[str, Any]:
        try:
            deleted = await self.store.delete(response_id)
        except Exception as exc:
            raise _unavailable(exc) from None
        if not deleted:
            raise _not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    async def input_items(self, response_id: str, query: Mapping[str, list[str]]) -> dict[str, Any]:
        """``GET /v1/responses/{id}/input_items``: the items the response was generated
        from (the conversation it continued and its own input; not ``instructions``), a
        page of them as OpenAI's list object. ``query``: each query parameter's values;
        ``limit`` (1 to 100, default 20), ``order`` (``asc`` or ``desc``, the default:
        newest first), ``after`` (an item id of this list: the page starts behind it);
        anything else is a 400 naming it."""
        limit, order, after = _page_of(query)
        record = await self._record(response_id)
        if record is None:
            raise _not_found(response_id)
        conversation = record["conversation"]
        inputs = conversation[: len(conversation) - len(conversation_of(record["response"]["output"]))]
        items = [input_item(item, response_id, i) for i, item in enumerate(inputs)]
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise bad_request(f"after: {after!r} is not an input item of response {response_id!r}", param="after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}  # fmt: skip

    async def _conversation(self, previous_id: Optional[str]) -> list[dict[str, Any]]:
        """The stored conversation ``previous_response_id`` continues (empty without one)."""
        if previous_id is None:
            return []
        record = await self._record(previous_id)
        if record is None:
            raise bad_request(f"Previous response with id {previous_id!r} not found (never stored, deleted, or no "
                              "longer kept by the server's response store)", param="previous_response_id",
                              code="previous_response_not_found")  # fmt: skip
        return record["conversation"]

    async def _record(self, response_id: str) -> Optional[dict[str, Any]]:
        try:
            raw = await self.store.get(response_id)
        except Exception as exc:
            raise _unavailable(exc) from None
        return None if raw is None else json.loads(raw)

    async def _save(self, req: ResponsesRequest, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        """Store ``response`` with its conversation when the request asked for it. A
        store that fails or cannot keep it costs the caller the later lookup, not this
        answer (logged)."""
        if not req.store:
            return
        record = {"response": response, "conversation": conversation + conversation_of(response["output"])}
        try:
            kept = await self.store.put(response["id"], json.dumps(record, separators=(",", ":")))
        except Exception as exc:
            log.warning("response %s was not stored: the response store failed: %r", response["id"], exc)
            return
        if not kept:
            log.warning("response %s was not stored: its record exceeds the response store's byte bound", response["id"])


def _page_of(query: Mapping[str, list[str]]) -> tuple[int, str, Optional[str]]:
    """``limit``, ``order`` and ``after`` of an input item listing (see
    ``ResponsesAPI.input_items``); a 400 naming the parameter for a bad or repeated one."""
    unknown = sorted(set(query) - {"limit", "order", "after", "include"})
    if unknown:
        raise bad_request(f"{unknown[0]}: unknown query parameter; input_items takes limit, order and after",
                          param=unknown[0])  # fmt: skip
    if query.get("include"):
        raise bad_request("include: nothing more can be included; the items carry all kvroute keeps", param="include")
    for name, values in query.items():
        if len(values) > 1:
            raise bad_request(f"{name}: given {len(values)} times; give it once", param=name)
    limit_text = (query.get("limit") or ["20"])[0]
    limit = int(limit_text) if limit_text.strip().isdigit() else 0
    if not 1 <= limit <= 100:
        raise bad_request(f"limit: must be an integer from 1 to 100, got {limit_text!r}", param="limit")
    order = (query.get("order") or ["desc"])[0]
    if order not in ("asc", "desc"):
        raise bad_request(f"order: must be 'asc' or 'desc', got {order!r}", param="order")
    return limit, order, (query.get("after") or [None])[0]


def _not_found(response_id: str) -> APIError:
    return APIError(404, f"Response with id {response_id!r} not found.", param="response_id", code="not_found")


def _unavailable(exc: Exception) -> APIError:
    log.warning("the response store did not answer: %r", exc)
    return APIError(503, f"the response store is unavailable: {type(exc).__name__}", code="unavailable", retry_after_s=1.0)


Respond = Callable[[Request, Awaitable[Any]], Awaitable[Response]]


def add_responses_routes(app: FastAPI, serving: OpenAIServing, store: ResponseStore, respond: Respond) -> None:
    """Register the Responses routes on ``app``; ``respond`` runs a request's work as
    the other OpenAI routes do (cancelled when the client leaves; a dict is JSON, bytes
    an SSE stream)."""
    api = ResponsesAPI(serving, store)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request) -> Response:
        return await respond(request, api.create(body))

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str) -> dict[str, Any]:
        return await api.retrieve(response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(response_id: str, request: Request, limit: Optional[str] = None,
                               order: Optional[str] = None, after: Optional[str] = None) -> dict[str, Any]:  # fmt: skip
        """(``limit``, ``order`` and ``after`` are read and checked by ``input_items``;
        named here so the route's schema lists them.)"""
        query = {key: request.query_params.getlist(key) for key in request.query_params}
        return await api.input_items(response_id, query)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str) -> dict[str, Any]:
        return await api.delete(response_id)
