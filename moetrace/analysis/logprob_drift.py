"""How far two runs' log-probabilities of the same tokens are apart (R3's policy figures).

For each output token both traces scored from the same preceding tokens,
with ``a`` the run that sampled the tokens (the recording: inference) and
``b`` the other (a replay: the training side), ``d = log p_b - log p_a`` and
the probability ratio ``r = p_b / p_a = exp(d)``:

- mean |d|, and its largest value;
- KL(p_a || p_b) estimated from the sampled tokens, two ways (Schulman's
  estimators, "Approximating KL divergence", 2020): ``k1 = mean(-d)``
  (unbiased, can be negative) and ``k3 = mean(r - 1 - d)`` (unbiased, never
  negative, lower variance).  Both assume the tokens were drawn from ``p_a``;
  greedy decoding or temperature / top-p sampling draw from another
  distribution, and the figures are then those of the tokens as given;
- the share of tokens whose probability changed by more than a factor
  ``tau`` either way (``max(r, 1/r) > tau``), for tau = 2 (R3's "extreme
  tokens") and a few other tau: the tail F(tau).
"""

from __future__ import annotations

import numpy as np

TAUS = (1.5, 2.0, 5.0, 10.0)


class LogprobDrift:
    """Accumulates ``d = b - a`` over the tokens both runs scored."""

    def __init__(self) -> None:
        self.tokens = 0
        self.abs_sum = 0.0
        self.abs_max = 0.0
        self.k1_sum = 0.0
        self.k3_sum = 0.0
        self.beyond = np.zeros(len(TAUS), dtype=np.int64)
        self.b_higher = 0  # tokens with r > 2
        self.b_lower = 0  # tokens with r < 1/2

    def add(self, a: np.ndarray, b: np.ndarray) -> dict:
        """Fold one request's log-probabilities (NaN: not scored, left out); its own figures."""
        a = np.asarray(a, dtype=np.float64)
        b = np.asarray(b, dtype=np.float64)
        both = np.isfinite(a) & np.isfinite(b)
        d = b[both] - a[both]
        if d.size == 0:
            return {"scored_tokens": 0, "mean_abs_logprob_diff": None, "max_abs_logprob_diff": None}
        ad = np.abs(d)
        self.tokens += d.size
        self.abs_sum += float(ad.sum())
        self.abs_max = max(self.abs_max, float(ad.max()))
        self.k1_sum += float((-d).sum())
        self.k3_sum += float(np.expm1(d).sum() - d.sum())
        self.beyond += (ad[:, None] > np.log(TAUS)[None, :]).sum(axis=0)
        self.b_higher += int((d > np.log(2.0)).sum())
        self.b_lower += int((d < -np.log(2.0)).sum())
        return {
            "scored_tokens": int(d.size),
            "mean_abs_logprob_diff": float(ad.mean()),
            "max_abs_logprob_diff": float(ad.max()),
        }

    def result(self) -> dict | None:
        """The figures over every token folded; None when none was."""
        t = self.tokens
        if t == 0:
            return None
        return {
            "tokens": t,
            "mean_abs_logprob_diff": self.abs_sum / t,
            "max_abs_logprob_diff": self.abs_max,
            "kl_k1": self.k1_sum / t,
            "kl_k3": self.k3_sum / t,
            "kl_direction": "KL(a || b), a = the trace that sampled the tokens",
            "ratio_above_2": float(self.beyond[TAUS.index(2.0)] / t),
            "ratio_b_over_a_above_2": self.b_higher / t,
            "ratio_a_over_b_above_2": self.b_lower / t,
            "tail": {f"{tau:g}": float(n / t) for tau, n in zip(TAUS, self.beyond, strict=True)},
        }
