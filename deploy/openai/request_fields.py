"""Request fields beyond the sampling basics, shared by /v1/completions and
/v1/chat/completions: how ``null`` and unknown fields are treated, the fields accepted
by design with no effect, structured outputs, and vLLM's logits and prompt fields.

Unknown fields are refused (a 400 naming the field), as OpenAI's own API does: a field
kvroute does not implement must not be silently dropped. ``null`` for an optional field
means its default, as vLLM takes it. The fields in ``NO_EFFECT_FIELDS`` are the only
ones accepted that change nothing, each for the reason given there.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, field_validator, model_validator

from kvroute.replica.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS

# Field -> (the values accepted, why it has no effect). ``None`` accepts any valid value.
NO_EFFECT_FIELDS: dict[str, tuple[Optional[tuple[Any, ...]], str]] = {
    "user": (None, "an end-user id for the provider's abuse monitoring; kvroute keeps no such record"),
    "metadata": (None, "tags for stored completions; kvroute stores none"),
    "store": ((False,), "kvroute stores no completions"),
    "service_tier": (("auto", "default"), "kvroute has one tier"),
    "use_beam_search": ((False,), "vLLM's beam search; kvroute samples only"),
    "length_penalty": ((1.0,), "vLLM's beam-search length penalty; kvroute samples only"),
    "spaces_between_special_tokens": ((True,), "vLLM's detokenizer default, which kvroute's detokenizer keeps"),
    "priority": ((0,), "vLLM's priority scheduling; kvroute schedules first come, first served"),
    # what SGLang's and vLLM's routers add to every body they forward, at these values
    "no_stop_trim": ((False,), "SGLang's switch to keep a matched stop string; kvroute trims it, as the default does"),
    "return_hidden_states": ((False,), "SGLang's hidden-state output; kvroute returns none"),
    "separate_reasoning": ((True,), "SGLang's reasoning split, which needs a reasoning parser kvroute does not run"),
    "stream_reasoning": ((True,), "SGLang's reasoning streaming, which needs a reasoning parser kvroute does not run"),
    "include_reasoning": ((True,), "vLLM's reasoning output, which needs a reasoning parser kvroute does not run"),
    "mm_processor_kwargs": (None, "a multimodal processor's arguments; kvroute serves text-only models"),
    "media_io_kwargs": (None, "how multimodal inputs load; kvroute serves text-only models"),
    "guided_decoding_backend": (("xgrammar", "auto"), "kvroute's structured outputs always run xgrammar"),
}

# vLLM's fields whose effect kvroute's engine cannot give, each with why. A backend that
# forwards the body to vLLM workers (``--workers``) passes them on: the workers honour them.
ENGINE_REFUSED_FIELDS: dict[str, str] = {
    "chat_template": "a template sent with a request would run as Jinja on the server, which vLLM too refuses "
                     "unless --trust-request-chat-template; start the server with --chat-template",
    "structural_tag": "structural tags are not implemented; use structured_outputs, response_format or tools",
    "guided_whitespace_pattern": "xgrammar takes no whitespace pattern",
    "kv_transfer_params": "kvroute runs no disaggregated prefill and decode",
    "vllm_xargs": "kvroute runs no request extensions",
    "logits_processors": "kvroute loads no custom logits processors",
}


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

# The keys of vLLM's ``structured_outputs`` object that kvroute constrains output with.
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def _only(field: str) -> AfterValidator:
    allowed, reason = NO_EFFECT_FIELDS[field]

    def check(v: Any) -> Any:
        if allowed is not None and v not in allowed:
            shown = " or ".join(repr(a).lower() if isinstance(a, bool) else repr(a) for a in allowed)
            raise ValueError(f"only {shown} is supported ({reason})")
        return v

    return AfterValidator(check)


class NullableModel(BaseModel):
    """Unknown fields are refused; ``null`` for a field with a default means the default
    (a required field keeps its ``null``, so the 400 says what is wrong with it)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or (k in fields and fields[k].is_required())}


class NoEffectFields(BaseModel):
    """The fields accepted with no effect (``NO_EFFECT_FIELDS``); any other value of
    one of them is a 400 naming it."""

    user: Annotated[Optional[Text], _only("user")] = None
    metadata: Annotated[Optional[dict[Text, Text]], _only("metadata")] = None
    store: Annotated[StrictBool, _only("store")] = False
    service_tier: Annotated[str, _only("service_tier")] = "auto"
    use_beam_search: Annotated[StrictBool, _only("use_beam_search")] = False
    length_penalty: Annotated[float, _only("length_penalty")] = 1.0
    spaces_between_special_tokens: Annotated[StrictBool, _only("spaces_between_special_tokens")] = True
    priority: Annotated[StrictInt, _only("priority")] = 0
    no_stop_trim: Annotated[StrictBool, _only("no_stop_trim")] = False
    return_hidden_states: Annotated[StrictBool, _only("return_hidden_states")] = False
    separate_reasoning: Annotated[StrictBool, _only("separate_reasoning")] = True
    stream_reasoning: Annotated[StrictBool, _only("stream_reasoning")] = True
    include_reasoning: Annotated[StrictBool, _only("include_reasoning")] = True
    mm_processor_kwargs: Annotated[Optional[dict[str, Any]], _only("mm_processor_kwargs")] = None
    media_io_kwargs: Annotated[Optional[dict[str, Any]], _only("media_io_kwargs")] = None
    guided_decoding_backend: Annotated[Optional[str], _only("guided_decoding_backend")] = None


