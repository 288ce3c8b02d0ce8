"""Structured outputs: the spec a request carries (:class:`StructuredOutput`) and the
per-tokenizer cache of compiled grammars (:class:`GrammarCache`).

The grammar engine is xgrammar (what vLLM and SGLang use by default): it compiles a JSON
schema, regex or EBNF/Lark grammar against the tokenizer's vocabulary once, then a
per-request matcher fills the allowed-token bitmask of each step in microseconds.

Validation happens in two stages, both raising ValueError that names the field and the
reason: :meth:`StructuredOutput.check` parses the spec without a tokenizer (fast; the
engine runs it in ``make_request``), and :func:`validate` (the ingress) also compiles it
under a time limit, so a pathological spec is refused before any engine work. xgrammar is
imported on first use only: a process that never constrains a request never loads it.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Iterable

KINDS = ("json", "json_object", "regex", "choice", "grammar", "lark")
COMPILE_TIMEOUT_S = 10.0  # the default bound on one compile (a slower spec is refused)
# JSON: any whitespace between elements (indented output too), at most this many
# characters in a row, so a model cannot spend its tokens on whitespace.
JSON_MAX_WHITESPACE = 20
# JSON-schema keywords xgrammar parses but does not enforce: refused rather than ignored.
UNSUPPORTED_JSON_KEYWORDS = ("not", "if", "then", "else", "dependentSchemas")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_VALUES = ("items", "additionalProperties", "contains", "propertyNames", "unevaluatedProperties",
                  "additionalItems", "unevaluatedItems")  # fmt: skip
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match.

    ``kind``: ``json`` (``spec`` a JSON schema, as text or a dict), ``json_object`` (any
    JSON object; no spec), ``regex``, ``choice`` (``spec`` a list of strings: the output is
    exactly one of them), ``grammar`` (xgrammar EBNF, ``root`` rule) or ``lark``.
    ``field``: the request field it came from, named in error messages (e.g.
    ``response_format.json_schema``). Stored normalized (schema as compact JSON text,
    choices as a tuple), so equal specs are equal values and share one compiled grammar.
    """

    kind: str
    spec: Any = None
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.field}: kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        object.__setattr__(self, "spec", self._normalized_spec())

    def _normalized_spec(self) -> Any:
        spec, where = self.spec, self.field
        if self.kind == "json_object":
            if spec not in (None, ""):
                raise ValueError(f"{where}: json_object takes no schema")
            return None
        if self.kind == "choice":
            if isinstance(spec, str) or not isinstance(spec, Iterable):
                raise ValueError(f"{where}: choice must be a list of strings")
            choices = tuple(spec)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError(f"{where}: choice must be a non-empty list of non-empty strings")
            return choices
        if self.kind == "json" and isinstance(spec, dict):
            return json.dumps(spec, ensure_ascii=False, separators=(",", ":"))
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"{where}: a {self.kind} spec must be a non-empty string")
        return spec

    @property
    def key(self) -> tuple[str, Any]:
        """The compile cache's key: the same spec compiles once per tokenizer."""
        return (self.kind, self.spec)

    def grammar(self) -> Any:
        """The xgrammar ``Grammar`` of the spec (parsing only, no tokenizer); ValueError
        naming the field when the spec is invalid or uses an unsupported keyword."""
        import xgrammar as xgr

        try:
            if self.kind == "json":
                _check_schema(json.loads(self.spec), self.field)
                return xgr.Grammar.from_json_schema(self.spec, max_whitespace_cnt=JSON_MAX_WHITESPACE)
            if self.kind == "json_object":  # any object (strict_mode off: any properties)
                return xgr.Grammar.from_json_schema('{"type":"object"}', strict_mode=False,
                                                    max_whitespace_cnt=JSON_MAX_WHITESPACE)  # fmt: skip
            if self.kind == "regex":
                return xgr.Grammar.from_regex(self.spec)
            if self.kind == "choice":
                alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in self.spec)
                return xgr.Grammar.from_ebnf(f"root ::= {alts}")
            if self.kind == "grammar":
                return xgr.Grammar.from_ebnf(self.spec)
            return xgr.Grammar.from_lark(self.spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"{self.field}: the schema is not valid JSON ({e})") from None
        except RuntimeError as e:  # xgrammar's parse errors
            raise ValueError(f"{self.field}: invalid {self.kind}: {_reason(e)}") from None

    def check(self) -> None:
        """Parse the spec (no compile): ValueError naming the field and the reason."""
        self.grammar()


