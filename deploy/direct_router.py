"""The direct path's ingress request router: HAProxy asks it where each POST goes.

On the direct path (``deploy/direct_app.py``) the engine replicas serve the HTTP API
themselves and HAProxy forwards each request straight to one of them. Before it
forwards a POST, HAProxy's Lua action posts the request's body to this deployment's
``/internal/route`` and sends the request to the replica the answer names, with the
answer's ``request_headers`` added (Ray Serve's ingress request router contract).

Here a body becomes the tokens the replica will run: the chat template and tokenizer
of the replica's own serving code (chat, completions, Anthropic messages, and Responses
with the stored conversation a ``previous_response_id`` continues), hashed into the
prompt's full blocks under the cluster's ``HashSpec``. The engine deployment's kvroute
request router then ranks the replicas with them, in this process: the deployment
keeps a ``RouterFollower`` (``cluster/router_follow.py``) in step with the router
actors, one call every 50 ms whatever the request rate, and asks them per request only
while the follower is not ready. Serve names the first ranked replica that has room.
The decision goes to the replica in one header (``deploy/direct_route.py``).

No body is refused here: what cannot be read (truncated, not JSON, a field the API
refuses) is placed by load alone, and the replica answers it with the API's own error,
since HAProxy would turn any answer but 200 into a 503. Structured outputs are not
compiled here; only the prompt matters for routing.
"""


import asyncio
import json
import logging
import uuid
from typing import Any, Optional

from fastapi import FastAPI, Request
from pydantic import ValidationError
from ray import serve

from kvroute.cluster.config import ClusterConfig
from kvroute.cluster.messages import ROUTER_NAMESPACE, GenerateRequest, RouteSlot
from kvroute.cluster.router_follow import RouterFollower, follow_forever
from kvroute.cluster.response_store_actor import RemoteResponseStore, get_or_create_response_store
from kvroute.deploy.app_config import ingress_limits, parse_args
from kvroute.deploy.direct_route import ROUTE_HEADER, encode_route
from kvroute.deploy.openai.messages.api import chat_request
from kvroute.deploy.openai.messages.request import parse_request
from kvroute.deploy.openai.protocol import ChatCompletionRequest, CompletionRequest
from kvroute.deploy.openai.responses.request import ResponsesRequest, chat_body
from kvroute.deploy.openai.serving import OpenAIServing
from kvroute.deploy.openai.tools.calls import template_messages
from kvroute.deploy.openai.tools.serving import plan_tools
from kvroute.replica.block_hash import hash_blocks
from kvroute.replica.sampling_params import SamplingParams

log = logging.getLogger(__name__)

HORIZON_CHARS = 48 * 1024  # how much of a prompt's text the router reads (about 12k tokens of English)
_THREAD_ABOVE_BYTES = 64 * 1024  # bodies this large are templated and tokenized off the event loop
_NO_PARAMS = SamplingParams(max_tokens=1)  # the ranked call is never run: routing reads only hashes and lengths

router_api = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)