class VLLMFields(BaseModel):
    """vLLM's own request fields: ``request_id`` names the answer (``chatcmpl-<id>``,
    ``cmpl-<id>``, as vLLM names it), ``return_token_ids`` adds the prompt's and each
    choice's token ids to the answer, ``return_tokens_as_token_ids`` names logprobs'
    tokens ``token_id:<id>``; the ``ENGINE_REFUSED_FIELDS`` are taken for a backend that
    forwards them (``engine_refusal``)."""

    request_id: Optional[Text] = Field(default=None, min_length=1, max_length=256)
    return_token_ids: StrictBool = False
    return_tokens_as_token_ids: StrictBool = False
    chat_template: Optional[Any] = None
    structural_tag: Optional[Any] = None
    guided_whitespace_pattern: Optional[Any] = None
    kv_transfer_params: Optional[Any] = None
    vllm_xargs: Optional[Any] = None
    logits_processors: Optional[Any] = None

    @field_validator("request_id")
    @classmethod
    def _printable(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.isprintable():
            raise ValueError("must be printable text (it names the answer and its engine requests)")
        return v

    def engine_refusal(self) -> Optional[tuple[str, str]]:
        """(field, message) for the first field set that only a forwarding backend takes."""
        for name, reason in ENGINE_REFUSED_FIELDS.items():
            if getattr(self, name) is not None:
                return name, f"{name}: not supported ({reason})"
        return None


class StructuredFields(BaseModel):
    """Structured outputs as OpenAI (``response_format``) and vLLM
    (``structured_outputs``, the older ``guided_*``) spell them. The specs themselves are
    checked by ``replica/structured_output.py`` (``from_request``, ``validate``)."""

    response_format: Optional[dict[str, Any]] = None
    structured_outputs: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[Text, dict[str, Any]]] = None
    guided_regex: Optional[Text] = None
    guided_choice: Optional[list[Text]] = None
    guided_grammar: Optional[Text] = None

    @field_validator("structured_outputs")
    @classmethod
    def _known_keys(cls, v: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        unknown = sorted(set(v or ()) - set(STRUCTURED_OUTPUT_KEYS))
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not supported; give one of {', '.join(STRUCTURED_OUTPUT_KEYS)}")
        return v

    def structured_output(self) -> Any:
        """The request's ``StructuredOutput`` (None: unconstrained); ValueError whose
        message starts with the field it is about."""
        from kvroute.replica.structured_output import from_request

        return from_request(self.response_format, self.structured_outputs, guided_json=self.guided_json,
                            guided_regex=self.guided_regex, guided_choice=self.guided_choice,
                            guided_grammar=self.guided_grammar)  # fmt: skip


class LogitsFields(BaseModel):
    """vLLM's logits and prompt fields (token ids are checked against the vocabulary by
    ``OpenAIServing``, which knows it)."""

    logit_bias: Optional[dict[str, float]] = None
    allowed_token_ids: Optional[list[StrictInt]] = Field(default=None, min_length=1)
    bad_words: Optional[list[Text]] = None
    prompt_logprobs: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_LOGPROBS)
    truncate_prompt_tokens: Optional[StrictInt] = Field(default=None, ge=-1)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids (decimal strings), got {key!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # NaN fails this too
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {bias}")
        return v

    @field_validator("allowed_token_ids")
    @classmethod
    def _allowed(cls, v: Optional[list[int]]) -> Optional[list[int]]:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, v: Optional[list[str]]) -> Optional[list[str]]:
        if v is not None and not all(w.strip() for w in v):
            raise ValueError("words must be non-blank strings")
        return v

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _truncate(cls, v: Optional[int]) -> Optional[int]:
        if v == 0:
            raise ValueError("must be -1 (the model's context length) or >= 1")
        return v

    def token_ids_used(self) -> dict[str, list[int]]:
        """Each field's token ids, for the vocabulary check."""
        return {"logit_bias": [int(k) for k in self.logit_bias or ()], "allowed_token_ids": list(self.allowed_token_ids or ())}

    def logits_params(self) -> dict[str, Any]:
        """The engine's ``SamplingParams`` keywords for these fields."""
        return {
            "logit_bias": {int(k): float(b) for k, b in (self.logit_bias or {}).items()},
            "allowed_token_ids": None if self.allowed_token_ids is None else tuple(self.allowed_token_ids),
            "bad_words": tuple(self.bad_words or ()),
        }


def field_of(message: str, default: Optional[str] = None) -> Optional[str]:
    """The field a check's message starts with (``"response_format.json_schema: ..."``
    -> ``"response_format.json_schema"``), else ``default``."""
    head, sep, _ = message.partition(":")
    if sep and head and " " not in head and head[0].isalpha():
        return head
    if message.startswith("only one structured output may be given; got "):
        return message.rsplit("got ", 1)[1].split(",")[0].strip()
    return default
