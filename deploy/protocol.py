"""The OpenAI protocol at the HTTP edge: request models (pydantic, validated field by
field), the conversion to the engine's ``SamplingParams``, and ``PreparedRequest``, what
``OpenAIServing`` makes of a request once it passed every check.

Only what we serve is modelled; unknown fields are ignored, as OpenAI's own server
does. Range checks live here so a bad field is a 400 naming the field, never a 500.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, AsyncIterator, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator

from kvroute.replica.sampling_params import MAX_LOGPROBS, SamplingParams

if TYPE_CHECKING:
    from kvroute.deploy.tool_serving import ToolPlan

MAX_STOP_SEQUENCES = 16
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's cap for the legacy completions API (vLLM allows 20)
MAX_TOP_LOGPROBS = MAX_LOGPROBS

TokenIds = list[StrictInt]


def _unicode(v: str) -> str:
    """JSON may spell an unpaired UTF-16 surrogate (``"\\ud800"``); Python keeps it in a
    str, but no tokenizer or UTF-8 encoder takes it."""
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"contains an unpaired UTF-16 surrogate (U+{ord(v[exc.start]):04X} at character {exc.start}); "
            "text must be valid Unicode"
        ) from None
    return v


# Every text field of a request: what reaches the tokenizer, the detokenizer's stop
# matching, the block hash (cache_salt) or a response.
Text = Annotated[str, AfterValidator(_unicode)]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[Text] = None
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: StrictInt = Field(default=-1, ge=-1)
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
    user: Optional[Text] = None
    cache_salt: Optional[Text] = Field(default=None, min_length=1, max_length=256)
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v

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

    def sampling_params(self, max_tokens: int, logprobs: Optional[int], seed_offset: int = 0) -> SamplingParams:
        """The engine's parameters for one choice (``n`` is fanned out above the engine:
        choice *i* samples with ``seed + i`` so the choices differ but stay reproducible)."""
        if self.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({max_tokens})")
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
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
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_SamplingFields):
    prompt: Union[Text, list[Text], TokenIds, list[TokenIds]]
    logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: StrictBool = False
    suffix: Optional[Text] = None
    best_of: Optional[StrictInt] = None

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

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt as a list of single prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[Text, list[ContentPart]]] = None
    name: Optional[Text] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False

    def num_logprobs(self) -> Optional[int]:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return (self.top_logprobs or 0) if self.logprobs else None


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (text content; ``developer`` is a system turn)."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[Text] = None
    prompt: Optional[Text] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

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

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.chat else "/v1/completions"

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * len(self.params)
