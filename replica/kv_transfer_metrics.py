"""Counters of one engine's KV transfers (stdlib only): blocks it exported and imported,
imports it refused, and the pulls its host ran (a pull = a source's export fetched and
imported here), with their seconds, bytes and the pulls that fell back to recomputing.

Exports and imports are counted by ``replica/kv_transfer.py``; pulls by whoever moves
the payload between engines (``cluster/kv_pull.py``); the warm-up of a replica that
joined (the hot prefixes it pulled before serving) and the hand-off of one that left
(the prefixes it sent to survivors) by ``cluster/fleet_moves.py``. ``report()`` is a JSON-able dict
that rides in the replica's metrics report (``AsyncEngine.metrics_report``, key
``kv_transfer``); ``pull_bytes_per_s`` is what a router can price a pull with.
"""

from __future__ import annotations

from typing import Any

from kvroute.replica.request_metrics import Histogram

# Pull durations, seconds: a few ms (small prefix, one host) to seconds (long prefix, slow link)
PULL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class TransferMetrics:
    def __init__(self) -> None:
        self.exports = self.exported_blocks = self.exported_bytes = 0
        self.imports = self.imported_blocks = self.imported_bytes = 0
        self.import_refusals = 0
        self.pulls = self.pulled_blocks = self.pulled_tokens = self.pulled_bytes = 0
        self.pull_s = Histogram(PULL_BUCKETS)
        self.fallbacks: dict[str, int] = {}  # why -> pulls that fell back to recomputing
        self.warmup_prefixes = self.warmup_blocks = self.warmup_tokens = self.warmup_skipped = 0
        self.warmup_s = 0.0  # from asking the router to the last warm-up pull's end
        self.handoff_prefixes = self.handoff_blocks = self.handoff_failed = 0

    def on_export(self, blocks: int, nbytes: int) -> None:
        self.exports += 1
        self.exported_blocks += blocks
        self.exported_bytes += nbytes

    def on_import(self, blocks: int, nbytes: int) -> None:
        """An import committed ``blocks`` new blocks (``nbytes`` payload bytes)."""
        self.imports += 1
        self.imported_blocks += blocks
        self.imported_bytes += nbytes

    def on_pull(self, blocks: int, tokens: int, nbytes: int, seconds: float) -> None:
        """A pull that left ``blocks`` blocks (``tokens`` tokens) of the prefix cached here."""
        self.pulls += 1
        self.pulled_blocks += blocks
        self.pulled_tokens += tokens
        self.pulled_bytes += nbytes
        self.pull_s.observe(seconds)

    def on_fallback(self, why: str) -> None:
        self.fallbacks[why] = self.fallbacks.get(why, 0) + 1

    def on_warmup(self, prefixes: int, blocks: int, tokens: int, skipped: int, seconds: float) -> None:
        self.warmup_prefixes += prefixes
        self.warmup_blocks += blocks
        self.warmup_tokens += tokens
        self.warmup_skipped += skipped
        self.warmup_s += seconds

    def on_handoff(self, blocks: int) -> None:
        """A prefix of ``blocks`` blocks handed to a survivor (0: it took none)."""
        if blocks:
            self.handoff_prefixes += 1
            self.handoff_blocks += blocks
        else:
            self.handoff_failed += 1

    @property
    def pull_bytes_per_s(self) -> float:
        """Bytes pulled per second of pulling, over every successful pull (0: none yet)."""
        return self.pulled_bytes / self.pull_s.sum if self.pull_s.sum > 0 else 0.0

    def report(self) -> dict[str, Any]:
        return {
            "exports": self.exports, "exported_blocks": self.exported_blocks, "exported_bytes": self.exported_bytes,
            "imports": self.imports, "imported_blocks": self.imported_blocks, "imported_bytes": self.imported_bytes,
            "import_refusals": self.import_refusals,
            "pulls": self.pulls, "pulled_blocks": self.pulled_blocks, "pulled_tokens": self.pulled_tokens,
            "pulled_bytes": self.pulled_bytes, "pull_s": self.pull_s.report(), "pull_bytes_per_s": self.pull_bytes_per_s,
            "pull_fallbacks": dict(self.fallbacks),
            "warmup_prefixes": self.warmup_prefixes, "warmup_blocks": self.warmup_blocks,
            "warmup_tokens": self.warmup_tokens, "warmup_skipped": self.warmup_skipped, "warmup_s": self.warmup_s,
            "handoff_prefixes": self.handoff_prefixes, "handoff_blocks": self.handoff_blocks,
            "handoff_failed": self.handoff_failed,
        }  # fmt: skip
