"""The ingress's check of a request's structured output: parse the spec and compile it
against the model's vocabulary within a time limit, before any engine work, so an
invalid or pathological spec is a 400 naming its field rather than an engine failure.

The compiled grammars are kept (``GrammarCache``): a spec seen before is checked at
once. The cache is built on first use, off the event loop (reading the vocabulary takes
a moment; a server that never constrains output never builds it).
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from kvroute.deploy.openai.errors import bad_request
from kvroute.deploy.openai.request_fields import field_of
from kvroute.replica.structured_output import GrammarCache, StructuredOutput, validate


class StructuredOutputCheck:
    def __init__(self, tokenizer: Any, vocab_size: int, timeout_s: float) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._cache: Optional[GrammarCache] = None
        self._lock = asyncio.Lock()

    async def __call__(self, so: Optional[StructuredOutput]) -> Optional[StructuredOutput]:
        """``so`` once it parsed and compiled in time; a 400 naming its field otherwise."""
        if so is None:
            return None
        try:
            cache = await self._grammars()
            await asyncio.to_thread(validate, so, cache, self.timeout_s)
        except ValueError as exc:
            raise bad_request(str(exc), param=field_of(str(exc), so.field)) from None
        return so

    async def _grammars(self) -> GrammarCache:
        async with self._lock:
            if self._cache is None:
                eos = getattr(self.tokenizer, "eos_token_id", None)
                self._cache = await asyncio.to_thread(
                    GrammarCache, self.tokenizer, self.vocab_size, [] if eos is None else [eos], timeout_s=self.timeout_s
                )
        return self._cache
