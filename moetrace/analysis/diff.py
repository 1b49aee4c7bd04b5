"""Routing agreement between two traces of the same requests (R3's mismatch figures).

Two runs of the same prompts (two precisions, two engines, two batch sizes)
should route each token alike.  Row r of a request is the routing of token r
given tokens 0..r, so rows are compared only while both runs saw the same
tokens: over the common prefix of the two token sequences.  Where the
generated tokens part ways, the rows after that point are left out and the
request says where.

Per (token, layer) the top-k *sets* are compared (router order aside); a
token mismatches when any layer's set differs.  These are the figures of
Ma et al., "Stabilizing MoE Reinforcement Learning by Aligning Training and
Inference Routers" (R3, arXiv 2510.11370): the share of routers (token x
layer) and of tokens that select different experts.  When both traces hold
output log-probabilities, their drift over the same tokens is added
(``logprob_drift.py``).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from moetrace.analysis.logprob_drift import LogprobDrift
from moetrace.errors import MoetraceError
from moetrace.trace.reader import Trace, TraceRequest

PARTS = ("prompt", "output")
DIFF_CHUNK_ROWS = 4096  # rows compared at once: (rows, L, k, k) booleans stay a few tens of MB
_MUST_MATCH = ("num_moe_layers", "moe_layer_indices", "num_experts", "top_k")
_SHOULD_MATCH = ("architecture", "config_digest")


def check_comparable(a: Trace, b: Trace) -> list[str]:
    """Refuse traces of different routing shapes; warn where the models look different."""
    for key in _MUST_MATCH:
        va, vb = a.metadata.get(key), b.metadata.get(key)
        if va != vb:
            raise MoetraceError(f"traces differ in {key}: {va} ({a.path}) vs {vb} ({b.path})")
    return [
        f"{key} differs: {a.metadata.get(key)!r} vs {b.metadata.get(key)!r}"
        for key in _SHOULD_MATCH
        if a.metadata.get(key) != b.metadata.get(key)
    ]


def compared_rows(a: TraceRequest, b: TraceRequest) -> tuple[int, int | None, bool, bool]:
    """How far two runs of a request can be compared.

    Returns (rows both computed from the same tokens, the first token position
    where the token ids differ (None: never), whether one sequence is a proper
    prefix of the other (a shorter run), whether a token id was unknown (an
    imported trace without ids matches any id)).
    """
    ta = np.concatenate([a.prompt_token_ids, a.output_token_ids])
    tb = np.concatenate([b.prompt_token_ids, b.output_token_ids])
    m = min(len(ta), len(tb))
    unknown = (ta[:m] < 0) | (tb[:m] < 0)
    same = (ta[:m] == tb[:m]) | unknown
    common = int(np.argmin(same)) if not same.all() else m
    differs_at = None if common == m else common
    shorter = differs_at is None and len(ta) != len(tb)
    return min(common, a.num_rows, b.num_rows), differs_at, shorter, bool(unknown.any())


def compare_rows(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per (row, layer): sets differ, top-1 differs, Jaccard overlap of the two top-k sets."""
    set_diff = (np.sort(a, axis=2) != np.sort(b, axis=2)).any(axis=2)
    top1_diff = a[:, :, 0] != b[:, :, 0]
    inter = (a[:, :, :, None] == b[:, :, None, :]).any(axis=3).sum(axis=2)
    jaccard = inter / (2 * a.shape[2] - inter)
    return set_diff, top1_diff, jaccard


