"""A replica's measured step cost, as a function of what a step computes (stdlib only).

    seconds ≈ overhead_s + s_per_token × tokens + s_per_pair × pairs

``pairs`` counts attention work: each new token attends to every position up to its
own, so computing positions ``[start, end)`` of a sequence costs
``sum(i + 1 for i in range(start, end))`` pairs. That term is what makes the last chunk
of a 6k-token prompt several times dearer per token than its first on a CPU.

The coefficients are fitted by least squares, non-negative, over the steps that carry
prefill (decode-only steps, CUDA graphs on a GPU, cost otherwise), each older step's
weight decaying by ``_DECAY`` per new one, so the model follows a neighbour slowing the
machine. Until a step is observed there is no model (``fitted`` is False) and callers
fall back to what they did without one. With too few kinds of step to tell the terms
apart, the fit keeps the simplest that explains them, a per-token rate first.
"""

from __future__ import annotations

from itertools import combinations
from math import sqrt
from typing import Sequence

_DECAY = 0.95  # weight an observation keeps per newer one (about the last 20 steps count)
_SCALE = (1.0, 1024.0, 1024.0 * 1024.0)  # feature units (step, Ki tokens, Mi pairs): a well-conditioned fit
# Terms to try, best first among equally good fits: a rate alone before an overhead alone.
_SUBSETS = [c for k in (3, 2, 1) for c in combinations((1, 2, 0), k)]


def attention_pairs(start: int, end: int) -> int:
    """Attention pairs of computing positions ``[start, end)`` of one sequence."""
    return (end * (end + 1) - start * (start + 1)) // 2


class StepCostModel:
    """``observe`` each step; ``seconds``, ``span_seconds`` and ``tokens_within``
    predict from the current fit."""

    def __init__(self) -> None:
        self._xtx = [[0.0] * 3 for _ in range(3)]  # decayed sums of x xᵀ over observed steps
        self._xty = [0.0] * 3
        self._yty = 0.0
        self.coef = (0.0, 0.0, 0.0)  # (overhead_s, s_per_token, s_per_pair)
        self.fitted = False

    @property
    def overhead_s(self) -> float:
        return self.coef[0]

    def observe(self, tokens: int, pairs: int, seconds: float) -> None:
        """Fold one step (``tokens`` computed, ``pairs`` attended) that took ``seconds``."""
        x = (1.0, tokens / _SCALE[1], pairs / _SCALE[2])
        for i in range(3):
            row = self._xtx[i]
            for j in range(3):
                row[j] = _DECAY * row[j] + x[i] * x[j]
            self._xty[i] = _DECAY * self._xty[i] + x[i] * seconds
        self._yty = _DECAY * self._yty + seconds * seconds
        self.coef = self._fit()
        self.fitted = True

    def seconds(self, tokens: int, pairs: int) -> float:
        """Predicted seconds of a step computing ``tokens`` with ``pairs``, overhead included."""
        o, u, v = self.coef
        return o + u * tokens + v * pairs

    def span_seconds(self, start: int, end: int) -> float:
        """Predicted seconds of computing positions ``[start, end)`` of one sequence,
        without the step overhead (other rows share the steps)."""
        _, u, v = self.coef
        return u * (end - start) + v * attention_pairs(start, end)

    def tokens_within(self, seconds: float, start: int) -> int:
        """The most tokens from position ``start`` computable in ``seconds`` (overhead
        not included); a large number when the fit prices tokens at nothing."""
        _, u, v = self.coef
        if seconds <= 0:
            return 0
        b = u + v * (start + 0.5)  # c tokens cost b×c + v×c²/2
        if b <= 0:
            return 1 << 30
        return int(2 * seconds / (b + sqrt(b * b + 2 * v * seconds)))

    # ------------------------------------------------------------------ fit
    def _fit(self) -> tuple[float, float, float]:
        """The non-negative least-squares coefficients: every subset of the terms is
        solved, and the first (``_SUBSETS`` order) whose residual is within a hair of
        the smallest wins."""
        fits = []
        for terms in _SUBSETS:
            theta = self._solve(terms)
            if theta is not None and min(theta) >= 0:
                fits.append((self._residual(terms, theta), terms, theta))
        if not fits:
            return self.coef
        least = min(f[0] for f in fits)
        tol = 1e-6 * self._yty + 1e-15
        _, terms, theta = next(f for f in fits if f[0] <= least + tol)
        coef = [0.0, 0.0, 0.0]
        for t, value in zip(terms, theta):
            coef[t] = value / _SCALE[t]
        return coef[0], coef[1], coef[2]

    def _solve(self, terms: Sequence[int]) -> list[float] | None:
        """The normal equations restricted to ``terms``, by Gaussian elimination; None
        when the observations cannot tell those terms apart."""
        n = len(terms)
        m = [[self._xtx[i][j] for j in terms] + [self._xty[i]] for i in terms]
        for col in range(n):
            piv = max(range(col, n), key=lambda r: abs(m[r][col]))
            if abs(m[piv][col]) <= 1e-9 * max(self._xtx[t][t] for t in terms):
                return None
            m[col], m[piv] = m[piv], m[col]
            for r in range(n):
                if r != col:
                    f = m[r][col] / m[col][col]
                    m[r] = [a - f * b for a, b in zip(m[r], m[col])]
        return [m[i][n] / m[i][i] for i in range(n)]

    def _residual(self, terms: Sequence[int], theta: Sequence[float]) -> float:
        """Σ(y − xθ)² from the sums: yᵀy − 2θᵀXᵀy + θᵀXᵀXθ."""
        fit = sum(th * self._xty[t] for t, th in zip(terms, theta))
        quad = sum(a * b * self._xtx[s][t] for s, a in zip(terms, theta) for t, b in zip(terms, theta))
        return self._yty - 2 * fit + quad
