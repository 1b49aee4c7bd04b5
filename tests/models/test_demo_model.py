"""The shipped ``demo`` checkpoint: loads in transformers and moetrace, agrees, and has learned.

The texts below were written for these tests, so they are held out from the
demo's training corpus (the Python standard library's own files).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from support.engine import CPU, run_requests
from support.hf_reference import capture_router_calls, load_reference_model, reference_greedy

from moetrace.inputs.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, ByteTokenizer
from moetrace.models.demo import DEMO_CONFIG, DEMO_DIR, model_dir
from moetrace.models.loader import load_model
from moetrace.models.source import resolve_model
from moetrace.runs.setup import load_tokenizer

CODE = '''def merge_intervals(pairs):
    """Join overlapping (start, end) pairs; the result is sorted by start."""
    merged = []
    for start, end in sorted(pairs):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


class Counter:
    def __init__(self, limit=10):
        self.count = 0
        self.limit = limit

    def tick(self):
        if self.count >= self.limit:
            raise ValueError("limit reached")
        self.count += 1
        return self.count
'''

PROSE = """A trace records, for every token, which experts the router picked in each
layer. Reading one is like reading a ledger: most entries are routine, but the
patterns show where the model spends its effort. Letters, digits and spaces
tend to travel through different experts, and a model that has learned
something about its text will show that clearly, while random weights will not.
In 1998 the team measured 42 runs over 365 days, at 3.5 seconds per run.
"""


def _ids(text: str) -> list[int]:
    return ByteTokenizer().encode(text)


@pytest.fixture(scope="module")
def demo32():
    return load_model("demo", device=CPU)


def test_demo_is_a_directory_in_the_package():
    assert model_dir("demo") == DEMO_DIR
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (DEMO_DIR / name).is_file(), name
    size = sum(p.stat().st_size for p in DEMO_DIR.iterdir())
    assert size < 12 * 2**20  # "a few MB": it ships in the wheel
    assert DEMO_CONFIG["architectures"] == ["Qwen3MoeForCausalLM"]
    assert (DEMO_CONFIG["bos_token_id"], DEMO_CONFIG["eos_token_id"]) == (BYTE_BOS_ID, BYTE_EOS_ID)


def test_loads_in_transformers_without_missing_or_extra_weights():
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(DEMO_DIR), dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(DEMO_DIR))
    text = "def f(x):\n    return x + 1  # naïve <|eos|>"
    assert hf_tok(text)["input_ids"] == ByteTokenizer().encode(text)


def test_loads_in_moetrace(demo32):
    model = demo32.model
    assert demo32.source.name == "demo" and demo32.path == DEMO_DIR
    assert demo32.dtype == torch.float32
    assert model.moe_layer_indices == [1, 2, 3]  # layer 0 is dense
    assert (model.num_experts, model.top_k, model.vocab_size) == (16, 2, 260)
    tok = load_tokenizer(resolve_model("demo"))
    assert tok is not None and tok.encode(CODE) == _ids(CODE)
    assert tok.eos_token_ids == [BYTE_EOS_ID]


def _near_tie(probs: np.ndarray, k: int, tol: float) -> bool:
    top = np.sort(probs)[::-1]
    return bool(top[k - 1] - top[k] < tol)


@pytest.mark.parametrize("text", [CODE, PROSE], ids=["code", "prose"])
def test_routing_matches_transformers(demo32, text):
    """float32 on both sides; a differing row is allowed only where the k-th and
    (k+1)-th router probabilities are within float32 noise of each other."""
    ids = [BYTE_BOS_ID, *_ids(text)]
    done, _ = run_requests(demo32.model, {"t": ids}, max_tokens=1, num_kv_blocks=512)
    ours = done["t"].routed_experts.astype(np.int64)
    assert ours.shape == (len(ids), 3, 2)
    reference = load_reference_model(DEMO_DIR)
    calls = capture_router_calls(reference, ids)
    assert [c.layer_idx for c in calls] == [1, 2, 3]
    mismatched = 0
    for layer, call in enumerate(calls):
        probs = torch.softmax(call.logits.double(), dim=-1).numpy()
        theirs = call.indices.numpy()
        for t in np.nonzero((ours[:, layer] != theirs).any(axis=1))[0]:
            assert _near_tie(probs[t], 2, 1e-4), (layer, int(t), ours[t, layer], theirs[t])
            mismatched += 1
    assert mismatched <= 2


def test_greedy_continuation_matches_transformers():
    """float64 on both sides, so that no near-tie between logits can decide the outcome."""
    prompt = [BYTE_BOS_ID, *_ids("def tick(self):\n    self.count")]
    model = load_model("demo", device=CPU, dtype="float64").model
    done, _ = run_requests(
        model, {"g": prompt}, max_tokens=24, sampling={"ignore_eos": True}, num_kv_blocks=64
    )
    ours = done["g"].output_token_ids.tolist()
    assert ours == reference_greedy(DEMO_DIR, prompt, 24, dtype=torch.float64)


@torch.no_grad()
def test_demo_has_learned_to_predict_bytes():
    """Random weights score about ln(260) = 5.56 nats per byte."""
    model = load_reference_model(DEMO_DIR)
    for text in (CODE, PROSE):
        ids = torch.tensor([[BYTE_BOS_ID, *_ids(text)]])
        logits = model(input_ids=ids).logits[0, :-1]
        loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
        assert loss < 2.6, float(loss)


def _byte_class(b: int) -> int:
    c = chr(b) if b < 128 else ""
    if c.islower():
        return 0
    if c.isupper():
        return 1
    if c.isdigit():
        return 2
    if c in " \t":
        return 3
    if c == "\n":
        return 4
    return 5 if c and c.isprintable() else 6


def _uncertainty_coefficient(joint: np.ndarray) -> float:
    """I(class; expert) / H(class) from a (classes, experts) count table."""
    p = joint / joint.sum()
    pc, pe = p.sum(1, keepdims=True), p.sum(0, keepdims=True)
    nz = p > 0
    mi = (p[nz] * np.log(p[nz] / (pc @ pe)[nz])).sum()
    return float(mi / -(pc[pc > 0] * np.log(pc[pc > 0])).sum())


def test_experts_prefer_byte_classes(demo32):
    """The chosen experts say a lot about the byte being routed (the old random demo: 0.12)."""
    prompts = {"code": _ids(CODE), "prose": _ids(PROSE)}
    done, _ = run_requests(demo32.model, prompts, max_tokens=1, num_kv_blocks=512)
    classes = np.concatenate([[_byte_class(b) for b in prompts[k]] for k in prompts])
    rows = np.concatenate([done[k].routed_experts for k in prompts]).astype(np.int64)
    scores = []
    for layer in range(rows.shape[1]):
        joint = np.zeros((7, 16))
        for slot in range(rows.shape[2]):
            np.add.at(joint, (classes, rows[:, layer, slot]), 1)
        scores.append(_uncertainty_coefficient(joint))
    assert max(scores) > 0.25, scores
    loads = np.bincount(rows[:, 0].ravel(), minlength=16)
    assert (loads > 0).sum() >= 12  # specialised, not collapsed onto a few experts