class RoutingDiff:
    """Mismatch counts, prompt and output rows apart, over the compared rows of every pair."""

    def __init__(self, num_layers: int) -> None:
        p, n = len(PARTS), num_layers
        self.num_layers = n
        self.tokens = np.zeros(p, dtype=np.int64)
        self.set_diff = np.zeros((p, n), dtype=np.int64)
        self.top1_diff = np.zeros((p, n), dtype=np.int64)
        self.jaccard = np.zeros((p, n), dtype=np.float64)
        self.any_diff = np.zeros(p, dtype=np.int64)
        self.layers_differing = np.zeros((p, n + 1), dtype=np.int64)  # tokens by #layers
        self.first_layer = np.zeros((p, n), dtype=np.int64)  # tokens by first differing layer

    def add(self, a: np.ndarray, b: np.ndarray, prompt_len: int) -> dict:
        """Fold one request's compared rows, a slice at a time; returns its own figures."""
        differing, first_token, jaccard_sum = 0, None, 0.0
        for start in range(0, len(a), DIFF_CHUNK_ROWS):
            stop = min(start + DIFF_CHUNK_ROWS, len(a))
            n_diff, first, jac = self._fold(a[start:stop], b[start:stop], prompt_len - start)
            if first is not None and first_token is None:
                first_token = start + first
            differing += n_diff
            jaccard_sum += jac
        n = len(a) * a.shape[1] if a.ndim == 3 else 0
        return {
            "tokens_with_difference": differing,
            "first_differing_token": first_token,
            "mean_jaccard": jaccard_sum / n if n else None,
        }

    def _fold(self, a: np.ndarray, b: np.ndarray, prompt_len: int) -> tuple[int, int | None, float]:
        set_diff, top1_diff, jaccard = compare_rows(a, b)
        is_output = np.arange(len(a)) >= prompt_len
        n_layers_diff = set_diff.sum(axis=1)
        token_diff = n_layers_diff > 0
        for part, mask in enumerate((~is_output, is_output)):
            self.tokens[part] += int(mask.sum())
            self.set_diff[part] += set_diff[mask].sum(axis=0)
            self.top1_diff[part] += top1_diff[mask].sum(axis=0)
            self.jaccard[part] += jaccard[mask].sum(axis=0)
            self.any_diff[part] += int(token_diff[mask].sum())
            self.layers_differing[part] += np.bincount(
                n_layers_diff[mask], minlength=self.num_layers + 1
            )
            first = np.argmax(set_diff[mask & token_diff], axis=1)
            self.first_layer[part] += np.bincount(first, minlength=self.num_layers)
        differing = np.flatnonzero(token_diff)
        first = int(differing[0]) if len(differing) else None
        return len(differing), first, float(jaccard.sum())

    def _figures(self, parts: list[int]) -> dict:
        t = int(self.tokens[parts].sum())
        set_diff = self.set_diff[parts].sum(axis=0)
        top1 = self.top1_diff[parts].sum(axis=0)
        jac = self.jaccard[parts].sum(axis=0)
        return {
            "tokens": t,
            "token_mismatch": float(self.any_diff[parts].sum() / t) if t else None,
            "router_mismatch": float(set_diff.sum() / (t * self.num_layers)) if t else None,
            "top1_mismatch": float(top1.sum() / (t * self.num_layers)) if t else None,
            "mean_jaccard": float(jac.sum() / (t * self.num_layers)) if t else None,
            "tokens_with_difference": int(self.any_diff[parts].sum()),
        }

    def result(self, layers: list[int]) -> dict:
        both = [0, 1]
        t = int(self.tokens.sum())
        set_diff = self.set_diff.sum(axis=0)
        top1 = self.top1_diff.sum(axis=0)
        jac = self.jaccard.sum(axis=0)
        first = self.first_layer.sum(axis=0)
        per_layer = [
            {
                "layer": int(layer),
                "tokens": t,
                "set_differs": int(set_diff[i]),
                "set_mismatch": float(set_diff[i] / t) if t else None,
                "top1_mismatch": float(top1[i] / t) if t else None,
                "mean_jaccard": float(jac[i] / t) if t else None,
                "first_differing": int(first[i]),
            }
            for i, layer in enumerate(layers)
        ]
        return {
            **self._figures(both),
            "by_part": {name: self._figures([i]) for i, name in enumerate(PARTS)},
            "layers_differing_histogram": self.layers_differing.sum(axis=0).tolist(),
            "layers": per_layer,
        }


