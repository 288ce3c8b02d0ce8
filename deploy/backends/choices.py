"""The backends that stream choices: each choice of a prepared request runs as one
engine request (``generate``, given a frozen ``EngineRequest``), and the answer is shaped here from the merged deltas
(``deploy/openai/fanout.py`` runs them, ``deploy/openai/answers/`` shapes them).
``ClusterBackend`` (the Serve application's replicas, ``deploy/backends/cluster.py``) and
``EngineBackend`` (one in-process engine, ``deploy/backends/engine.py``) are such
backends; the external workers' backend (``deploy/backends/workers.py``) forwards the
request whole instead.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, AsyncIterator, Optional

from kvroute.deploy.openai.answers import bodies, chunks
from kvroute.deploy.openai.answers.logprobs import token_id_text
from kvroute.deploy.openai.fanout import Choice, EngineRequest, Stream, collect, event_stream, run_choices
from kvroute.deploy.openai.protocol import Answer, PreparedRequest
from kvroute.replica.outputs import TokenDelta


class ChoiceBackend(ABC):
    """A ``Backend`` (``deploy/openai/serving.py``) that runs every choice as one engine
    request. ``tokenizer`` names the tokens logprobs report; ``timeout_s``: a request's
    deadline (408 past it)."""

    def __init__(self, tokenizer: Any, timeout_s: Optional[float]) -> None:
        self.text_of = bodies.TokenText(tokenizer)
        self.timeout_s = timeout_s

    @abstractmethod
    def generate(self, request: EngineRequest) -> AsyncIterator[TokenDelta]:
        """One engine request's deltas (``fanout.Generate``)."""

    @abstractmethod
    async def health(self) -> dict[str, Any]:
        """``/health``'s body (``Backend.health``)."""

    def finished(self, choice: Choice) -> None:
        """Called once per finished choice, with where it ran (``choice.outcome``)."""

    async def answer(self, request: PreparedRequest) -> Answer:
        """Run ``request``'s choices; a JSON body, or an SSE stream that has every
        choice's first delta (``fanout.event_stream``)."""
        stream = run_choices(self.generate, request, self.finished)
        text_of = token_id_text if request.tokens_as_ids else self.text_of
        if not request.stream:
            return bodies.body(request, await collect(stream, self.timeout_s), text_of)

        def make_chunks(deltas: Stream) -> AsyncIterator[dict[str, Any]]:
            return chunks.chunks(request, deltas, text_of)

        return await event_stream(stream, request.num_choices, make_chunks, self.timeout_s)
