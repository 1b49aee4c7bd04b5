"""export's files as other tools read them (pandas, pyarrow, datasets; no moetrace), and
where export writes: '-' is standard output, binary never on a terminal, no file lost.

The expected arrays come from the trace through plain h5py.
"""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.cli import moetrace

from moetrace.output_files import replacing

PROMPTS = [
    {"id": "a", "prompt": "Hello experts"},
    {"id": "b", "prompt": "def f(x):", "max_tokens": 5},
    {"id": "c", "prompt_token_ids": [72, 101, 108]},
]


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("export")
    (tmp / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    proc = moetrace("record", "demo", "p.jsonl", "-o", "t.h5", "-q", "--max-tokens", "7", cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    return tmp / "t.h5"


def stored(trace: Path) -> dict:
    """Each request's rows, tokens and the layer indices, read with h5py alone."""
    with h5py.File(trace, "r") as f:
        out = {}
        for rec in f["requests"][:]:
            r0, n = int(rec["row_start"]), int(rec["num_rows"])
            t0, p, o = int(rec["token_start"]), int(rec["prompt_len"]), int(rec["output_len"])
            tokens = f["token_ids"][t0 : t0 + p + o]
            out[rec["id"].decode()] = (f["routed_experts"][r0 : r0 + n], tokens[:p], tokens[p:])
        return {
            "requests": out,
            "moe_layers": f.attrs["moe_layer_indices"].tolist(),
            "hidden_layers": int(f.attrs["num_hidden_layers"]),
        }


READ_WITHOUT_MOETRACE = """
import json, sys
import numpy as np, pandas as pd, pyarrow.parquet as pq
df = pd.read_parquet(sys.argv[1])
meta = json.loads(pq.read_schema(sys.argv[1]).metadata[b"moetrace"])
out = {"meta": meta, "rows": {}}
for _, r in df.iterrows():
    rows = np.array([np.stack(layer) for layer in r["routed_experts"]]).reshape(
        r["num_rows"], len(meta["layer_indices"]), meta["top_k"])
    out["rows"][r["id"]] = [rows.tolist(), list(map(int, r["prompt_token_ids"])),
                            list(map(int, r["output_token_ids"])), str(rows.dtype)]
print(json.dumps(out))
"""


@pytest.mark.parametrize("layout", ["moe", "vllm"])
def test_parquet_reads_back_in_pandas_without_moetrace(trace, tmp_path, layout):
    out = tmp_path / f"{layout}.parquet"
    proc = moetrace("export", str(trace), "-f", "parquet", "--layout", layout, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    read = subprocess.run(
        [sys.executable, "-I", "-c", READ_WITHOUT_MOETRACE, str(out)],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert read.returncode == 0, read.stderr
    got = json.loads(read.stdout)
    want = stored(trace)
    layers = want["moe_layers"] if layout == "moe" else list(range(want["hidden_layers"]))
    assert got["meta"]["layer_indices"] == layers and got["meta"]["layout"] == layout
    for rid, (rows, prompt, output) in want["requests"].items():
        g_rows, g_prompt, g_output, dtype = got["rows"][rid]
        assert (g_prompt, g_output) == (prompt.tolist(), output.tolist())
        assert dtype == str(rows.dtype)
        full = np.asarray(g_rows)
        np.testing.assert_array_equal(full[:, [layers.index(m) for m in want["moe_layers"]]], rows)
        dense = [i for i, layer in enumerate(layers) if layer not in want["moe_layers"]]
        assert (full[:, dense] == 0).all() and (len(dense) > 0) == (layout == "vllm")


def test_parquet_loads_as_a_hugging_face_dataset(trace, tmp_path):
    datasets = pytest.importorskip("datasets")
    out = tmp_path / "t.parquet"
    assert moetrace("export", str(trace), "-f", "parquet", "-o", str(out)).returncode == 0
    ds = datasets.Dataset.from_parquet(str(out), cache_dir=str(tmp_path / "cache"))
    want = stored(trace)["requests"]
    assert sorted(ds["id"]) == sorted(want)
    for row in ds:
        np.testing.assert_array_equal(np.asarray(row["routed_experts"]), want[row["id"]][0])


def test_vllm_layout_in_jsonl_and_npz(trace, tmp_path):
    want = stored(trace)
    proc = moetrace("export", str(trace), "--layout", "vllm")
    line = json.loads(proc.stdout.splitlines()[0])
    assert line["shape"][1] == want["hidden_layers"]
    out = tmp_path / "v.npz"
    assert (
        moetrace("export", str(trace), "-f", "npz", "--layout", "vllm", "-o", str(out)).returncode
        == 0
    )
    z = np.load(out)
    assert z["routed_experts"].shape[1:] == (want["hidden_layers"], 2)
    assert z["layer_indices"].tolist() == list(range(want["hidden_layers"]))


def test_dash_is_standard_output_and_binary_goes_only_to_a_pipe(trace):
    cwd = trace.parent
    proc = moetrace("export", "t.h5", "-o", "-", cwd=cwd)
    assert proc.returncode == 0 and not (cwd / "-").exists()
    assert sorted(json.loads(x)["id"] for x in proc.stdout.splitlines()) == ["a", "b", "c"]
    piped = subprocess.run(
        [str(Path(sys.executable).parent / "moetrace"), "export", "t.h5", "-f", "npz"],
        capture_output=True, cwd=cwd, check=False,
    )  # fmt: skip
    assert piped.returncode == 0 and piped.stdout[:2] == b"PK"  # a zip, on the pipe
    leader, follower = pty.openpty()
    try:
        tty = moetrace("export", "t.h5", "-f", "parquet", cwd=cwd, stdout=follower)
    finally:
        os.close(follower)
        os.close(leader)
    assert tty.returncode == 1
    assert tty.stderr.splitlines() == [
        "error: --format parquet is binary: redirect standard output to a file, or give -o FILE"
    ]


def test_every_command_says_the_same_about_an_existing_output(trace, tmp_path):
    existing = tmp_path / "out.h5"
    existing.write_bytes(b"keep me")
    (tmp_path / "p.jsonl").write_text(json.dumps(PROMPTS[0]) + "\n")
    said = {
        "record": moetrace("record", "demo", str(tmp_path / "p.jsonl"), "-o", str(existing)),
        "export": moetrace("export", str(trace), "-o", str(existing)),
        "merge": moetrace("merge", str(existing), str(trace)),
        "import": moetrace(
            "import", str(tmp_path / "p.jsonl"), "-o", str(existing), "--model", "demo"
        ),
    }
    rule = f"error: {existing} already exists (pass --overwrite to replace it"
    for command, proc in said.items():
        assert proc.returncode == 1, command
        assert proc.stderr.startswith(rule), (command, proc.stderr)
    assert said["record"].stderr.strip().endswith("or --resume to continue it)")
    assert existing.read_bytes() == b"keep me"


def test_a_failed_import_over_a_trace_leaves_that_trace(trace, tmp_path):
    """--overwrite replaces OUTPUT with the import, never with nothing."""
    old = tmp_path / "old.h5"
    old.write_bytes(trace.read_bytes())
    (tmp_path / "bad.jsonl").write_text('{"bogus": 1}\n')
    (tmp_path / "blank.jsonl").write_text("\n")
    for responses in ("bad.jsonl", "blank.jsonl"):
        proc = moetrace("import", responses, "-o", "old.h5", "--model", "demo", "--overwrite",
                        cwd=tmp_path)  # fmt: skip
        assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert old.read_bytes() == trace.read_bytes(), responses
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "blank.jsonl", "old.h5"]
    exported = moetrace("export", str(trace), "-o", "good.jsonl", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    proc = moetrace("import", "good.jsonl", "-o", "old.h5", "--model", "demo", "--overwrite",
                    cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert old.read_bytes() != trace.read_bytes()  # replaced, by a trace of the same requests
    again = moetrace("export", "old.h5", cwd=tmp_path)
    assert sorted(json.loads(x)["id"] for x in again.stdout.splitlines()) == ["a", "b", "c"]


def test_a_failed_write_leaves_the_old_file(tmp_path):
    old = tmp_path / "t.npz"
    old.write_bytes(b"old")
    with pytest.raises(RuntimeError), replacing(old) as temporary:
        temporary.write_bytes(b"half")
        raise RuntimeError("disk trouble")
    assert old.read_bytes() == b"old" and list(tmp_path.iterdir()) == [old]
    with replacing(old) as temporary:
        temporary.write_bytes(b"new")
    assert old.read_bytes() == b"new" and list(tmp_path.iterdir()) == [old]


# -- every per-token field the trace holds, in every format ----------------------------


@pytest.fixture(scope="module")
def full_trace(tmp_path_factory) -> Path:
    """Gate weights, log-probabilities and a stop string: every field a trace can hold."""
    tmp = tmp_path_factory.mktemp("export_full")
    lines = [*PROMPTS, {"id": "s", "prompt": "Hello there", "max_tokens": 20, "stop": [" "]}]
    (tmp / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in lines))
    proc = moetrace(
        "record", "demo", "p.jsonl", "-o", "t.h5", "-q", "--max-tokens", "7",
        "--record-weights", "--logprobs", cwd=tmp,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return tmp / "t.h5"


def stored_fields(trace: Path) -> dict:
    """Per request id: weights, output log-probabilities and stop reason, read with h5py alone."""
    with h5py.File(trace, "r") as f:
        out = {}
        for rec in f["requests"][:]:
            r0, n = int(rec["row_start"]), int(rec["num_rows"])
            t0, p, o = int(rec["token_start"]), int(rec["prompt_len"]), int(rec["output_len"])
            out[rec["id"].decode()] = {
                "routed_weights": f["routed_weights"][r0 : r0 + n],
                "token_logprobs": f["logprobs"][t0 + p : t0 + p + o],
                "stop_reason": json.loads(rec["stop_reason"] or b"null"),
            }
        return out


def _npy(text: str) -> np.ndarray:
    import base64
    import io

    return np.load(io.BytesIO(base64.b64decode(text)))


def test_every_format_carries_weights_logprobs_and_stop_reasons(full_trace, tmp_path):
    want = stored_fields(full_trace)
    assert want["s"]["stop_reason"] == " "  # the stop string ended it
    lines = moetrace("export", str(full_trace)).stdout.splitlines()
    for line in map(json.loads, lines):
        w = want[line["id"]]
        np.testing.assert_array_equal(_npy(line["routed_weights"]), w["routed_weights"])
        assert line["token_logprobs"] == w["token_logprobs"].tolist()
        assert line["stop_reason"] == w["stop_reason"]
        assert line["sampling_params"]["max_tokens"] in (5, 7, 20)

    assert moetrace("export", str(full_trace), "-o", str(tmp_path / "t.npz")).returncode == 0
    z = np.load(tmp_path / "t.npz")
    for i, rid in enumerate(z["ids"].tolist()):
        rows = slice(z["row_offsets"][i], z["row_offsets"][i + 1])
        outs = slice(z["output_offsets"][i], z["output_offsets"][i + 1])
        np.testing.assert_array_equal(z["routed_weights"][rows], want[rid]["routed_weights"])
        np.testing.assert_array_equal(z["token_logprobs"][outs], want[rid]["token_logprobs"])
        reason = z["stop_reasons"][i]
        assert (json.loads(reason) if reason else None) == want[rid]["stop_reason"]

    pd = pytest.importorskip("pandas")
    assert moetrace("export", str(full_trace), "-o", str(tmp_path / "t.parquet")).returncode == 0
    for _, row in pd.read_parquet(tmp_path / "t.parquet").iterrows():
        w = want[row["id"]]
        weights = np.array([np.stack(layer) for layer in row["routed_weights"]])
        np.testing.assert_array_equal(weights, w["routed_weights"])
        np.testing.assert_array_equal(row["token_logprobs"], w["token_logprobs"])
        reason = row["stop_reason"]
        assert (json.loads(reason) if isinstance(reason, str) else None) == w["stop_reason"]

    for array, key in (("routed_weights", "routed_weights"), ("token_logprobs", "token_logprobs")):
        out = tmp_path / f"{array}.npy"
        proc = moetrace("export", str(full_trace), "-r", "s", "--array", array, "-o", str(out))
        assert proc.returncode == 0, proc.stderr
        np.testing.assert_array_equal(np.load(out), want["s"][key])


def test_an_array_the_trace_lacks_is_refused_by_name(trace, tmp_path):
    out = tmp_path / "w.npy"
    proc = moetrace("export", str(trace), "-r", "a", "--array", "routed_weights", "-o", str(out))
    assert proc.returncode == 1 and not out.exists()
    assert proc.stderr.splitlines() == [
        f"error: {trace} holds no routed_weights (record with --record-weights); it holds "
        "routed_experts"
    ]
    proc = moetrace("export", str(trace), "--array", "token_logprobs")  # JSON Lines: all of them
    assert proc.returncode == 2 and "--format npy" in proc.stderr


def test_inspect_names_the_arrays_a_trace_holds(trace, full_trace):
    plain = json.loads(moetrace("inspect", str(trace), "--json").stdout)["arrays"]
    full = json.loads(moetrace("inspect", str(full_trace), "--json").stdout)["arrays"]
    assert plain == {"routed_experts": "uint8", "token_ids": "int32"}
    assert full == {**plain, "routed_weights": "float16", "logprobs": "float32"}
    shown = " ".join(moetrace("inspect", str(full_trace)).stdout.split())
    assert "routed_weights: float16, logprobs: float32" in shown
