"""The OpenAI protocol at the HTTP edge: request models (pydantic, validated field by
field), the conversion to the engine's ``SamplingParams``, and ``PreparedRequest``, what
``OpenAIServing`` makes of a request once it passed every check.

Only what we serve is modelled; an unknown field is a 400 naming it, as OpenAI's own
API answers (``deploy/openai/request_fields.py``: ``null`` as the default, the short list of
fields accepted with no effect, structured outputs, vLLM's logits fields). Range checks
live here so a bad field is a 400 naming the field, never a 500.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, AsyncIterator, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from kvroute.deploy.openai.reasoning import ReasoningFields
from kvroute.deploy.openai.request_fields import LogitsFields, NoEffectFields, NullableModel, StructuredFields, Text, VLLMFields
from kvroute.deploy.openai.tools.calls import ToolChatMessage, ToolFields
from kvroute.replica.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from kvroute.deploy.openai.reasoning import ReasoningPlan
    from kvroute.deploy.openai.tools.serving import ToolPlan

MAX_STOP_SEQUENCES = 16
MAX_COMPLETION_LOGPROBS = MAX_LOGPROBS  # vLLM's cap (OpenAI's legacy API stops at 5)
MAX_TOP_LOGPROBS = MAX_LOGPROBS

TokenIds = list[StrictInt]


class StreamOptions(NullableModel):
    """``include_usage`` defaults to true once ``stream_options`` is given (vLLM's
    default); ``continuous_usage_stats``: every chunk carries the usage so far."""

    include_usage: StrictBool = True
    continuous_usage_stats: StrictBool = False


class _SamplingFields(NullableModel, NoEffectFields, StructuredFields, LogitsFields, VLLMFields):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: Optional[Text] = None
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt = Field(default=-1, ge=-1)  # 0 or -1: off (vLLM)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    n: StrictInt = Field(default=1, ge=1)
    stop: Optional[Union[Text, list[Text]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    seed: Optional[StrictInt] = Field(default=None, ge=-(2**63), lt=2**64)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0, allow_inf_nan=False)
    ignore_eos: StrictBool = False
    min_tokens: StrictInt = Field(default=0, ge=0)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    cache_salt: Optional[Text] = Field(default=None, min_length=1, max_length=256)
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    best_of: Optional[StrictInt] = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: Union[str, list[str], None]) -> Union[str, list[str], None]:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences are allowed, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty strings")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v: Optional[list[int]]) -> Optional[list[int]]:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("stop_token_ids must be >= 0")
        return v

    @model_validator(mode="after")
    def _stream_fields(self) -> "_SamplingFields":
        """vLLM's rules: stream_options only with stream; prompt_logprobs not streamed."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream=true")
        if self.prompt_logprobs and self.stream:
            raise ValueError("prompt_logprobs: not available with stream=true")
        return self

    def sampling_params(self, max_tokens: int, logprobs: Optional[int], seed_offset: int = 0, **extra: Any) -> SamplingParams:
        """The engine's parameters for one choice (``n`` is fanned out above the engine:
        choice *i* samples with ``seed + i`` so the choices differ but stay reproducible).
        ``extra``: the ``SamplingParams`` fields the caller resolved (structured output,
        prompt logprobs, special tokens)."""
        if self.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({max_tokens})")
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        fields = dict(
            n=1,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=self.top_k,
            min_p=float(self.min_p),
            seed=None if self.seed is None else (self.seed + seed_offset) % 2**64,
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
            stop=stops,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            **self.logits_params(),
        )
        return SamplingParams(**(fields | extra))

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM sends usage in every chunk only when usage is included at all."""
        return self.include_usage and self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    prompt: Union[Text, list[Text], TokenIds, list[TokenIds]]
    max_tokens: Optional[StrictInt] = Field(default=None, ge=0)  # 0: only with echo (the prompt, scored)
    logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: StrictBool = False
    suffix: Optional[Text] = None
    add_special_tokens: StrictBool = True

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and (not v or any(isinstance(x, list) and not x for x in v)):
            raise ValueError("prompt must not be empty")
        return v

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v: Optional[str]) -> Optional[str]:
        if v:
            raise ValueError("suffix is not supported")
        return v

    @model_validator(mode="after")
    def _max_tokens_zero(self) -> "CompletionRequest":
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: must be >= 1 (0 only with echo=true: the prompt alone, e.g. to score it)")
        return self

    @property
    def echo_only(self) -> bool:
        """Echo with ``max_tokens`` 0: the engine runs one token, the answer drops it."""
        return self.echo and self.max_tokens == 0

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt as a list of single prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


def _chat_echo(v: bool) -> bool:
    if v:
        raise ValueError("only false is supported (vLLM's chat echo repeats the last message's text; kvroute does not)")
    return v


class ChatCompletionRequest(ReasoningFields, ToolFields, _SamplingFields):
    """Chat with tools (``ToolFields``: tools, tool_choice, parallel_tool_calls), the
    conversation's tool calls and results (``ToolChatMessage``), and reasoning
    (``ReasoningFields``, whose switches replace the no-effect fields of the same names)."""

    model_config = ConfigDict(extra="forbid")

    messages: list[ToolChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    add_special_tokens: StrictBool = False  # the template adds them (vLLM's default)
    chat_template_kwargs: Optional[dict[str, Any]] = None
    # vLLM's RAG documents: a template variable, for templates that render them
    documents: Optional[list[dict[Text, Text]]] = None
    echo: Annotated[StrictBool, AfterValidator(_chat_echo)] = False

    def num_logprobs(self) -> Optional[int]:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(NullableModel):
    model: Optional[Text] = None
    prompt: Optional[Text] = None
    messages: Optional[list[ToolChatMessage]] = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(NullableModel):
    model: Optional[Text] = None
    tokens: list[StrictInt]


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's shape)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: Text = Field(min_length=1)
    lora_path: Text = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's shape; ``lora_int_id`` is ignored)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: Text = Field(min_length=1)
    lora_int_id: Optional[StrictInt] = None


# What a backend answers a request with: a JSON body, or the bytes of an SSE stream.
Answer = Union[dict[str, Any], AsyncIterator[bytes]]


@dataclass(frozen=True)
class PreparedRequest:
    """A completions or chat request that passed every check of ``OpenAIServing``,
    tokenized once: what a backend gets. Choice ``p * n + i`` runs prompt ``p`` with
    ``params[i]`` (``n = len(params)``). ``body`` is the JSON body as received, for a
    backend that forwards the request whole (unknown fields included)."""

    chat: bool  # /v1/chat/completions (else /v1/completions)
    request_id: str  # the answer's id: cmpl-... or chatcmpl-...
    model: str  # the name the answer carries: the adapter's, else the served model's
    prompts: list[list[int]]  # each prompt's token ids (chat: the templated messages)
    params: list[SamplingParams]  # one per choice of a prompt
    lora_name: Optional[str]
    cache_salt: Optional[str]
    stream: bool
    include_usage: bool
    logprobs: Optional[int]  # top logprobs per output token (None: no logprobs)
    echo: list[str]  # per prompt, the text returned in front of its choices (completions' echo)
    body: bytes
    # Tool calling (chat): how each choice's text reads back as content and tool_calls;
    # None when the request needs no tool handling (no tools, or tool_choice none).
    tools: Optional["ToolPlan"] = None
    # Reasoning (chat, a server with --reasoning-parser): how each choice's text splits
    # into reasoning and content; None: no reasoning parser runs.
    reasoning: Optional["ReasoningPlan"] = None
    # vLLM's prompt_logprobs: each choice of the answer carries a prompt_logprobs list
    # (None: not asked for). The engine's params carry the same number.
    prompt_logprobs: Optional[int] = None
    # Completions echo with logprobs: the answer's logprobs start with the prompt's
    # tokens (the first one's logprob null), then the generated ones.
    echo_logprobs: bool = False
    # Echo with max_tokens 0: the engine ran one token, which the answer drops (text,
    # logprobs); usage's completion_tokens is 0.
    echo_only: bool = False
    # stream_options.continuous_usage_stats: every streamed chunk carries usage.
    continuous_usage: bool = False
    # vLLM's return_token_ids: the prompt's and each choice's token ids in the answer
    return_token_ids: bool = False
    # vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"
    tokens_as_ids: bool = False

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * len(self.params)
