"""export decodes with plain numpy + base64; import reads what vLLM and SGLang send."""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from support.analysis import LAYERS, planted_requests, write_trace
from typer.testing import CliRunner

from moetrace import open_trace
from moetrace.analysis.diff import diff_traces
from moetrace.cli.app import app

SHAPE_ARGS = ["--num-layers", "6", "--moe-layers", "1-3,5", "--num-experts", "16", "--top-k", "4"]


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    reqs = planted_requests()
    return reqs, write_trace(tmp_path_factory.mktemp("export") / "t.h5", reqs)


def invoke(*args: str):
    res = CliRunner().invoke(app, [str(a) for a in args])
    return res


# -- export -------------------------------------------------------------------------------


def test_jsonl_decodes_with_plain_numpy(planted):
    reqs, path = planted
    res = invoke("export", path)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert len(lines) == len(reqs)
    with open_trace(path) as trace:
        for line, req in zip(lines, reqs, strict=True):
            obj = json.loads(line)
            arr = np.load(io.BytesIO(base64.b64decode(obj["routed_experts"])))
            stored = trace.request(obj["id"])
            np.testing.assert_array_equal(arr, stored.routed_experts)
            np.testing.assert_array_equal(arr, req.routed_experts)
            assert arr.dtype == np.uint8 and obj["dtype"] == "uint8"
            assert obj["shape"] == list(arr.shape) == [req.num_rows, 4, 4]
            assert obj["prompt_token_ids"] == req.prompt_token_ids.tolist()
            assert obj["output_token_ids"] == req.output_token_ids.tolist()
            assert (obj["index"], obj["finish_reason"]) == (req.index, req.finish_reason)


def test_jsonl_selection_and_dtype(planted, tmp_path):
    reqs, path = planted
    out = tmp_path / "sel.jsonl"
    res = invoke("export", path, "-r", "r3", "--range", "5:7", "--dtype", "int32", "-o", out)
    assert res.exit_code == 0, res.output
    objs = [json.loads(x) for x in out.read_text().splitlines()]
    assert [o["id"] for o in objs] == ["r3", "r5", "r6"]
    for o in objs:
        arr = np.load(io.BytesIO(base64.b64decode(o["routed_experts"])))
        assert arr.dtype == np.int32 and o["dtype"] == "int32"
        np.testing.assert_array_equal(arr, reqs[int(o["id"][1:])].routed_experts)


def test_npz_is_csr_of_the_selection(planted, tmp_path):
    reqs, path = planted
    out = tmp_path / "t.npz"
    res = invoke("export", path, "--format", "npz", "-o", out, "--range", "1:")
    assert res.exit_code == 0, res.output
    with np.load(out) as z:
        ro, to, pl = z["row_offsets"], z["token_offsets"], z["prompt_lens"]
        assert z["ids"].tolist() == [r.request_id for r in reqs[1:]]
        assert z["moe_layer_indices"].tolist() == LAYERS
        for i, req in enumerate(reqs[1:]):
            np.testing.assert_array_equal(
                z["routed_experts"][ro[i] : ro[i + 1]], req.routed_experts
            )
            tokens = z["token_ids"][to[i] : to[i + 1]]
            assert tokens[: pl[i]].tolist() == req.prompt_token_ids.tolist()
            assert tokens[pl[i] :].tolist() == req.output_token_ids.tolist()
            assert z["finish_reasons"][i] == req.finish_reason
        assert ro[-1] == z["routed_experts"].shape[0]


def test_npy_is_one_request(planted, tmp_path):
    reqs, path = planted
    out = tmp_path / "r1.npy"
    assert invoke("export", path, "-f", "npy", "-r", "r1", "-o", out).exit_code == 0
    np.testing.assert_array_equal(np.load(out), reqs[1].routed_experts)
    res = invoke("export", path, "-f", "npy", "-o", tmp_path / "x.npy")
    assert res.exit_code != 0 and "holds one array" in str(res.exception)
    res = invoke("export", path, "-f", "npz")  # no -o, not a terminal: the zip on stdout
    assert res.exit_code == 0 and res.stdout_bytes[:2] == b"PK"


# -- engine responses, built the way each engine encodes them ------------------------------


def npy_b64(a: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, a)
    return base64.b64encode(buf.getvalue()).decode()


def full_layers(rows: np.ndarray, dtype=np.int32) -> np.ndarray:
    """The engines' layer axis: every decoder layer, dense ones left at zero."""
    out = np.zeros((rows.shape[0], 6, rows.shape[2]), dtype=dtype)
    out[:, LAYERS] = rows
    return out