def _reason(e: BaseException) -> str:
    """xgrammar's message without its log prefix (``[time] file:line: ``)."""
    text = str(e).strip()
    if text.startswith("[") and ": " in text:
        text = text.split(": ", 1)[1]
    return text.splitlines()[0] if text else type(e).__name__


def _check_schema(schema: Any, where: str, path: str = "") -> None:
    """Refuse the keywords xgrammar would silently ignore (the output would not match)."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{where}: the schema{path or ''} must be an object or a boolean")
    for kw in UNSUPPORTED_JSON_KEYWORDS:
        if kw in schema:
            raise ValueError(f"{where}: the JSON schema keyword {kw!r} (at {path or '/'}) is not supported")
    if schema.get("uniqueItems") is True:
        raise ValueError(f"{where}: the JSON schema keyword 'uniqueItems' (at {path or '/'}) is not supported")
    for kw in _SCHEMA_MAPS:
        if isinstance(schema.get(kw), dict):
            for name, sub in schema[kw].items():
                _check_schema(sub, where, f"{path}/{kw}/{name}")
    for kw in _SCHEMA_VALUES:
        if isinstance(schema.get(kw), (dict, bool)):
            _check_schema(schema[kw], where, f"{path}/{kw}")
    for kw in _SCHEMA_LISTS + ("items",):
        if isinstance(schema.get(kw), list):
            for i, sub in enumerate(schema[kw]):
                _check_schema(sub, where, f"{path}/{kw}/{i}")


class GrammarCache:
    """Compiled grammars of one tokenizer, compiled on a thread pool (off the step loop).

    ``submit`` returns the spec's future (one compile per distinct spec; the most recent
    ``max_entries`` are kept). A compile that takes longer than ``timeout_s`` is refused:
    its future fails with ValueError and the spec stays refused (the compile thread
    itself cannot be interrupted and finishes on its own; the pool's ``max_workers``
    bounds how many run at once). ``vocab_size`` is the model's logits width: ids past
    the tokenizer's vocabulary (padding) are never allowed by a grammar.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], max_workers: int = 2,
                 timeout_s: float = COMPILE_TIMEOUT_S, max_entries: int = 256) -> None:  # fmt: skip
        import xgrammar as xgr

        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids))
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self.max_entries = max_entries
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._futures: OrderedDict[tuple, tuple[Future, float]] = OrderedDict()
        self._refused: dict[tuple, str] = {}
        self.num_compiles = 0

    def submit(self, so: StructuredOutput) -> Future:
        """The future of ``so``'s compiled grammar (started now unless already known)."""
        with self._lock:
            if so.key in self._refused:
                fut: Future = Future()
                fut.set_exception(ValueError(self._refused[so.key]))
                return fut
            entry = self._futures.get(so.key)
            if entry is not None:
                self._futures.move_to_end(so.key)
                return entry[0]
            self.num_compiles += 1
            fut = self._pool.submit(self._compile, so)
            self._futures[so.key] = (fut, time.monotonic())
            while len(self._futures) > self.max_entries:
                self._futures.popitem(last=False)
            return fut

    def _compile(self, so: StructuredOutput) -> Any:
        grammar = so.grammar()
        try:
            return self._compiler.compile_grammar(grammar)
        except RuntimeError as e:
            raise ValueError(f"{so.field}: cannot compile the {so.kind}: {_reason(e)}") from None

    def overdue(self, so: StructuredOutput) -> str | None:
        """If ``so``'s compile is still running past the time limit, refuse the spec from
        now on and return the reason; None otherwise."""
        with self._lock:
            entry = self._futures.get(so.key)
            if entry is None or entry[0].done() or time.monotonic() - entry[1] <= self.timeout_s:
                return self._refused.get(so.key)
            reason = f"{so.field}: compiling the {so.kind} took longer than {self.timeout_s:g} s"
            self._refused[so.key] = reason
            del self._futures[so.key]
            return reason

    def compile(self, so: StructuredOutput, timeout_s: float | None = None) -> Any:
        """Wait for ``so``'s compiled grammar: ValueError if the spec is invalid or its
        compile takes longer than the time limit."""
        fut = self.submit(so)
        limit = self.timeout_s if timeout_s is None else timeout_s
        if not wait([fut], timeout=limit).done:
            reason = f"{so.field}: compiling the {so.kind} took longer than {limit:g} s"
            with self._lock:
                self._refused[so.key] = reason
                self._futures.pop(so.key, None)
            raise ValueError(reason)
        return fut.result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def validate(so: StructuredOutput, cache: GrammarCache | None = None, timeout_s: float | None = None) -> None:
    """The ingress's check before any engine work: parse ``so`` (ValueError naming the
    field and the reason); with ``cache``, also compile it within ``timeout_s`` (the
    cache's limit when None), so a spec that compiles too slowly is refused too."""
    so.check()
    if cache is not None:
        cache.compile(so, timeout_s)


