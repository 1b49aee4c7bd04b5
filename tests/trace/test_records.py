"""The record schema: today's writer writes what the earlier one wrote, and the schema grows.

Format version 2 grew it by two optional arrays (gate weights, log-probabilities)
the way trace/records.py says to; the last tests check what each kind of reader
then sees.
"""

from __future__ import annotations

import dataclasses

import h5py
import numpy as np
import pytest
from support.legacy_traces import DATA, LEGACY_TRACES, expected_requests, legacy_metadata_fields

from moetrace import open_trace
from moetrace.errors import MoetraceError
from moetrace.trace import loading, records, table_frame
from moetrace.trace.integrity import plain_value, record_crc
from moetrace.trace.metadata import FORMAT_VERSION, TraceMetadata
from moetrace.trace.records import REQUEST_DTYPE, FinishedRequest, RecordDecoder
from moetrace.trace.writer import TraceWriter


def _write(path, md, reqs, **options):
    with TraceWriter(path, md, chunk_rows=16, **options) as writer:
        for req in reqs:
            writer.submit(req)


@pytest.mark.parametrize("name", sorted(LEGACY_TRACES))
def test_the_writer_still_writes_the_records_of_the_earlier_one(tmp_path, name):
    compression = LEGACY_TRACES[name][3]
    md = TraceMetadata(**legacy_metadata_fields(name))
    path = tmp_path / name
    _write(
        path, md, [FinishedRequest(**r) for r in expected_requests(name)], compression=compression
    )
    with h5py.File(DATA / name, "r") as old, h5py.File(path, "r") as new:
        assert new["requests"].dtype == REQUEST_DTYPE
        # Columns added since (at the end) hold their defaults; the earlier ones are as written.
        old_names = old["requests"].dtype.names
        assert REQUEST_DTYPE.names[: len(old_names)] == old_names
        assert new["requests"].fields(list(old_names))[:].tolist() == old["requests"][:].tolist()
        for column in records.COLUMNS[len(old_names) :]:
            values = [plain_value(v) for v in new["requests"][column.name]]
            assert values == [column.default] * len(values), column.name
        for ds in ("routed_experts", "token_ids"):
            assert new[ds].dtype == old[ds].dtype
            np.testing.assert_array_equal(new[ds][:], old[ds][:])
        for attr in ("format_version", "num_rows", "num_tokens"):
            assert new.attrs[attr] == old.attrs[attr], attr
        assert new.attrs["requests_crc32"] == record_crc(new["requests"][:])


def test_format_version_covers_every_declared_array():
    assert max(a.since for a in records.ARRAYS) <= FORMAT_VERSION
    assert [a.name for a in records.ARRAYS if a.required] == ["routed_experts", "token_ids"]


def test_a_column_missing_from_a_file_reads_as_its_default_or_is_refused():
    later = records.Column("num_spec_tokens", np.dtype("<i4"), default=0)
    columns = (*records.COLUMNS, later)
    with h5py.File(DATA / "trace_v1_uint8.h5", "r") as f:  # written before both columns
        decoder = RecordDecoder(f["requests"].dtype, columns)
        fields = decoder.fields(f["requests"][0])
    assert fields["num_spec_tokens"] == 0 and fields["request_id"] == "0"
    assert fields["sample_index"] == 0
    assert fields["finish_reason"] == "stop"
    without_index = np.dtype([(n, REQUEST_DTYPE[n]) for n in REQUEST_DTYPE.names if n != "index"])
    with pytest.raises(ValueError, match="lacks field.*index"):
        RecordDecoder(without_index)


# -- the optional arrays of format version 2: gate weights and log-probabilities -------


def _weighted(name: str, *, weights: str | None, logprobs: bool = False):
    md = TraceMetadata(**legacy_metadata_fields(name), weights_dtype=weights, logprobs=logprobs)
    rng = np.random.default_rng(3)
    reqs = []
    for r in expected_requests(name):
        extra = {}
        if weights is not None:
            extra["routed_weights"] = rng.random(r["routed_experts"].shape).astype(weights)
        if logprobs:
            extra["output_logprobs"] = -rng.random(len(r["output_token_ids"])).astype(np.float32)
        reqs.append(FinishedRequest(**r, **extra))
    return md, reqs


