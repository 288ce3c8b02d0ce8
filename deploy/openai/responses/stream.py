"""The Responses API's streamed events (``stream: true``), made from the chat path's
stream: the backend answers the translated chat request with SSE chunks
(``chat.completion.chunk``, content and ``tool_calls`` deltas as the request's tool plan
reads them, then a usage chunk), and ``response_events`` turns them into OpenAI's event
sequence, each event numbered by ``sequence_number``:

``response.created``, ``response.in_progress``; per output item
``response.output_item.added``, then for reasoning ``response.reasoning_text.delta``...,
``response.reasoning_text.done``, for a message ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``, or for a function call
``response.function_call_arguments.delta``..., ``response.function_call_arguments.done``;
then ``response.output_item.done``; last ``response.completed`` (or
``response.incomplete`` when ``max_output_tokens`` cut it off). An error chunk of the
chat stream (the request failed after it started) becomes an ``error`` event and
``response.failed``.

The chunks are read back from their SSE bytes, so this works over every backend,
including one that forwards the chat request to an external worker. Closing the events
(the client left) closes the chat stream, which aborts its engine requests.
"""

from __future__ import annotations

import json
import re
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from kvroute.deploy.openai.responses import output as out
from kvroute.deploy.openai.responses.request import ResponsesRequest

_EVENT_END = re.compile(rb"\r?\n\r?\n")


async def chat_chunks(sse: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an SSE byte stream, however its bytes are split, up to
    ``data: [DONE]``."""
    buf = b""
    async for data in sse:
        buf += data
        while (end := _EVENT_END.search(buf)) is not None:
            event, buf = buf[: end.start()], buf[end.end() :]
            lines = [line[5:].removeprefix(b" ") for line in event.splitlines() if line.startswith(b"data:")]
            if not lines:
                continue
            payload = b"\n".join(lines)
            if payload.strip() == b"[DONE]":
                return
            yield json.loads(payload)


class _Events:
    """The output items as they stream, and the numbered events that tell them."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.open: Optional[dict[str, Any]] = None  # the item still streaming (the last of ``output``)
        self.calls: dict[int, dict[str, Any]] = {}  # the chat stream's tool-call index -> its item

    def event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        self.output.append(item)
        self.open = item
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=item)]

    def text(self, delta: str) -> list[bytes]:
        events: list[bytes] = []
        if self.open is None or self.open["type"] != "message":
            events += self.close("completed")
            events += self._add(out.message_item(out.new_id("msg"), "", "in_progress"))
            self.open["text"] = ""
            events.append(self.event("response.content_part.added", item_id=self.open["id"], output_index=len(self.output) - 1,
                                     content_index=0, part=out.text_part("")))  # fmt: skip
        if not delta:
            return events
        self.open["text"] += delta
        events.append(self.event("response.output_text.delta", item_id=self.open["id"], output_index=len(self.output) - 1,
                                 content_index=0, delta=delta, logprobs=[]))  # fmt: skip
        return events

    def reasoning(self, delta: str) -> list[bytes]:
        """A piece of the reasoning: the reasoning item opens first (it comes before the
        message and the calls)."""
        events: list[bytes] = []
        if self.open is None or self.open["type"] != "reasoning":
            events += self.close("completed")
            events += self._add(out.reasoning_item(out.new_id("rs"), "", "in_progress"))
            self.open["text"] = ""
        self.open["text"] += delta
        events.append(self.event("response.reasoning_text.delta", item_id=self.open["id"], output_index=len(self.output) - 1,
                                 content_index=0, delta=delta))  # fmt: skip
        return events

    def call(self, delta: dict[str, Any]) -> list[bytes]:
        """One ``tool_calls`` entry of a chat delta: a new call (its id and name) and/or
        a fragment of its arguments."""
        events: list[bytes] = []
        item = self.calls.get(delta.get("index", 0))
        fn = delta.get("function") or {}
        if item is None:
            events += self.close("completed")
            item = out.function_call_item(out.new_id("fc"), delta.get("id") or out.new_id("call"), fn.get("name") or "", "",
                                          "in_progress")  # fmt: skip
            self.calls[delta.get("index", 0)] = item
            events += self._add(item)
        fragment = fn.get("arguments") or ""
        if fragment:
            item["arguments"] += fragment
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.output.index(item), delta=fragment))  # fmt: skip
        return events

    def close(self, status: str) -> list[bytes]:
        """Finish the item still streaming, if any, with ``status``."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = self.output.index(item)
        events = []
        if item["type"] == "message":
            text = item.pop("text")
            events.append(self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                                     text=text, logprobs=[]))  # fmt: skip
            events.append(self.event("response.content_part.done", item_id=item["id"], output_index=index,
                                     content_index=0, part=out.text_part(text)))  # fmt: skip
            item.update(out.message_item(item["id"], text, status))
        elif item["type"] == "reasoning":
            text = item.pop("text")
            events.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                     content_index=0, text=text))  # fmt: skip
            item.update(out.reasoning_item(item["id"], text, status))
        else:
            events.append(self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                     name=item["name"], arguments=item["arguments"]))  # fmt: skip
            item["status"] = status
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events


async def response_events(
    req: ResponsesRequest, rid: str, model: str, created: int, sse: AsyncIterator[bytes],
    finished: Callable[[dict[str, Any]], Awaitable[None]],
) -> AsyncIterator[bytes]:  # fmt: skip
    """The Responses events of the chat answer ``sse``; ``finished(response)`` runs
    with the whole response before the last event goes out (so a client that reads
    ``response.completed`` finds it stored)."""
    ev = _Events()

    def snapshot(status: str, **extra: Any) -> dict[str, Any]:
        return out.response_object(req, rid, model, created, status=status, output=ev.output, **extra)

    yield ev.event("response.created", response=snapshot("in_progress"))
    yield ev.event("response.in_progress", response=snapshot("in_progress"))
    finish: Optional[str] = None
    usage: Optional[dict[str, Any]] = None
    chunks = chat_chunks(sse)
    try:
        async for chunk in chunks:
            if "error" in chunk:
                error = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
                code = error.get("code") or error.get("type") or "server_error"
                for e in ev.close("incomplete"):
                    yield e
                yield ev.event("error", code=code, message=error.get("message", ""), param=error.get("param"))
                failed = snapshot("failed", error={"code": code, "message": error.get("message", "")})
                yield ev.event("response.failed", response=failed)
                return
            if chunk.get("usage") and not chunk.get("choices"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("reasoning"):
                    for e in ev.reasoning(delta["reasoning"]):
                        yield e
                if delta.get("content"):
                    for e in ev.text(delta["content"]):
                        yield e
                for call in delta.get("tool_calls") or ():
                    for e in ev.call(call):
                        yield e
                finish = choice.get("finish_reason") or finish
    finally:
        await chunks.aclose()
        aclose = getattr(sse, "aclose", None)
        if aclose is not None:
            await aclose()
    status, incomplete = out.outcome(finish)
    if all(item["type"] == "reasoning" for item in ev.output):  # no text, no call: one empty message, as whole
        for e in ev.text(""):
            yield e
    for e in ev.close(status):
        yield e
    final = snapshot(status, usage=out.usage(usage), incomplete_details=incomplete)
    await finished(final)
    yield ev.event("response.incomplete" if status == "incomplete" else "response.completed", response=final)