def _pairs(
    a: Trace, b: Trace, match: str, ids: list[str] | None
) -> Iterator[tuple[TraceRequest, TraceRequest | None]]:
    """Requests of ``a`` (all, or those named) with their counterpart in ``b`` (None if absent).

    By ``id`` the samples of one prompt pair by sample index too.
    """
    if match not in ("id", "index"):
        raise MoetraceError(f"--match must be 'id' or 'index', got {match!r}")
    samples = b.sample_indices.tolist()
    if match == "id":
        keys = zip(b.request_ids, samples, strict=True)
    else:
        keys = zip(b.requests["index"].tolist(), samples, strict=True)
    b_keys = {key: i for i, key in reversed(list(enumerate(keys)))}
    missing = [rid for rid in ids or [] if rid not in set(a.request_ids)]
    if missing:
        raise MoetraceError(f"no request {missing[0]!r} in {a.path}")
    source = a if ids is None else (a.request(rid) for rid in ids)
    for req in source:
        key = (req.id if match == "id" else req.index, req.sample_index)
        pos = b_keys.get(key)
        yield req, (None if pos is None else b.request(pos))


def _no_pairs_hint(a: Trace, b: Trace, match: str) -> str:
    """What to say when not one request of A has a counterpart in B."""
    if match == "index":
        return "no request pairs up by input index; the traces hold different prompts"
    ids_a, ids_b = a.request_ids[:1], b.request_ids[:1]
    seen = f" (A's ids look like {ids_a[0]!r}, B's like {ids_b[0]!r})" if ids_a and ids_b else ""
    return (
        f"no request id of A is in B{seen}: an imported trace keeps the server's ids; "
        "if both ran the same prompts in the same order, try --match index"
    )


def diff_traces(
    a: Trace,
    b: Trace,
    *,
    match: str = "id",
    ids: list[str] | None = None,
    detail_limit: int = 50,
) -> dict:
    """Everything ``moetrace diff`` reports, in one pass over ``a`` (``b`` read by request).

    ``request_detail`` lists the requests that differ (routing, or tokens), at
    most ``detail_limit`` of them (0: all).
    """
    warnings = check_comparable(a, b)
    layers = [int(x) for x in a.metadata["moe_layer_indices"]]
    acc = RoutingDiff(len(layers))
    drift = _logprob_drift(a, b, warnings)
    tally = _RequestTally(detail_limit)
    for ra, rb in _pairs(a, b, match, ids):
        if rb is None:
            tally.only_a.append(ra.id)
        else:
            tally.add(*_compare_pair(ra, rb, acc, drift), rb.position)
    requests = tally.requests(a, b, ids)
    result = acc.result(layers)
    if tally.unknown_tokens:
        warnings.append(
            f"{tally.unknown_tokens} request(s) have unknown token ids; their rows were compared "
            "as if the tokens matched"
        )
    if requests["compared"] == 0 and (a.num_requests or b.num_requests):
        warnings.append(_no_pairs_hint(a, b, match))
    verdict = _verdict(result, requests)
    # Traces of the same requests with the same tokens and no differing row.
    identical = verdict["routing"] != "differs" and verdict["sequences"] == "identical"
    return {
        "a": str(a.path),
        "b": str(b.path),
        "match": match,
        "verdict": verdict,
        "identical": identical,
        "warnings": warnings,
        "requests": requests,
        "rows_excluded": tally.rows_excluded,
        **result,
        "logprobs": None if drift is None else drift.result(),
        "request_detail": tally.details,
    }


def _logprob_drift(a: Trace, b: Trace, warnings: list[str]) -> LogprobDrift | None:
    """A drift accumulator when both traces hold log-probabilities; a warning when one lacks."""
    if a.has_logprobs != b.has_logprobs:
        lacking = "A" if b.has_logprobs else "B"
        warnings.append(
            f"{lacking} holds no log-probabilities (recorded without --logprobs): the "
            "log-probability drift was not measured"
        )
    return LogprobDrift() if a.has_logprobs and b.has_logprobs else None