class RoutePrompts:
    """The prompt tokens, adapter and salt a request body will run with, as the
    replica's ``OpenAIServing`` will compute them (None: not readable as a request).

    A prompt is read up to ``horizon_chars`` of its text: a longer one is tokenized that
    far, less its last two blocks (a token may straddle the cut), and placed on that
    prefix. Tokenizing costs about 1.7 us a token here, so a 100k-token prompt read
    whole would cost the router about 200 ms of CPU (the replica tokenizes it anyway);
    past the horizon, replicas rarely differ in what they cache."""

    def __init__(self, serving: OpenAIServing, store: Optional[RemoteResponseStore], block_size: int = 16,
                 horizon_chars: int = HORIZON_CHARS) -> None:  # fmt: skip
        self.serving = serving
        self.store = store
        self.names = set(serving.served.names)
        self.block_size = block_size
        self.horizon_chars = horizon_chars

    async def of(self, raw: bytes) -> Optional[tuple[list[int], Optional[str], Optional[str]]]:
        try:
            data = json.loads(raw)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        try:
            return await self._of(raw, data)
        except (ValueError, TypeError, KeyError, ValidationError):
            return None
        except Exception as exc:  # noqa: BLE001 - the API's own errors (APIError): the replica answers them
            log.debug("route: body not routable by prefix (%r)", exc)
            return None

    async def _of(self, raw: bytes, data: dict[str, Any]) -> Optional[tuple[list[int], Optional[str], Optional[str]]]:
        if "prompt" in data:
            req = CompletionRequest.model_validate(data)
            ids = await self._run(raw, self._completion_tokens, req)
            return ids, self._lora(req.model), req.cache_salt
        if "input" in data:
            req = ChatCompletionRequest.model_validate(await self._responses_chat(data))
        elif "messages" in data:
            try:
                req = ChatCompletionRequest.model_validate(data)
            except ValidationError:  # Anthropic's shape: the chat request it translates to
                req = ChatCompletionRequest.model_validate(chat_request(parse_request(raw)))
        else:
            return None
        plan = plan_tools(self.serving.tool_config, req)
        req = self.serving.reasoning.with_effort(req)
        ids = await self._run(raw, self._chat_tokens, req, plan.tools)
        return ids, self._lora(req.model), req.cache_salt

    def _chat_tokens(self, req: ChatCompletionRequest, tools: Optional[list[dict[str, Any]]]) -> list[int]:
        text = self.serving.renderer.render(template_messages(req.messages or []), tools, req.add_generation_prompt,
                                            req.continue_final_message, getattr(req, "chat_template_kwargs", None),
                                            tokenize=False, documents=getattr(req, "documents", None))  # fmt: skip
        if len(text) <= self.horizon_chars:
            return self.serving._chat_ids(req, tools)  # exactly the replica's
        return self._head(text, req.add_special_tokens, getattr(req, "truncate_prompt_tokens", None))

    def _completion_tokens(self, req: CompletionRequest) -> list[int]:
        prompt = req.prompts()[0]
        if isinstance(prompt, str) and len(prompt) > self.horizon_chars:
            return self._head(prompt, req.add_special_tokens, req.truncate_prompt_tokens)
        ids, _ = self.serving._prompt_ids([prompt], req)
        return ids[0]

    def _head(self, text: str, special_tokens: bool, truncate: Optional[int]) -> list[int]:
        """The tokens of ``text`` up to the horizon (none where the request keeps only its
        prompt's last tokens: its head is not the replica's)."""
        if truncate is not None:
            return []
        ids = self.serving.tokenizer.encode(text[: self.horizon_chars], add_special_tokens=special_tokens)
        return ids[: max(0, len(ids) - 2 * self.block_size)]

    async def _responses_chat(self, data: dict[str, Any]) -> dict[str, Any]:
        req = ResponsesRequest.model_validate(data)
        previous: list[dict[str, Any]] = []
        if req.previous_response_id is not None and self.store is not None:
            raw = await self.store.get(req.previous_response_id)
            if raw is not None:  # (a missing one is the replica's 400 to give)
                previous = json.loads(raw)["conversation"]
        return chat_body(req, previous, req.conversation_items())

    def _lora(self, model: Optional[str]) -> Optional[str]:
        """The adapter ``model`` names as ``ServedModels.resolve`` reads it (whether it
        exists is the replica's to say)."""
        if model is None or model in self.names:
            return None
        base, colon, adapter = model.partition(":")
        return adapter if colon and adapter and base in self.names else model

    @staticmethod
    async def _run(raw: bytes, fn: Any, *args: Any) -> Any:
        if len(raw) > _THREAD_ABOVE_BYTES:
            return await asyncio.to_thread(fn, *args)
        return fn(*args)


@serve.ingress(router_api)
class IngressRouter:
    """``POST /internal/route`` for HAProxy; ``GET /health`` for operators."""

    async def __init__(self, args: dict[str, Any], config: ClusterConfig, server: Any) -> None:
        from kvroute.deploy.ingress_model import load_model_info

        parsed = parse_args(args)
        tokenizer, max_model_len, vocab_size, defaults = await load_model_info(config)
        limits = ingress_limits(parsed)
        name = parsed.llm_configs[0].model_loading_config.model_id
        aliases = () if config.engine.model == name else (config.engine.model,)
        serving = OpenAIServing(name, tokenizer, max_model_len, vocab_size, None, limits, aliases,
                                tool_config=parsed.ingress.tool_config(), generation_defaults=defaults)  # fmt: skip
        store = RemoteResponseStore(get_or_create_response_store(config.app_name, limits.response_store_bounds()))
        self.prompts = RoutePrompts(serving, store, config.hash_spec.block_size)
        self.hash_spec = config.hash_spec
        self.handle = server
        self.counts = {"routed": 0, "by_load": 0, "decided": 0}
        self.follower = RouterFollower()
        self._following = asyncio.get_running_loop().create_task(
            follow_forever(self.follower, config.router_actor_names, ROUTER_NAMESPACE)
        )

    @router_api.post("/internal/route")
    async def route(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        key = None if "x-body-truncated" in request.headers else await self.prompts.of(raw)
        ids, lora, salt = key if key is not None else ([], None, None)
        self.counts["routed"] += 1
        self.counts["by_load"] += key is None
        call = GenerateRequest(request_id=uuid.uuid4().hex, token_ids=ids, params=_NO_PARAMS,
                               block_hashes=hash_blocks(self.hash_spec, ids, salt, lora_name=lora), cache_salt=salt,
                               lora_name=lora)  # fmt: skip
        slot = RouteSlot(self.follower)
        async with self.handle.choose_replica(call, slot, _reserve=False) as selection:
            replica_id = selection._replica.replica_id.to_full_id_str()
        answer: dict[str, Any] = {"replica_id": replica_id}
        self.counts["decided"] += slot.decision is not None
        if slot.decision is not None:
            answer["request_headers"] = {ROUTE_HEADER: encode_route(slot.decision)}
        return answer

    @router_api.get("/health")
    async def health(self) -> dict[str, Any]:
        return {"status": "ok", **self.counts, "follower": {"ready": self.follower.ready(), **self.follower.stats}}
