"""``export --format openai-batch`` read as a ``vllm run-batch`` output file is read.

The bodies are validated by the official OpenAI client's own response models,
the routed experts decoded by vLLM's rule and compared with the trace read
through plain h5py, and the text with the tokenizer's decode of the token ids.
"""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import h5py
import numpy as np
import pytest
from support.cli import moetrace

from moetrace.inputs.tokenizer import Tokenizer
from moetrace.models.demo import DEMO_DIR

BATCH = [
    {
        "custom_id": "chat-1",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8},
    },
    {
        "custom_id": "text-2",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "def f(x):", "max_tokens": 12, "n": 2, "temperature": 1.0},
    },
    {
        "custom_id": "stop-3",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"prompt": "Hello there", "max_tokens": 20, "stop": [" "]},
    },
]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, list[dict]]:
    tmp = tmp_path_factory.mktemp("openai_batch")
    (tmp / "batch.jsonl").write_text("".join(json.dumps(x) + "\n" for x in BATCH))
    proc = moetrace(
        "record", "demo", "batch.jsonl", "-o", "t.h5", "-q", "--record-weights", cwd=tmp
    )
    assert proc.returncode == 0, proc.stderr
    proc = moetrace("export", "t.h5", "--format", "openai-batch", "-o", "out.jsonl", cwd=tmp)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(x) for x in (tmp / "out.jsonl").read_text().splitlines()]
    return tmp / "t.h5", lines


def test_one_line_per_input_line_in_order_with_run_batchs_envelope(exported):
    _, lines = exported
    assert [x["custom_id"] for x in lines] == [b["custom_id"] for b in BATCH]
    for line in lines:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        assert line["response"]["status_code"] == 200 and line["response"]["request_id"]
    assert len({x["id"] for x in lines}) == len(lines)


def test_bodies_are_what_the_openai_client_reads(exported):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    _, lines = exported
    chat = ChatCompletion.model_validate(lines[0]["response"]["body"])
    assert chat.object == "chat.completion" and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content  # a pipeline's read, unchanged
    for line in lines[1:]:
        text = Completion.model_validate(line["response"]["body"])
        assert text.object == "text_completion"
    samples = lines[1]["response"]["body"]["choices"]
    assert [c["index"] for c in samples] == [0, 1]  # n=2: one line, two choices
    usage = lines[1]["response"]["body"]["usage"]
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in samples)


def test_routed_experts_decode_by_vllms_rule_to_the_stored_rows(exported):
    trace, lines = exported
    with h5py.File(trace, "r") as f:
        moe = f.attrs["moe_layer_indices"].tolist()
        hidden, top_k = int(f.attrs["num_hidden_layers"]), int(f.attrs["top_k"])
        stored = {}
        for rec in f["requests"][:]:
            r0, n = int(rec["row_start"]), int(rec["num_rows"])
            key = (rec["id"].decode(), int(rec["sample_index"]))
            stored[key] = (f["routed_experts"][r0 : r0 + n], f["routed_weights"][r0 : r0 + n])
    for line in lines:
        body = line["response"]["body"]
        prompt_ids = body.get("prompt_token_ids")
        for choice in body["choices"]:
            rows = np.load(io.BytesIO(base64.b64decode(choice["routed_experts"])))
            weights = np.load(io.BytesIO(base64.b64decode(choice["routed_weights"])))
            prompt = prompt_ids if prompt_ids is not None else choice["prompt_token_ids"]
            assert rows.shape == (len(prompt) + len(choice["token_ids"]) - 1, hidden, top_k)
            ids, gates = stored[line["custom_id"], choice["index"]]
            np.testing.assert_array_equal(rows[:, moe], ids)
            np.testing.assert_array_equal(weights[:, moe], gates)
            dense = [i for i in range(hidden) if i not in moe]
            assert (rows[:, dense] == 0).all() and dense  # the demo has a dense layer


def test_the_text_is_the_decoded_tokens_cut_at_the_stop_string(exported):
    _, lines = exported
    tokenizer = Tokenizer.from_dir(DEMO_DIR)
    for line in lines:
        for choice in line["response"]["body"]["choices"]:
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            decoded = tokenizer.decode(choice["token_ids"], skip_special_tokens=True)
            if choice["finish_reason"] == "length":
                assert text == decoded
            elif isinstance(choice["stop_reason"], str):
                assert decoded.startswith(text + choice["stop_reason"])
    stopped = lines[2]["response"]["body"]["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == " "


def test_the_format_is_refused_where_the_extension_says_otherwise(exported, tmp_path):
    trace, _ = exported
    out = tmp_path / "out.parquet"
    proc = moetrace("export", str(trace), "--format", "openai-batch", "-o", str(out))
    assert proc.returncode == 2 and "contradicts" in proc.stderr and not out.exists()