def _compare_pair(
    ra: TraceRequest, rb: TraceRequest, acc: RoutingDiff, drift: LogprobDrift | None
) -> tuple[dict, bool]:
    """Fold one pair into ``acc`` (and ``drift``); its detail row, and whether a token id
    was unknown."""
    n, differs_at, is_shorter, unknown = compared_rows(ra, rb)
    figures = acc.add(ra.routed_experts[:n], rb.routed_experts[:n], ra.prompt_len)
    if drift is not None and ra.prompt_len == rb.prompt_len:
        common = min(ra.prompt_len + ra.output_len, rb.prompt_len + rb.output_len)
        scored = max(0, (common if differs_at is None else differs_at) - ra.prompt_len)
        figures.update(drift.add(ra.output_logprobs[:scored], rb.output_logprobs[:scored]))
    prompt_same = ra.prompt_len == rb.prompt_len and (
        differs_at is None or differs_at >= ra.prompt_len
    )
    detail = {
        "id": ra.id,
        "b_id": rb.id,
        "sample_index": ra.sample_index,
        "rows_a": ra.num_rows,
        "rows_b": rb.num_rows,
        "compared_rows": n,
        "excluded_rows": max(ra.num_rows, rb.num_rows) - n,
        "tokens_diverge_at": differs_at,
        "one_is_shorter": is_shorter,
        "prompt_differs": not prompt_same,
        **figures,
    }
    return detail, unknown


class _RequestTally:
    """Request-level counts over the pairs, and the detail rows of those that differ."""

    def __init__(self, detail_limit: int) -> None:
        self.detail_limit = detail_limit
        self.details: list[dict] = []
        self.only_a: list[str] = []
        self.seen_b: set[int] = set()
        self.rows_excluded = self.diverged = self.shorter = 0
        self.prompts_differ = self.unknown_tokens = 0

    def add(self, detail: dict, unknown: bool, b_position: int) -> None:
        """Count one compared pair; keep its detail if it differs and the limit allows."""
        self.seen_b.add(b_position)
        self.unknown_tokens += unknown
        self.rows_excluded += detail["excluded_rows"]
        self.prompts_differ += detail["prompt_differs"]
        self.diverged += detail["tokens_diverge_at"] is not None
        self.shorter += detail["one_is_shorter"]
        differs = (
            detail["tokens_with_difference"]
            or detail["excluded_rows"]
            or detail["tokens_diverge_at"] is not None
        )
        if differs and (len(self.details) < self.detail_limit or self.detail_limit == 0):
            self.details.append(detail)

    def requests(self, a: Trace, b: Trace, ids: list[str] | None) -> dict:
        """The result's ``requests`` section: counts, and which requests went unpaired."""
        only_b = (
            [rid for i, rid in enumerate(b.request_ids) if i not in self.seen_b]
            if ids is None
            else []
        )
        return {
            "a": a.num_requests,
            "b": b.num_requests,
            "compared": (a.num_requests if ids is None else len(ids)) - len(self.only_a),
            "only_in_a": len(self.only_a),
            "only_in_b": len(only_b),
            "only_in_a_ids": self.only_a[:20],
            "only_in_b_ids": only_b[:20],
            "tokens_diverged": self.diverged,
            "one_is_shorter": self.shorter,
            "prompts_differ": self.prompts_differ,
        }


def _verdict(result: dict, requests: dict) -> dict[str, str]:
    """Two verdicts: routing over the compared rows, sequences over tokens and requests."""
    sequences_differ = (
        requests["tokens_diverged"]
        or requests["one_is_shorter"]
        or requests["only_in_a"]
        or requests["only_in_b"]
    )
    return {
        "routing": (
            "nothing compared"
            if result["tokens"] == 0
            else "differs"
            if result["tokens_with_difference"]
            else "identical"
        ),
        "sequences": ("identical" if not sequences_differ else "differ"),
    }


def diff_exit_code(result: dict) -> int:
    """As diff(1): 0 identical, 1 different, 2 nothing could be compared."""
    if result["identical"]:
        return 0
    if result["requests"]["compared"] == 0 and result["requests"]["a"] + result["requests"]["b"]:
        return 2
    return 1