def vllm_chat(req, dtype=np.int32) -> dict:
    return {
        "id": f"chatcmpl-{req.request_id}",
        "object": "chat.completion",
        "prompt_token_ids": req.prompt_token_ids.tolist(),
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "..."},
                "finish_reason": req.finish_reason,
                "token_ids": req.output_token_ids.tolist(),
                "routed_experts": npy_b64(full_layers(req.routed_experts, dtype)),
            }
        ],
        "usage": {"prompt_tokens": req.prompt_len, "completion_tokens": req.output_len},
    }


def sglang_generate(req) -> dict:
    flat = full_layers(req.routed_experts).astype("<i4").tobytes()
    return {
        "text": "...",
        "input_ids": req.prompt_token_ids.tolist(),
        "output_ids": req.output_token_ids.tolist(),
        "meta_info": {
            "id": req.request_id,
            "finish_reason": {"type": req.finish_reason},
            "prompt_tokens": req.prompt_len,
            "completion_tokens": req.output_len,
            "routed_experts": base64.b64encode(flat).decode(),
        },
    }


def normal(reqs):
    return [r for r in reqs if r.finish_reason != "abort"]


def test_vllm_batch_output_imports_and_agrees(planted, tmp_path):
    reqs, path = planted
    src = tmp_path / "vllm.jsonl"
    lines = [
        {"id": "batch_x", "custom_id": r.request_id, "response": {"body": vllm_chat(r)}}
        for r in normal(reqs)
    ]
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "vllm.h5"
    res = invoke("import", src, "-o", out, *SHAPE_ARGS)
    assert res.exit_code == 0, res.output
    with open_trace(out) as v, open_trace(path) as m:
        assert v.metadata["moe_layer_indices"] == LAYERS
        d = diff_traces(v, m)
        assert d["identical"] is False  # the two aborted requests are only in m
        assert d["requests"]["only_in_b"] == 2 and d["tokens_with_difference"] == 0
        assert d["rows_excluded"] == 0 and d["mean_jaccard"] == 1.0
        assert v.request("r1").extra["engine"] == "vllm"


def test_sglang_list_and_vllm_completions(planted, tmp_path):
    reqs, path = planted
    sg = tmp_path / "sg.json"
    sg.write_text(json.dumps([sglang_generate(r) for r in normal(reqs)], indent=2))
    completions = tmp_path / "cmpl.jsonl"
    lines = []
    for r in normal(reqs):
        body = vllm_chat(r, np.uint8)
        choice = body["choices"][0]
        choice["prompt_token_ids"] = body.pop("prompt_token_ids")
        # MoE layers only on the layer axis: taken as they are
        choice["routed_experts"] = npy_b64(r.routed_experts)
        body["id"] = r.request_id
        lines.append(json.dumps(body))
    completions.write_text("\n".join(lines) + "\n")
    for src in (sg, completions):
        out = tmp_path / f"{src.stem}.h5"
        res = invoke("import", src, "-o", out, *SHAPE_ARGS)
        assert res.exit_code == 0, res.output
        with open_trace(out) as a, open_trace(path) as m:
            d = diff_traces(a, m)
            assert d["tokens_with_difference"] == 0 and d["requests"]["only_in_a"] == 0
            assert d["tokens"] == sum(r.num_rows for r in normal(reqs))


def test_a_response_of_n_choices_is_n_samples_of_one_request(planted, tmp_path):
    """As ``record`` and ``serve`` write a prompt sampled n > 1 times: one id, sample 0 .. n-1."""
    reqs, _ = planted
    first, second = normal(reqs)[:2]
    choices = []
    for i, r in enumerate((first, second)):
        choice = vllm_chat(r)["choices"][0]
        choices.append({**choice, "index": i, "prompt_token_ids": r.prompt_token_ids.tolist()})
    src = tmp_path / "n2.json"
    src.write_text(json.dumps({"id": "cmpl-q", "choices": choices, "usage": {}}))
    out = tmp_path / "n2.h5"
    res = invoke("import", src, "-o", out, *SHAPE_ARGS)
    assert res.exit_code == 0, res.output
    with open_trace(out) as t:
        got = sorted(t, key=lambda r: r.sample_index)
        assert [(r.id, r.sample_index) for r in got] == [("cmpl-q", 0), ("cmpl-q", 1)]
        for imported, planted_req in zip(got, (first, second), strict=True):
            np.testing.assert_array_equal(imported.routed_experts, planted_req.routed_experts)
    assert invoke("verify", out).exit_code == 0


def test_split_prompt_and_output_rows_with_a_trailing_row(planted, tmp_path):
    """vLLM's earlier form: prompt rows on the response, output rows per choice, as lists."""
    reqs, path = planted
    r = reqs[1]
    rows = np.concatenate([r.routed_experts, r.routed_experts[-1:]])  # one row per token
    body = vllm_chat(r)
    body["prompt_routed_experts"] = rows[: r.prompt_len].tolist()
    body["choices"][0]["routed_experts"] = rows[r.prompt_len :].tolist()
    body["id"] = "r1"
    src = tmp_path / "split.json"
    src.write_text(json.dumps(body))
    out = tmp_path / "split.h5"
    res = invoke("import", src, "-o", out, *SHAPE_ARGS)
    assert res.exit_code == 0, res.output
    with open_trace(out) as t:
        got = t.request("r1")
        np.testing.assert_array_equal(got.routed_experts, r.routed_experts)
        assert got.extra["trimmed_rows"] == 1


