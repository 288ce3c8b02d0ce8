"""The OpenAI API over any ``Backend``: every request is validated and tokenized here,
once, whatever answers it.

``OpenAIServing`` is plain Python (no FastAPI, no Ray) and reads top-down per route:
check the request against the model's limits (model name, resolved by
``deploy/openai/served_models.py``, which also answers the model list and the LoRA routes;
prompt count, ``n``, context
length, ``best_of``, ``continue_final_message``, ``min_tokens``, token ids in the
vocabulary), plan its tools (``deploy/openai/tools/serving.py``), compile its structured output
(``deploy/openai/grammar_check.py``), render and tokenize it once (off the event loop;
truncated as ``truncate_prompt_tokens`` asks), and hand the ``PreparedRequest`` to the
backend, which
answers it: the Serve application's replicas and the single-engine server stream its
choices (``deploy/backends/choices.py``), the external workers' backend forwards it whole
(``deploy/backends/workers.py``).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any, Optional, Protocol, Sequence, Union

from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict, Field

from kvroute import __version__
from kvroute.deploy.openai.chat_template import ChatRenderer
from kvroute.deploy.openai.errors import bad_request
from kvroute.deploy.openai.generation_defaults import GenerationDefaults
from kvroute.deploy.openai.grammar_check import StructuredOutputCheck
from kvroute.deploy.openai.protocol import (
    Answer,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    PreparedRequest,
    TokenizeRequest,
    UnloadLoRAAdapterRequest,
)
from kvroute.deploy.openai.reasoning import ReasoningServing
from kvroute.deploy.openai.request_fields import field_of
from kvroute.deploy.openai.responses.store import StoreBounds
from kvroute.deploy.openai.served_models import AdapterHost, ServedModels
from kvroute.deploy.openai.tools.calls import template_messages
from kvroute.deploy.openai.tools.serving import ToolServingConfig, plan_tools
from kvroute.replica.sampling_params import SamplingParams
from kvroute.replica.structured_output import COMPILE_TIMEOUT_S, StructuredOutput

__all__ = ["AdapterHost", "Backend", "OpenAIServing", "ServerLimits"]

log = logging.getLogger(__name__)


class Backend(Protocol):
    """What answers the requests ``OpenAIServing`` prepared: the one contract of every
    backend in ``deploy/backends/`` (the engine replicas, one in-process engine, external
    workers), each given one frozen ``PreparedRequest``."""

    async def answer(self, request: PreparedRequest) -> Answer:
        """The JSON body or the SSE stream of ``request``. Raises ``APIError`` (a 4xx
        or 5xx) or ValueError (400) for a request it cannot serve."""

    async def health(self) -> dict[str, Any]:
        """``/health``'s body: ``ready`` (True while at least one engine can take
        requests) and what else an operator should see."""


class ServerLimits(BaseModel):
    """What one request may ask for; a request past these gets 400/413/408. A bad limit
    is a ValueError (pydantic's ValidationError) naming it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(default=4 * 2**20, ge=1024)
    max_prompts: int = Field(default=64, ge=1, description="prompts in one /v1/completions list")
    max_n: int = Field(default=16, ge=1)
    request_timeout_s: Optional[float] = Field(default=600.0, gt=0)
    api_key: Optional[str] = Field(default=None, min_length=1)
    structured_output_timeout_s: float = Field(default=COMPILE_TIMEOUT_S, gt=0,
                                               description="a grammar that compiles slower is refused (400)")
    # what /v1/responses keeps for GET and previous_response_id (least recently used evicted first)
    response_store_max_entries: int = Field(default=StoreBounds.max_entries, ge=1, description="stored responses")
    response_store_max_mib: float = Field(default=StoreBounds.max_bytes / 2**20, gt=0, allow_inf_nan=False,
                                          description="stored responses' JSON, in MiB")  # fmt: skip
    response_store_ttl_s: float = Field(default=StoreBounds.ttl_s, gt=0, allow_inf_nan=False,
                                        description="how long a stored response is kept")  # fmt: skip

    def response_store_bounds(self) -> StoreBounds:
        """The response store's bounds these limits give."""
        return StoreBounds(self.response_store_max_entries, max(1, int(self.response_store_max_mib * 2**20)),
                           self.response_store_ttl_s)  # fmt: skip


class OpenAIServing:
    """``adapters``: the LoRA adapters' host; ``model`` may then name an adapter, and
    /v1/models lists them (``parent``: the base model; ``ServedModels``)."""

    def __init__(
        self,
        model_name: str,
        tokenizer: Any,
        max_model_len: int,
        vocab_size: int,
        backend: Backend,
        limits: ServerLimits = ServerLimits(),
        served_model_aliases: Sequence[str] = (),
        adapters: Optional[AdapterHost] = None,
        tool_config: ToolServingConfig = ToolServingConfig(),
        generation_defaults: GenerationDefaults = GenerationDefaults(),
    ) -> None:
        self.generation_defaults = generation_defaults  # the model's sampling defaults (generation_config.json)
        self.served = ServedModels(model_name, max_model_len, served_model_aliases, adapters)
        self.adapters = adapters
        self.tool_config = tool_config
        self.renderer = ChatRenderer(tokenizer, tool_config.chat_template)
        self.reasoning = ReasoningServing(tool_config.reasoning_parser, tokenizer, self.renderer.template)
        self.check_structured = StructuredOutputCheck(tokenizer, vocab_size, limits.structured_output_timeout_s)
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.backend = backend
        self.limits = limits

    # ------------------------------------------------------------------ models and adapters (deploy/openai/served_models.py)
    async def models(self) -> dict[str, Any]:
        return await self.served.models()

    async def model_card(self, model_id: str) -> dict[str, Any]:
        return await self.served.model_card(model_id)

    async def check_model(self, model: Optional[str]) -> Optional[str]:
        """The LoRA adapter ``model`` names (None: the base model); 404/400 otherwise."""
        return await self.served.resolve(model)

    async def load_lora_adapter(self, req: LoadLoRAAdapterRequest) -> str:
        return await self.served.load_lora_adapter(req)

    async def unload_lora_adapter(self, req: UnloadLoRAAdapterRequest) -> str:
        return await self.served.unload_lora_adapter(req)

    @staticmethod
    def version() -> dict[str, str]:
        return {"version": __version__}

    # ------------------------------------------------------------------ tokenizer routes
    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        await self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            ids = await asyncio.to_thread(self._chat_ids, req, None)
        else:
            ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt, add_special_tokens=req.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        await self.check_model(req.model)
        self._check_ids(req.tokens, "tokens")
        return {"prompt": await asyncio.to_thread(self.tokenizer.decode, req.tokens)}

    # ------------------------------------------------------------------ completions and chat
    async def completions(self, req: CompletionRequest, body: bytes) -> Answer:
        """``body``: the request's JSON as received (``PreparedRequest.body``)."""
        return await self.backend.answer(await self.prepare_completion(req, body))

    async def chat(self, req: ChatCompletionRequest, body: bytes) -> Answer:
        return await self.backend.answer(await self.prepare_chat(req, body))

    async def prepare_completion(self, req: CompletionRequest, body: bytes) -> PreparedRequest:
        """Echo with logprobs asks the engine for the prompt's logprobs (vLLM: the
        ``logprobs`` count, or ``prompt_logprobs`` when larger); echo with ``max_tokens``
        0 runs one token, which the answer drops (``echo_only``)."""
        lora = await self.check_model(req.model)
        self._check_vllm_fields(req)
        prompts = req.prompts()
        if len(prompts) > self.limits.max_prompts:
            raise bad_request(
                f"prompt holds {len(prompts)} prompts; at most {self.limits.max_prompts} are allowed", param="prompt"
            )
        # Tokenizing a prompt near the body limit takes seconds: off the event loop.
        token_lists, echo = await asyncio.to_thread(self._prompt_ids, prompts, req)
        structured = await self._structured_output(req)
        room = max(1, self.max_model_len - max(map(len, token_lists)))  # (the model's max_new_tokens, at most this)
        max_tokens = 1 if req.echo_only else req.max_tokens if req.max_tokens is not None else self.generation_defaults.max_tokens(
            room, 16)  # fmt: skip
        echo_logprobs = req.echo and req.logprobs is not None
        prompt_logprobs = max(req.prompt_logprobs or 0, req.logprobs or 0) if echo_logprobs else req.prompt_logprobs
        params = self._params_per_choice(req, token_lists, max_tokens, req.logprobs, structured_output=structured,
                                         prompt_logprobs=prompt_logprobs)  # fmt: skip
        return PreparedRequest(chat=False, request_id=f"cmpl-{req.request_id or uuid.uuid4().hex}", model=lora or self.model_name,
                               prompts=token_lists, params=params, lora_name=lora, cache_salt=req.cache_salt,
                               stream=req.stream, include_usage=req.include_usage, logprobs=req.logprobs, echo=echo,
                               body=body, prompt_logprobs=req.prompt_logprobs, echo_logprobs=echo_logprobs,
                               echo_only=req.echo_only, continuous_usage=req.continuous_usage,
                               return_token_ids=req.return_token_ids, tokens_as_ids=req.return_tokens_as_token_ids)  # fmt: skip

    def _prompt_ids(self, prompts: list[Union[str, list[int]]], req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        """Token ids of each prompt (text or ids, checked by pydantic; truncated as
        ``truncate_prompt_tokens`` asks), and the text echo returns in front of each choice."""
        token_lists: list[list[int]] = []
        for i, p in enumerate(prompts):
            ids = self.tokenizer.encode(p, add_special_tokens=req.add_special_tokens) if isinstance(p, str) else list(p)
            ids = self._truncate(ids, req.truncate_prompt_tokens)
            self._check_ids(ids, "prompt" if len(prompts) == 1 else f"prompt[{i}]")
            token_lists.append(ids)
        return token_lists, [self.tokenizer.decode(ids) if req.echo else "" for ids in token_lists]

    async def prepare_chat(self, req: ChatCompletionRequest, body: bytes) -> PreparedRequest:
        """Tools: ``plan_tools`` decides what the template shows and, for ``required`` or
        a named function, the structured output that forces the call (which excludes a
        ``response_format``); the plan goes to the backend, which reads the calls back."""
        lora = await self.check_model(req.model)
        self._check_vllm_fields(req)
        if req.continue_final_message and req.add_generation_prompt:
            raise bad_request("continue_final_message needs add_generation_prompt=false", param="continue_final_message")
        try:
            plan = plan_tools(self.tool_config, req)
        except ValueError as exc:
            raise bad_request(str(exc), param=field_of(str(exc), "tool_choice")) from None
        # A forced call makes this turn's output the call: a response_format (checked all the
        # same) governs the content answers of turns that do not force one, as OpenAI takes it.
        requested = await self._structured_output(req)
        structured = await self.check_structured(plan.structured_output()) if plan.forced else requested
        req = self.reasoning.with_effort(req)  # reasoning_effort: a template variable
        ids = await asyncio.to_thread(self._chat_ids, req, plan.tools)
        reasoning = self.reasoning.plan(req, ids, plan.forced)  # (deploy/openai/reasoning.py)
        limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = limit if limit is not None else self.generation_defaults.max_tokens(max(1, self.max_model_len - len(ids)))
        try:
            num_logprobs = req.num_logprobs()
        except ValueError as exc:
            raise bad_request(str(exc), param="top_logprobs") from None
        params = self._params_per_choice(req, [ids], max_tokens, num_logprobs, "max_completion_tokens",
                                         structured_output=structured, prompt_logprobs=req.prompt_logprobs,
                                         skip_special_tokens=req.skip_special_tokens and not plan.keep_special_tokens
                                         and not self.reasoning.keep_special_tokens,
                                         **self.reasoning.sampling(reasoning, structured))  # fmt: skip
        return PreparedRequest(chat=True, request_id=f"chatcmpl-{req.request_id or uuid.uuid4().hex}", model=lora or self.model_name,
                               prompts=[ids], params=params, lora_name=lora, cache_salt=req.cache_salt,
                               stream=req.stream, include_usage=req.include_usage, logprobs=num_logprobs, echo=[""],
                               body=body, tools=plan if plan.choice != "none" else None,
                               prompt_logprobs=req.prompt_logprobs, continuous_usage=req.continuous_usage,
                               return_token_ids=req.return_token_ids, tokens_as_ids=req.return_tokens_as_token_ids,
                               reasoning=reasoning)  # fmt: skip

    # ------------------------------------------------------------------ validation
    def _check_vllm_fields(self, req: Union[CompletionRequest, ChatCompletionRequest]) -> None:
        """``best_of`` equal to ``n`` at most; the fields only vLLM workers honour are a
        400 unless the backend forwards the body to them."""
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request("best_of is not supported (it must equal n when given)", param="best_of")
        refused = None if getattr(self.backend, "forwards_body", False) else req.engine_refusal()
        if refused is not None:
            raise bad_request(refused[1], param=refused[0])

    def _chat_ids(self, req: Union[ChatCompletionRequest, TokenizeRequest], tools: Optional[list[dict[str, Any]]]) -> list[int]:
        """The templated conversation's token ids (``chat_template_kwargs`` as template
        variables; ``add_special_tokens`` also adds the tokenizer's own, as vLLM does),
        truncated as ``truncate_prompt_tokens`` asks."""
        kwargs = getattr(req, "chat_template_kwargs", None)
        documents = getattr(req, "documents", None)
        if documents is not None and not self.renderer.uses("documents"):
            raise bad_request("documents: the chat template does not render documents", param="documents")
        try:
            messages = template_messages(req.messages or [])
            if req.add_special_tokens and isinstance(req, ChatCompletionRequest):
                text = self.renderer.render(messages, tools, req.add_generation_prompt, req.continue_final_message,
                                            kwargs, tokenize=False, documents=documents)  # fmt: skip
                ids = self.tokenizer.encode(text, add_special_tokens=True)
            else:
                ids = self.renderer.render(messages, tools, req.add_generation_prompt,
                                           getattr(req, "continue_final_message", False), kwargs, documents=documents)  # fmt: skip
        except ValueError as exc:
            raise bad_request(str(exc), param=field_of(str(exc), "messages")) from None
        except (TypeError, TemplateError) as exc:  # what the tokenizer could not take; say so, not its internals
            log.warning("chat template/tokenizer failed on the messages: %r", exc)
            raise bad_request("the messages could not be tokenized with the model's chat template", param="messages") from None
        ids = self._truncate(list(ids), getattr(req, "truncate_prompt_tokens", None))
        self._check_ids(ids, "messages")
        return ids

    def _truncate(self, ids: list[int], keep: Optional[int]) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: keep the prompt's last ``keep`` tokens (-1:
        the model's context length)."""
        if keep is None:
            return ids
        if keep == -1:
            keep = self.max_model_len
        if keep > self.max_model_len:
            raise bad_request(f"truncate_prompt_tokens={keep} exceeds the model's context length of "
                              f"{self.max_model_len} tokens", param="truncate_prompt_tokens")  # fmt: skip
        return ids[-keep:]

    async def _structured_output(self, req: Union[CompletionRequest, ChatCompletionRequest]) -> Optional[StructuredOutput]:
        """The request's structured output, parsed and compiled against this model's
        vocabulary within the time limit (400 naming the field otherwise)."""
        try:
            so = req.structured_output()
        except ValueError as exc:
            raise bad_request(str(exc), param=field_of(str(exc), "response_format")) from None
        return await self.check_structured(so)

    def _check_ids(self, ids: Sequence[int], param: str) -> None:
        if not ids:
            raise bad_request(f"{param} must not be empty", param=param)
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"{param} token ids must be in [0, {self.vocab_size}); got {bad[:5]}", param=param)

    def _params_per_choice(
        self,
        req: Union[CompletionRequest, ChatCompletionRequest],
        token_lists: list[list[int]],
        max_tokens: int,
        logprobs: Optional[int],
        max_tokens_param: str = "max_tokens",
        **extra: Any,
    ) -> list[SamplingParams]:
        if req.n > self.limits.max_n:
            raise bad_request(f"n={req.n} exceeds the server's limit of {self.limits.max_n}", param="n")
        for name, ids in req.token_ids_used().items():
            if any(t >= self.vocab_size for t in ids):
                raise bad_request(f"{name} token ids must be in [0, {self.vocab_size})", param=name)
        for i, ids in enumerate(token_lists):
            self._check_length(req, ids, i if len(token_lists) > 1 else None, max_tokens, max_tokens_param)
        try:
            defaults = self.generation_defaults.unset_fields(req)
            return [req.sampling_params(max_tokens, logprobs, seed_offset=i, **(defaults | extra)) for i in range(req.n)]
        except ValueError as exc:
            raise bad_request(str(exc), param="min_tokens" if "min_tokens" in str(exc) else field_of(str(exc))) from None

    def _check_length(self, req: Any, ids: list[int], index: Optional[int], max_tokens: int, max_tokens_param: str) -> None:
        if len(ids) >= self.max_model_len:
            raise bad_request(
                f"the prompt{'' if index is None else f' {index}'} has {len(ids)} tokens; the model's "
                f"context length is {self.max_model_len} tokens, and at least one output token must fit",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        if len(ids) + max_tokens > self.max_model_len:
            raise bad_request(
                f"{max_tokens_param}={max_tokens} plus the prompt's {len(ids)} tokens exceeds the model's "
                f"context length of {self.max_model_len} tokens; lower {max_tokens_param} to at most "
                f"{self.max_model_len - len(ids)}",
                param=max_tokens_param,
                code="context_length_exceeded",
            )
