"""Traces written by an earlier moetrace still read, verify, analyse and resume."""

from __future__ import annotations

import shutil

import h5py
import numpy as np
import pytest
from support.legacy_traces import DATA, LEGACY_TRACES, expected_requests, legacy_metadata_fields

from moetrace import open_trace
from moetrace.analysis.report import InspectOptions, inspect_report
from moetrace.trace.integrity import record_crc
from moetrace.trace.verify import verify_trace

NAMES = sorted(LEGACY_TRACES)


@pytest.mark.parametrize("name", NAMES)
def test_every_request_reads_back_as_written(name):
    expected = expected_requests(name)
    with open_trace(DATA / name) as trace:
        assert trace.complete and trace.num_dropped == 0
        assert trace.num_requests == len(expected)
        for position, (req, want) in enumerate(zip(trace, expected, strict=True)):
            assert req.position == position
            assert req.id == want["request_id"]
            assert req.index == want["index"]
            assert req.finish_reason == want["finish_reason"]
            assert req.num_cached_tokens == want["num_cached_tokens"]
            assert req.num_preemptions == want["num_preemptions"]
            assert req.extra == want["extra"]
            np.testing.assert_array_equal(req.prompt_token_ids, want["prompt_token_ids"])
            np.testing.assert_array_equal(req.output_token_ids, want["output_token_ids"])
            assert req.routed_experts.dtype == want["routed_experts"].dtype
            np.testing.assert_array_equal(req.routed_experts, want["routed_experts"])
            rows = trace.read_rows(req.row_start, req.row_start + req.num_rows)
            np.testing.assert_array_equal(rows, want["routed_experts"])
            tokens = trace.read_tokens(req.token_start, req.token_start + req.prompt_len)
            np.testing.assert_array_equal(tokens, want["prompt_token_ids"])
        last = expected[-1]
        by_id = trace.request(last["request_id"])
        np.testing.assert_array_equal(by_id.routed_experts, last["routed_experts"])


@pytest.mark.parametrize("name", NAMES)
def test_metadata_and_checksums_hold(name):
    fields = legacy_metadata_fields(name)
    with open_trace(DATA / name) as trace:
        md = trace.metadata
        for key in ("model", "architecture", "num_experts", "top_k", "dtype", "vocab_size"):
            assert md[key] == fields[key]
        assert md["moe_layer_indices"] == fields["moe_layer_indices"]
        assert md["engine_settings"] == fields["engine_settings"]
        assert trace.verify() == []
    with h5py.File(DATA / name, "r") as f:
        assert record_crc(f["requests"][:]) == int(f.attrs["requests_crc32"])
    result = verify_trace(DATA / name)
    assert result.status == "ok", result.problems


@pytest.mark.parametrize("name", NAMES)
def test_inspect_counts_every_row(name):
    expected = expected_requests(name)
    num_experts = LEGACY_TRACES[name][0]
    with open_trace(DATA / name) as trace:
        report = inspect_report(trace, InspectOptions(views=["summary", "load"]))
    assert report["requests"] == len(expected)
    counts = np.zeros((LEGACY_TRACES[name][1], num_experts), dtype=np.int64)
    for want in expected:
        rows = want["routed_experts"]
        for layer in range(rows.shape[1]):
            counts[layer] += np.bincount(rows[:, layer].ravel(), minlength=num_experts)
    np.testing.assert_array_equal(np.asarray(report["expert_counts"]), counts)


@pytest.mark.parametrize("name", NAMES)
def test_an_old_trace_can_be_resumed(tmp_path, name):
    from moetrace.trace.metadata import TraceMetadata
    from moetrace.trace.writer import TraceWriter

    path = tmp_path / name
    shutil.copy(DATA / name, path)
    expected = expected_requests(name)
    extra = dict(expected[0], request_id="appended", index=len(expected))
    md = TraceMetadata(**legacy_metadata_fields(name))
    writer = TraceWriter(path, md, append=True, chunk_rows=16).start()
    writer.submit(_finished(extra))
    writer.close()
    with open_trace(path) as trace:
        assert trace.num_requests == len(expected) + 1
        assert trace.verify() == []
        np.testing.assert_array_equal(
            trace.request("appended").routed_experts, expected[0]["routed_experts"]
        )
        np.testing.assert_array_equal(
            trace.request(expected[-1]["request_id"]).output_token_ids,
            expected[-1]["output_token_ids"],
        )


def _finished(fields: dict):
    from moetrace.trace.records import FinishedRequest

    return FinishedRequest(**fields)