_VLLM_KEYS = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json_object"}


def _grammar_kind(text: Any) -> str:
    """xgrammar EBNF (rules written ``name ::= ...``) or, otherwise, Lark (``name: ...``)."""
    return "grammar" if isinstance(text, str) and "::=" in text else "lark"


def from_request(response_format: Any = None, structured_outputs: Any = None, **guided: Any) -> StructuredOutput | None:
    """The request's :class:`StructuredOutput` from its API fields, None when it asks for
    none: OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema`` with
    ``schema``; ``strict`` true or false, the output is held to the schema either way),
    vLLM's ``structured_outputs`` (one of ``json``, ``regex``, ``choice``, ``grammar``,
    ``json_object``) and vLLM's older ``guided_json`` / ``guided_regex`` /
    ``guided_choice`` / ``guided_grammar`` keywords (None values are ignored). A grammar is
    EBNF when it has ``::=``, else Lark. ValueError naming the field when more than one
    is given or one is malformed; the spec itself is checked by ``check``/``validate``."""
    found: list[StructuredOutput] = []
    if response_format is not None:
        rf = response_format if isinstance(response_format, dict) else None
        kind = rf.get("type") if rf else None
        if kind == "json_object":
            found.append(StructuredOutput("json_object", None, "response_format"))
        elif kind == "json_schema":
            js = rf.get("json_schema")  # type: ignore[union-attr]
            if not isinstance(js, dict) or not isinstance(js.get("schema"), dict):
                raise ValueError("response_format.json_schema: must be an object with a 'schema' object")
            found.append(StructuredOutput("json", js["schema"], "response_format.json_schema.schema"))
        elif kind != "text":
            raise ValueError(f"response_format: type must be text, json_object or json_schema; got {kind!r}")
    if structured_outputs is not None:
        given = {k: v for k, v in (structured_outputs.items() if isinstance(structured_outputs, dict) else ()) if k in _VLLM_KEYS and v not in (None, False)}
        for key, value in given.items():
            kind = _grammar_kind(value) if key == "grammar" else _VLLM_KEYS[key]
            found.append(StructuredOutput(kind, None if key == "json_object" else value, f"structured_outputs.{key}"))
    for key, value in guided.items():
        if not key.startswith("guided_") or key[7:] not in _VLLM_KEYS:
            raise TypeError(f"from_request() got an unexpected keyword argument {key!r}")
        if value not in (None, False):
            kind = _grammar_kind(value) if key == "guided_grammar" else _VLLM_KEYS[key[7:]]
            found.append(StructuredOutput(kind, None if kind == "json_object" else value, key))
    if len(found) > 1:
        raise ValueError(f"only one structured output may be given; got {', '.join(so.field for so in found)}")
    return found[0] if found else None
