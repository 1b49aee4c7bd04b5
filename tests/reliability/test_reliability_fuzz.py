"""Fuzz the whole intake path, not only the JSONL parser: any prompt file either
records or is refused with a one-line ``MoetraceError`` before the weights load.

tests/inputs/test_prompts.py fuzzes the parser on its own; here random files go
through ``Recording`` (parser, tokenizer and chat template of the shipped demo
model, vocabulary, context and KV checks).  ``MOETRACE_FUZZ_EXAMPLES`` raises
the example count for a long campaign (docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from support.prompt_lines import lines, near_valid

from moetrace.config import EngineConfig
from moetrace.errors import MoetraceError
from moetrace.runs.recording import Recording, SamplingDefaults
from moetrace.runs.setup import RunOptions

EXAMPLES = int(os.environ.get("MOETRACE_FUZZ_EXAMPLES", "60"))

# Lines a real model's checks care about: long prompts, big ids, odd roles and templates.
extra_lines = st.one_of(
    st.builds(
        lambda n, t: json.dumps({"prompt_token_ids": [t] * n}),
        st.integers(1, 1200),
        st.integers(0, 400),
    ),
    st.builds(
        lambda role, text, mt: json.dumps(
            {"messages": [{"role": role, "content": text}], "max_tokens": mt}
        ),
        st.sampled_from(["user", "system", "assistant", "tool", "", "x" * 50]),
        st.text(max_size=30),
        st.integers(1, 2000),
    ),
    st.text(max_size=40).map(lambda text: json.dumps({"prompt": text})),
)


def _check(raw: bytes, skip: bool, max_model_len: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "f.jsonl"
        path.write_bytes(raw)
        try:
            rec = Recording(
                RunOptions.of(
                    "demo", engine=EngineConfig(max_model_len=max_model_len), device="cpu"
                ),
                str(path),
                Path(tmp) / "t.h5",
                sampling=SamplingDefaults(max_tokens=4),
                skip_invalid=skip,
            )
        except MoetraceError as exc:
            assert "\n" not in str(exc), str(exc)
            return
        assert rec.total is not None and rec.total >= 1
        assert rec.total == rec.expected_requests


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    st.lists(lines | extra_lines | near_valid().map(json.dumps), min_size=0, max_size=8),
    st.booleans(),
    st.sampled_from([8, 64, 1024]),
)
@example(['{"\\n": null}', json.dumps({"prompt_token_ids": [0] * 5})], True, 8)  # a newline key
def test_any_prompt_file_records_or_is_refused_in_one_line(items, skip, max_model_len):
    raw = b"\n".join(
        x if isinstance(x, bytes) else x.encode("utf-8", "surrogatepass") for x in items
    )
    _check(raw, skip, max_model_len)