def test_export_then_import_round_trips(planted, tmp_path):
    reqs, path = planted
    res = invoke("export", path)
    src = tmp_path / "e.jsonl"
    src.write_text(res.stdout)
    out = tmp_path / "back.h5"
    res = invoke("import", src, "-o", out, *SHAPE_ARGS)
    assert res.exit_code == 0, res.output
    with open_trace(out) as a, open_trace(path) as m:
        assert diff_traces(a, m)["identical"] is True


def test_import_refuses_what_it_cannot_use(planted, tmp_path):
    reqs, _ = planted
    r = reqs[0]
    cases = {
        "no_routing": ({**vllm_chat(r), "choices": [{"index": 0, "token_ids": [1]}]}, "no routed_experts"),
        "wrong_k": (
            {**vllm_chat(r), "choices": [{**vllm_chat(r)["choices"][0], "routed_experts": npy_b64(np.zeros((7, 6, 2), np.int32))}]},
            "shape",
        ),
        "out_of_range": (
            {**vllm_chat(r), "choices": [{**vllm_chat(r)["choices"][0], "routed_experts": npy_b64(np.full((7, 6, 4), 16, np.int32))}]},
            "expert id 16",
        ),
        "prompt_skipped": (
            {**vllm_chat(r), "choices": [{**vllm_chat(r)["choices"][0], "routed_experts": npy_b64(np.zeros((3, 6, 4), np.int32))}]},
            "routed_experts_prompt_start",
        ),
        "not_a_response": ({"hello": 1}, "not a vLLM response"),
    }  # fmt: skip
    for name, (body, needle) in cases.items():
        src = tmp_path / f"{name}.json"
        src.write_text(json.dumps(body))
        out = tmp_path / f"{name}.h5"
        res = invoke("import", src, "-o", out, *SHAPE_ARGS)
        assert res.exit_code != 0, name
        assert needle in str(res.exception), (name, res.exception)
        assert not out.exists()  # all or nothing
    res = invoke("import", tmp_path / "no_routing.json", "-o", tmp_path / "x.h5")
    assert "--num-layers" in str(res.exception)  # no model, no shape


def test_missing_token_ids_become_placeholders(planted, tmp_path):
    reqs, path = planted
    body = vllm_chat(reqs[1])
    body["id"] = "r1"
    del body["prompt_token_ids"]
    src = tmp_path / "notok.json"
    src.write_text(json.dumps(body))
    res = invoke("import", src, "-o", tmp_path / "n.h5", *SHAPE_ARGS)
    assert res.exit_code != 0 and "return_token_ids" in str(res.exception)
    res = invoke("import", src, "-o", tmp_path / "n.h5", *SHAPE_ARGS, "--allow-missing-tokens")
    assert res.exit_code == 0, res.output
    with open_trace(tmp_path / "n.h5") as a, open_trace(path) as m:
        got = a.request("r1")
        assert (got.prompt_token_ids == -1).all() and got.extra["token_ids_unknown"]
        d = diff_traces(a, m)
        assert d["tokens_with_difference"] == 0 and "unknown token ids" in d["warnings"][-1]


def test_model_shape_from_configs(tmp_path):
    from moetrace.analysis.importers import config_digest, model_shape
    from moetrace.models.demo import DEMO_CONFIG
    from moetrace.models.source import config_digest as loader_digest

    demo = model_shape("demo")
    assert demo.moe_layer_indices == [1, 2, 3]  # layer 0 of the demo is dense
    assert demo.top_k == DEMO_CONFIG["num_experts_per_tok"]
    assert demo.num_experts == DEMO_CONFIG.get("num_experts", DEMO_CONFIG.get("num_local_experts"))
    assert demo.config_digest == loader_digest(DEMO_CONFIG) == config_digest(DEMO_CONFIG)
    ds = {"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 8}
    ds.update(first_k_dense_replace=3, n_routed_experts=64, num_experts_per_tok=6)
    (tmp_path / "config.json").write_text(json.dumps(ds))
    (tmp_path / "tokenizer.json").write_text("{}")
    s = model_shape(str(tmp_path))
    assert s.moe_layer_indices == [3, 4, 5, 6, 7] and (s.num_experts, s.top_k) == (64, 6)
    assert s.tokenizer == str(tmp_path / "tokenizer.json")
    assert s.architecture == "DeepseekV3ForCausalLM"