@pytest.mark.parametrize("weights", ["float16", "float32"])
def test_optional_arrays_round_trip_and_are_checksummed(tmp_path, weights):
    md, reqs = _weighted("trace_v1_uint8.h5", weights=weights, logprobs=True)
    path = tmp_path / "weighted.h5"
    _write(path, md, reqs)
    with open_trace(path) as trace:
        assert trace.metadata["format_version"] == 2
        for got, want in zip(trace, reqs, strict=True):
            np.testing.assert_array_equal(got.routed_weights, want.routed_weights)
            assert got.routed_weights.dtype == np.dtype(weights)
            np.testing.assert_array_equal(got.output_logprobs, want.output_logprobs)
            np.testing.assert_array_equal(got.routed_experts, want.routed_experts)
        assert trace.verify() == []
    with h5py.File(path, "r") as f:  # laid out as token_ids: NaN for every prompt token
        rec = f["requests"][0]
        t0, p = int(rec["token_start"]), int(rec["prompt_len"])
        assert np.isnan(f["logprobs"][t0 : t0 + p]).all()
    for name, where in (("routed_weights", (5, 0, 0)), ("logprobs", (-1,))):
        damaged = tmp_path / f"damaged-{name}.h5"
        damaged.write_bytes(path.read_bytes())
        with h5py.File(damaged, "r+") as f:
            f[name][where] += 1  # one value changed: its request's checksum fails
        with open_trace(damaged) as trace:
            problems = trace.verify()
        assert len(problems) == 1 and "checksum mismatch" in problems[0], name


def test_without_the_arrays_a_trace_stays_version_1(tmp_path):
    md, reqs = _weighted("trace_v1_uint8.h5", weights=None)
    path = tmp_path / "plain.h5"
    _write(path, md, reqs)
    with h5py.File(path, "r") as new, h5py.File(DATA / "trace_v1_uint8.h5", "r") as old:
        assert "routed_weights" not in new and "logprobs" not in new
        assert new.attrs["format_version"] == 1
        names = list(old["requests"].dtype.names)
        assert new["requests"].fields(names)[:].tolist() == old["requests"][:].tolist()
    with open_trace(DATA / "trace_v1_uint8.h5") as trace:
        assert all(req.routed_weights is None and req.output_logprobs is None for req in trace)
        assert trace.verify() == []
    with pytest.raises(ValueError, match="routed_weights is none"):
        _write(tmp_path / "mixed.h5", _weighted("trace_v1_uint8.h5", weights="float16")[0], reqs)
    md_lp, _ = _weighted("trace_v1_uint8.h5", weights=None, logprobs=True)
    with pytest.raises(ValueError, match="logprobs is none"):
        _write(tmp_path / "mixed-lp.h5", md_lp, reqs)


def test_a_reader_that_predates_the_arrays_refuses_the_file(tmp_path, monkeypatch):
    md, reqs = _weighted("trace_v1_uint8.h5", weights="float16")
    path = tmp_path / "weighted.h5"
    _write(path, md, reqs)
    monkeypatch.setattr(loading, "FORMAT_VERSION", 1)
    with pytest.raises(MoetraceError, match="format version 2 is newer"):
        open_trace(path)


def test_appending_refuses_other_optional_arrays(tmp_path):
    md, reqs = _weighted("trace_v1_uint8.h5", weights="float16")
    path = tmp_path / "weighted.h5"
    _write(path, md, reqs[:3])
    for other in (
        dataclasses.replace(md, weights_dtype="float32"),
        dataclasses.replace(md, weights_dtype=None),
        dataclasses.replace(md, logprobs=True),
    ):
        with pytest.raises(MoetraceError, match="cannot append"):
            TraceWriter(path, other, append=True).start()
    writer = TraceWriter(path, md, append=True).start()
    for req in reqs[3:]:
        writer.submit(req)
    writer.close()
    with open_trace(path) as trace:
        assert trace.verify() == [] and trace.num_requests == len(reqs)
        np.testing.assert_array_equal(trace.request(-1).routed_weights, reqs[-1].routed_weights)


