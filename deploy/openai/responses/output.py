"""The Responses API's answer, shaped from the chat path's: the response object, its
output items, usage and status (pure shaping; ``responses/stream`` builds the streamed
events from the same pieces).

A chat message becomes output items in OpenAI's order: a ``reasoning`` item where a
reasoning parser split reasoning out (its text as one ``reasoning_text`` part), a ``message`` item with one
``output_text`` part for its content (left out when the model only called functions),
then one ``function_call`` item per tool call (``call_id`` the call's id, ``arguments``
its JSON text). A choice cut off by ``max_output_tokens`` makes the response
``incomplete`` (``incomplete_details.reason``), as OpenAI reports it; its items too.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional

from kvroute.deploy.openai.responses.request import ResponsesRequest


def new_id(prefix: str) -> str:
    """``resp_...``, ``msg_...``, ``fc_...``: OpenAI's id prefixes."""
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(
    req: ResponsesRequest, rid: str, model: str, created_at: int, *, status: str, output: list[dict[str, Any]],
    usage: Optional[dict[str, Any]] = None, error: Optional[dict[str, Any]] = None,
    incomplete_details: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:  # fmt: skip
    """The response object, with the request's settings echoed as OpenAI echoes them
    (their defaults where the request left them out)."""
    return {
        "id": rid,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": incomplete_details,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": dict(req.metadata or {}),
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": req.reasoning.effort if req.reasoning else None, "summary": None},
        "store": req.store,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "text": {"format": req.text_format()},
        "tool_choice": _tool_choice(req),
        "tools": [_tool(t.model_dump(exclude_none=True)) for t in req.tools or ()],
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "truncation": req.truncation,
        "usage": usage,
        "user": req.user,
    }


def _tool_choice(req: ResponsesRequest) -> Any:
    if req.tool_choice is None:
        return "auto"
    return req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump()


def _tool(tool: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function", "name": tool["name"], "description": tool.get("description"),
            "parameters": tool.get("parameters"), "strict": tool.get("strict", True)}  # fmt: skip


def created_at() -> int:
    return int(time.time())


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [text_part(text)] if status != "in_progress" else []}  # fmt: skip


def reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    """The reasoning a reasoning parser split out, as its text (no summary, nothing encrypted)."""
    return {"id": item_id, "type": "reasoning", "status": status, "summary": [], "encrypted_content": None,
            "content": [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []}  # fmt: skip


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}  # fmt: skip


def output_items(message: dict[str, Any], status: str) -> list[dict[str, Any]]:
    """A whole chat message's output items."""
    calls = message.get("tool_calls") or []
    content = message.get("content")
    items = [reasoning_item(new_id("rs"), message["reasoning"], status)] if message.get("reasoning") else []
    if content or not calls:
        items.append(message_item(new_id("msg"), content or "", status))
    for call in calls:
        fn = call["function"]
        items.append(function_call_item(new_id("fc"), call["id"], fn["name"], fn.get("arguments") or "{}", status))
    return items


def outcome(finish_reason: Optional[str]) -> tuple[str, Optional[dict[str, Any]]]:
    """The response's status and ``incomplete_details`` for the choice's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def usage(chat_usage: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """The chat path's usage under the Responses API's names."""
    if not chat_usage:
        return None
    details = chat_usage.get("prompt_tokens_details") or {}
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": details.get("cached_tokens") or 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def conversation_of(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Output items in the conversation's normal form (``responses/request``), as a
    continuation replays them."""
    out = []
    for item in output:
        if item["type"] == "message":
            out.append({"type": "message", "role": "assistant", "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            out.append({"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                        "arguments": item["arguments"]})  # fmt: skip
        elif item["type"] == "reasoning":
            out.append({"type": "reasoning", "text": "".join(p["text"] for p in item["content"])})
    return out


_ITEM_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_item(item: dict[str, Any], response_id: str, index: int) -> dict[str, Any]:
    """One item of a stored conversation (normal form) as ``GET
    /v1/responses/{id}/input_items`` lists it, in OpenAI's item shape. The normal form
    keeps no item ids, so the id is made from the response's id and the item's place in
    the conversation: the same on every call, which is what ``after`` pages by."""
    kind = item["type"]
    item_id = f"{_ITEM_PREFIXES[kind]}_{response_id.removeprefix('resp_')}_{index}"
    if kind == "message" and item["role"] == "assistant":
        return message_item(item_id, item["content"], "completed")
    if kind == "message":
        return {"id": item_id, "type": "message", "status": "completed", "role": item["role"],
                "content": [{"type": "input_text", "text": item["content"]}]}  # fmt: skip
    if kind == "function_call":
        return function_call_item(item_id, item["call_id"], item["name"], item["arguments"], "completed")
    if kind == "function_call_output":
        return {"id": item_id, "type": "function_call_output", "status": "completed", "call_id": item["call_id"],
                "output": item["output"]}  # fmt: skip
    return reasoning_item(item_id, item["text"], "completed")


def from_chat(req: ResponsesRequest, rid: str, model: str, created: int, chat: dict[str, Any]) -> dict[str, Any]:
    """The response object for a finished chat completion (one choice)."""
    choice = chat["choices"][0]
    status, incomplete = outcome(choice.get("finish_reason"))
    return response_object(req, rid, model, created, status=status, output=output_items(choice["message"], status),
                           usage=usage(chat.get("usage")), incomplete_details=incomplete)  # fmt: skip
