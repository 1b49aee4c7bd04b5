"""``import`` never stores routing it had to guess, and never truncates floats into ids.

SGLang's flat buffer leaves the layer axis to the reader; a DeepSeek-V2-Lite
shape (27 layers, 26 routing) at prompt 10 + output 17 fits both readings,
and the MoE-only one (wrong) was taken with a "dropped trailing row" note.
"""

from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
from support.reliability import assert_one_line_error, run_cli

from moetrace import open_trace

# DeepSeek-V2-Lite's routing shape: 27 decoder layers, layer 0 dense, 64 experts, top-6.
SHAPE = ("--num-layers", "27", "--moe-layers", "1-26", "--num-experts", "64", "--top-k", "6")
PROMPT, OUTPUT = list(range(1, 11)), list(range(100, 117))  # 10 + 17 tokens: 26 rows


def _routing(rows: int, seed: int = 0) -> np.ndarray:
    """Every hidden layer's ids, as engines return them: dense layer 0 left at zero."""
    rng = np.random.default_rng(seed)
    out = np.zeros((rows, 27, 6), dtype=np.int32)
    out[:, 1:] = np.argsort(rng.random((rows, 26, 64)), axis=-1)[..., :6]
    return out


def _sglang(routing: np.ndarray, prompt=PROMPT, output=OUTPUT) -> dict:
    return {
        "input_ids": prompt,
        "output_ids": output,
        "meta_info": {
            "id": "r1",
            "finish_reason": {"type": "length"},
            "routed_experts": base64.b64encode(routing.astype("<i4").tobytes()).decode(),
        },
    }


def _vllm(routed) -> dict:
    return {
        "id": "c1",
        "prompt_token_ids": PROMPT,
        "choices": [
            {"index": 0, "finish_reason": "length", "token_ids": OUTPUT, "routed_experts": routed}
        ],
    }


def _npy_b64(array: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, array)
    return base64.b64encode(buf.getvalue()).decode()


def _import(tmp_path, value: dict, *extra: str) -> tuple[int, str]:
    src = tmp_path / "r.json"
    src.write_text(json.dumps(value))
    code, _, err = run_cli("import", str(src), "-o", str(tmp_path / "t.h5"), *SHAPE, *extra)
    return code, err


def test_a_flat_buffer_both_layouts_fit_is_refused_not_guessed(tmp_path):
    routing = _routing(26)
    code, err = _import(tmp_path, _sglang(routing))
    assert_one_line_error(code, err, "both fit", "--layout vllm", "--layout moe")
    assert not (tmp_path / "t.h5").exists()
    code, err = _import(tmp_path, _sglang(routing), "--layout", "vllm")
    assert code == 0, err
    with open_trace(tmp_path / "t.h5") as t:
        np.testing.assert_array_equal(t.request("r1").routed_experts, routing[:, 1:])


def test_a_row_count_that_fits_neither_layout_names_both(tmp_path):
    """One row short: the message counted rows in the wrong reading ("72 rows (expected 55)")."""
    code, err = _import(tmp_path, _sglang(_routing(25)))
    assert_one_line_error(
        code,
        err,
        "25 rows of 27 layers (every hidden layer)",
        "no whole number of rows of 26 layers",
        "27 tokens need 26 rows",
    )


@pytest.mark.parametrize("encode", ["npy", "lists"])
def test_float_routing_is_refused_not_truncated_into_ids(tmp_path, encode):
    routing = _routing(26).astype(np.float64) + 0.7  # 6.7 would become expert 6
    routed = _npy_b64(routing) if encode == "npy" else routing.tolist()
    code, err = _import(tmp_path, _vllm(routed))
    assert_one_line_error(code, err, "float64 values, not integer expert ids")
    assert not (tmp_path / "t.h5").exists()