def test_weights_dtype_is_checked():
    with pytest.raises(ValueError, match="weights_dtype"):
        _weighted("trace_v1_uint8.h5", weights="bfloat16")


def test_samples_of_one_prompt_round_trip_and_an_older_table_refuses_them(tmp_path):
    name = "trace_v1_uint8.h5"
    md = TraceMetadata(**legacy_metadata_fields(name))
    first = expected_requests(name)[0]
    samples = [FinishedRequest(**{**first, "sample_index": i}) for i in range(3)]
    _write(tmp_path / "n3.h5", md, samples)
    with open_trace(tmp_path / "n3.h5") as trace:
        assert [(r.id, r.sample_index) for r in trace] == [
            (first["request_id"], i) for i in range(3)
        ]
        assert trace.verify() == []
    old = tmp_path / name
    old.write_bytes((DATA / name).read_bytes())
    writer = TraceWriter(old, md, append=True).start()
    writer.submit(dataclasses.replace(samples[0], request_id="more"))  # sample 0: the default
    with pytest.raises(MoetraceError, match="sample_index 1: the trace was written before"):
        writer.submit(dataclasses.replace(samples[1], request_id="more"))
    writer.close()
    with open_trace(old) as trace:
        assert trace.request_ids[-1] == "more" and trace.verify() == []


def test_a_declared_column_reaches_to_pandas_without_an_edit_there(monkeypatch):
    """Trace.to_pandas lists the table from the schema: a column added later is one edit."""
    pytest.importorskip("pandas")
    later = records.Column("num_spec_tokens", np.dtype("<i4"), default=0)
    monkeypatch.setattr(table_frame, "COLUMNS", (*records.COLUMNS, later))
    with open_trace(DATA / "trace_v1_uint8.h5") as t:  # written before the column
        table = t.to_pandas()
        assert table["num_spec_tokens"].tolist() == [0] * t.num_requests
        assert "checksum" not in table.columns
        declared = [c.name for c in records.COLUMNS if c.kind != records.PLACED]
        assert set(table.columns) == {*declared, "row_start", "token_start", "num_spec_tokens"}


def test_stop_reasons_and_sampling_settings_round_trip_and_an_older_table_leaves_them_out(
    tmp_path,
):
    name = "trace_v1_uint8.h5"
    md = TraceMetadata(**legacy_metadata_fields(name))
    first = expected_requests(name)[0]
    reasons = [None, 151645, "\n\n", "42"]  # none (EOS, length), a stop token, stop strings
    reqs = [
        FinishedRequest(
            **{**first, "request_id": f"r{i}"},
            stop_reason=reason,
            sampling_params={"temperature": 0.5 * i, "stop": ["\n\n", "42"], "seed": 2**63 - 1},
        )
        for i, reason in enumerate(reasons)
    ]
    _write(tmp_path / "new.h5", md, reqs)
    with open_trace(tmp_path / "new.h5") as trace:
        assert [r.stop_reason for r in trace] == reasons
        assert [r.sampling_params for r in trace] == [r.sampling_params for r in reqs]
        assert trace.verify() == []
    with h5py.File(tmp_path / "new.h5", "r") as f:  # JSON text, as trace-format.md says
        stored = [plain_value(v) for v in f["requests"]["stop_reason"]]
        assert stored == ["", "151645", '"\\n\\n"', '"42"']
    old = tmp_path / name
    old.write_bytes((DATA / name).read_bytes())
    writer = TraceWriter(old, md, append=True).start()
    writer.submit(reqs[2])  # how it ran is left out, where the earlier records lack it too
    writer.close()
    with open_trace(old) as trace:
        appended = trace.request("r2")
        assert appended.stop_reason is None and appended.sampling_params == {}
        np.testing.assert_array_equal(appended.routed_experts, reqs[2].routed_experts)
        assert trace.verify() == []
