"""Expert load for EPLB (``export --format eplb``) and replicated experts (``inspect
--redundant-experts``).

The load matrix is checked against counts taken straight from the file with
h5py; the placement against what its rules say (every rank as many slots, each
replica a share of its expert's load, the greedy choices) and a hand-worked case.
"""

from __future__ import annotations

import io
import json

import h5py
import numpy as np
import pytest
from support.cli import moetrace, trace  # noqa: F401  (the fixture: a demo trace)

from moetrace.analysis.eplb import balanced_packing, place_replicated, replicate_experts


def counts_from_file(path, part: str = "all") -> np.ndarray:
    """``[L, E]`` assignments, read with h5py alone."""
    with h5py.File(path, "r") as f:
        rows, table = f["routed_experts"][:], f["requests"][:]
        experts = int(f.attrs["num_experts"])
    keep = np.zeros(len(rows), dtype=bool)
    for rec in table:
        r0, n, p = int(rec["row_start"]), int(rec["num_rows"]), int(rec["prompt_len"])
        lo, hi = {"all": (0, n), "prompt": (0, min(p, n)), "output": (min(p, n), n)}[part]
        keep[r0 + lo : r0 + hi] = True
    rows = rows[keep]
    return np.stack(
        [np.bincount(rows[:, layer].ravel(), minlength=experts) for layer in range(rows.shape[1])]
    )


@pytest.mark.parametrize("part", ["all", "output"])
def test_the_load_matrix_is_the_assignment_count_of_every_layer_and_expert(trace, part):  # noqa: F811
    proc = moetrace("export", str(trace), "--format", "eplb", "--part", part)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    want = counts_from_file(trace, part)
    np.testing.assert_array_equal(np.asarray(doc["weight"]), want)
    assert (doc["num_moe_layers"], doc["num_logical_experts"]) == want.shape
    assert doc["format"] == "moetrace-eplb-load" and doc["part"] == part


def test_windows_split_the_same_counts_in_record_order(trace, tmp_path):  # noqa: F811
    out = tmp_path / "load.npy"
    proc = moetrace("export", str(trace), "--format", "eplb-npy", "-o", str(out),
                    "--window-tokens", "100")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    windows = np.load(out)
    want = counts_from_file(trace)
    assert windows.ndim == 3 and windows.shape[1:] == want.shape
    np.testing.assert_array_equal(windows.sum(axis=0), want)
    k = int(h5py.File(trace, "r").attrs["top_k"])
    per_window = windows.sum(axis=(1, 2)) // (want.shape[0] * k)  # rows in each window
    assert (per_window[:-1] == 100).all() and 0 < per_window[-1] <= 100
    proc = moetrace("export", str(trace), "--format", "eplb", "--window-tokens", "100")
    doc = json.loads(proc.stdout)
    assert [w["weight"] for w in doc["windows"]] == windows.tolist()
    assert doc["windows"][0]["tokens"] == [0, 100] and doc["windows"][0]["records"][0] == 0
    np.testing.assert_array_equal(np.load(io.BytesIO(out.read_bytes())), windows)


def test_load_options_are_checked(trace):  # noqa: F811
    proc = moetrace("export", str(trace), "--format", "npz", "-o", "x.npz", "--window-tokens", "5")
    assert proc.returncode == 1 and "apply to --format eplb" in proc.stderr
    proc = moetrace("export", str(trace), "--format", "eplb", "--window-tokens", "0")
    assert proc.returncode == 1 and "at least 1" in proc.stderr


def test_replicas_go_to_the_most_loaded_expert_per_replica():
    load = np.array([90, 10, 40, 20])
    # 90 -> 2 copies (45 each), then 45 is still the most: 3 copies (30); then 40 -> 2 (20).
    assert replicate_experts(load, 7).tolist() == [3, 1, 2, 1]
    assert replicate_experts(load, 4).tolist() == [1, 1, 1, 1]
    with pytest.raises(ValueError):
        replicate_experts(load, 3)


def test_balanced_packing_fills_every_pack_equally_heaviest_first():
    weights = np.array([10.0, 9, 8, 7, 1, 1])
    packs = balanced_packing(weights, 3)
    assert np.bincount(packs, minlength=3).tolist() == [2, 2, 2]
    # 10 -> 0, 9 -> 1, 8 -> 2, 7 -> 2 (lightest), 1 -> 1, 1 -> 0: loads 11, 10, 15.
    assert packs.tolist() == [0, 1, 2, 2, 1, 0]
    with pytest.raises(ValueError):
        balanced_packing(weights, 4)


def test_a_placement_holds_every_expert_and_shares_its_load():
    rng = np.random.default_rng(3)
    for _ in range(20):
        experts, ranks = 16, 4
        redundant = int(rng.integers(0, 3)) * ranks
        load = rng.zipf(1.6, experts).astype(np.int64) * 10
        placed = place_replicated(load, ranks, redundant)
        slots = placed.physical_to_logical
        assert len(slots) == experts + redundant
        assert np.bincount(slots, minlength=experts).tolist() == placed.replicas.tolist()
        assert placed.rank_load.sum() == pytest.approx(load.sum())
        # Rank by rank, the slots come in rank order: each rank's share is its slots' loads.
        per_slot = load[slots] / placed.replicas[slots]
        np.testing.assert_allclose(per_slot.reshape(ranks, -1).sum(axis=1), placed.rank_load)


def test_inspect_shows_the_imbalance_before_and_after(trace):  # noqa: F811
    proc = moetrace("inspect", str(trace), "-v", "ep", "--ep-size", "4",
                    "--redundant-experts", "4", "--json")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    ep = json.loads(proc.stdout)["ep"]
    rep = ep["replicated"]
    counts = counts_from_file(trace)
    assert rep["physical_experts"] == counts.shape[1] + 4 and rep["slots_per_rank"] == 5
    for i, layer in enumerate(rep["layers"]):
        assert sum(layer["rank_load"]) == pytest.approx(counts[i].sum())
        assert layer["max_violation"] <= layer["max_violation_before"]
        assert layer["max_over_mean_before"] == pytest.approx(ep["layers"][i]["max_over_mean"])
        assert sorted(rep["physical_to_logical"][i]) == sorted(
            e for e, n in enumerate(rep["logical_replicas"][i]) for _ in range(n)
        )
    text = moetrace("inspect", str(trace), "-v", "ep", "--ep-size", "4",
                    "--redundant-experts", "4")  # fmt: skip
    assert "redundant experts by balanced packing" in text.stdout
    bad = moetrace("inspect", str(trace), "--ep-size", "4", "--redundant-experts", "3")
    assert bad.returncode == 1 and "do not divide over 4 ranks" in bad.stderr
    bad = moetrace("inspect", str(trace), "--redundant-experts", "4")
    assert bad.returncode == 1 and "needs --ep-size" in bad.stderr
