"""vLLM's sampling features, each checked against its definition or against transformers.

The unit tests hold the sampler's pieces to the formulas vLLM and OpenAI
document (written out here in numpy) or to transformers' own logits
processors; the engine tests run the trained demo checkpoint and compare with
``transformers.generate`` on the same weights in float64.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import transformers
from support.engine import CPU, run_requests, shared_prefix_prompts, tiny_model
from support.hf_reference import load_reference_model

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine, RequestRejected
from moetrace.engine.sampler import Penalties, SamplingBatch, sample, token_logprobs
from moetrace.engine.sampling import SamplingParams
from moetrace.engine.stop_strings import StopStringMatcher, find_stop
from moetrace.inputs.tokenizer import Tokenizer
from moetrace.models.demo import DEMO_DIR
from moetrace.models.loader import load_model


def greedy_batch(n: int, **extra) -> SamplingBatch:
    zeros = torch.zeros(n)
    ids = torch.zeros(n, dtype=torch.int64)
    return SamplingBatch(zeros, ids, zeros, ids, ids, True, False, False, **extra)


# -- the sampler's pieces --------------------------------------------------------------


def test_penalties_follow_the_openai_and_vllm_definitions():
    rng = np.random.default_rng(0)
    rows, vocab, slots = 5, 40, 7
    logits = rng.normal(0, 3, (rows, vocab)).astype(np.float32)
    counts = rng.integers(0, 3, (slots, vocab)).astype(np.int32) * (
        rng.random((slots, vocab)) < 0.3
    )
    prompt = rng.random((slots, vocab)) < 0.2
    pen_rows, pen_slots = np.array([0, 2, 3]), np.array([6, 1, 4])
    presence = np.array([0.5, -1.0, 0.0], np.float32)
    frequency = np.array([0.3, 0.0, -0.7], np.float32)
    repetition = np.array([1.3, 0.8, 1.0], np.float32)
    pen = Penalties(
        torch.tensor(pen_rows), torch.tensor(pen_slots), torch.tensor(presence),
        torch.tensor(frequency), torch.tensor(repetition),
        torch.tensor(counts), torch.tensor(prompt),
    )  # fmt: skip
    got = pen.apply(torch.tensor(logits)).numpy()

    want = logits.astype(np.float64).copy()
    for j, (row, slot) in enumerate(zip(pen_rows, pen_slots, strict=True)):
        c = counts[slot]
        seen = (c > 0) | prompt[slot]
        x = want[row]
        x[seen] = np.where(x[seen] > 0, x[seen] / repetition[j], x[seen] * repetition[j])
        x -= frequency[j] * c + presence[j] * (c > 0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    untouched = [1, 4]
    np.testing.assert_array_equal(got[untouched], logits[untouched])

    # transformers' repetition penalty: the same rule over the prompt and output tokens.
    row, slot = 0, 6
    ids = np.flatnonzero((counts[slot] > 0) | prompt[slot])
    only_rep = Penalties(
        torch.tensor([row]), torch.tensor([slot]), torch.zeros(1), torch.zeros(1),
        torch.tensor([1.3]), torch.tensor(counts), torch.tensor(prompt),
    )  # fmt: skip
    hf = transformers.RepetitionPenaltyLogitsProcessor(1.3)(
        torch.tensor(ids)[None], torch.tensor(logits[row : row + 1])
    )
    torch.testing.assert_close(only_rep.apply(torch.tensor(logits))[row], hf[0])


def test_penalties_count_the_sampled_tokens_on_the_device():
    counts = torch.zeros((3, 10), dtype=torch.int32)
    pen = Penalties(
        torch.tensor([1]), torch.tensor([2]), torch.zeros(1), torch.ones(1), torch.ones(1),
        counts, torch.zeros((3, 10), dtype=torch.bool),
    )  # fmt: skip
    logits = torch.zeros((2, 10))
    logits[:, 4] = 5.0
    assert sample(logits, greedy_batch(2, penalties=pen)).tolist() == [4, 4]
    assert counts[2, 4] == 1 and counts.sum() == 1  # only the penalized row counts
    for _ in range(4):  # frequency 1 per occurrence: after 5 in all the 5-logit lead is gone
        sample(logits, greedy_batch(2, penalties=pen))
    assert sample(logits, greedy_batch(2, penalties=pen)).tolist() == [4, 0]


def test_banned_tokens_and_min_p():
    logits = torch.tensor([[0.0, 4.0, 3.0, 1.0], [0.0, 4.0, 3.0, 1.0]])
    banned = (torch.tensor([0]), torch.tensor([1]))
    assert sample(logits, greedy_batch(2, banned=banned)).tolist() == [2, 1]
    # min_p 0.3 keeps tokens with p >= 0.3 * max p: softmax [.013, .70, .26, .035] keeps 1, 2.
    n = 3000
    batch = SamplingBatch(
        torch.ones(n), torch.zeros(n, dtype=torch.int64), torch.ones(n),
        torch.arange(n), torch.zeros(n, dtype=torch.int64), False, False, False,
        min_p=torch.full((n,), 0.3),
    )  # fmt: skip
    picks = sample(logits[:1].repeat(n, 1), batch)
    assert set(picks.tolist()) == {1, 2}
    p = torch.softmax(torch.tensor([4.0, 3.0]), 0)
    assert abs((picks == 1).float().mean().item() - p[0].item()) < 0.03


def test_logprobs_are_the_raw_distribution_with_vllm_ranks():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0], [0.5, 0.1, 0.2, 0.9]], dtype=torch.float64)
    out = token_logprobs(logits, torch.tensor([2, 3]), 2)
    ref = torch.log_softmax(logits, dim=-1).numpy()
    np.testing.assert_allclose(out.token_logprob.numpy(), [ref[0, 2], ref[1, 3]])
    assert out.token_rank.tolist() == [3, 1]  # ties count: two tokens at 3.0 precede token 2
    assert set(out.top_ids[0].tolist()) == {1, 3} and out.top_ids[1].tolist() == [3, 0]
    np.testing.assert_allclose(out.top_logprobs[1].numpy(), ref[1, [3, 0]])
    assert token_logprobs(logits, torch.tensor([2, 3]), 0).top_ids.shape == (2, 0)


def test_stop_string_search_is_vllms():
    # A match must end in the new characters; the first stop string in the list wins.
    assert find_stop("hello world", 5, ["lo w", "rld"], False) == ("lo w", 3)
    assert find_stop("hello world", 2, ["lo w", "rld"], False) == ("rld", 8)
    assert find_stop("hello world", 2, ["rld"], True) == ("rld", 11)
    assert find_stop("hello world", 0, ["rld"], False) is None

    pieces = {1: "ab", 2: "c\nd", 3: "ef", 9: "<eos>"}
    matcher = StopStringMatcher(pieces.__getitem__, ["\n"], min_tokens=0)
    assert matcher.update(1, ends_request=False) is None
    assert matcher.update(2, ends_request=False) == "\n"
    assert matcher.text == "abc"  # cut mid-token, before the stop string
    matcher = StopStringMatcher(pieces.__getitem__, ["\n"], include_stop_str_in_output=True)
    matcher.update(1, ends_request=False)
    assert matcher.update(2, ends_request=False) == "\n" and matcher.text == "abc\n"
    # The first min_tokens tokens' characters are never searched.
    matcher = StopStringMatcher(pieces.__getitem__, ["b", "e"], min_tokens=1)
    assert matcher.update(1, ends_request=False) is None
    assert matcher.update(2, ends_request=False) is None
    assert matcher.update(3, ends_request=False) == "e" and matcher.text == "abc\nd"
    # A stop token ends the request: not decoded, not searched.
    matcher = StopStringMatcher(pieces.__getitem__, ["e"])
    assert matcher.update(9, ends_request=True) is None and matcher.text == ""


@pytest.mark.parametrize(
    ("params", "problem"),
    [
        (dict(min_tokens=20, max_tokens=10), "min_tokens (20) must be <= max_tokens (10)"),
        (dict(presence_penalty=2.5), "presence_penalty: expected a number in [-2, 2], got 2.5"),
        (dict(repetition_penalty=0.0), "repetition_penalty: expected a finite number > 0, got 0.0"),
        (dict(n=0), "n: expected a positive integer (at most 2147483647), got 0"),
        (dict(logprobs=21), "logprobs: expected an integer from 0 to 20, got 21"),
        (dict(stop=[""]), "stop strings must not be empty"),
    ],
)
def test_settings_vllm_refuses_are_refused(params, problem):
    with pytest.raises(ValueError, match=re.escape(problem)):
        SamplingParams(**params)


# -- the engine on the demo checkpoint, against transformers --------------------------


@pytest.fixture(scope="module")
def demo():
    loaded = load_model(str(DEMO_DIR), device=CPU, dtype="float64")
    return loaded.model, Tokenizer.from_dir(DEMO_DIR)


@pytest.fixture(scope="module")
def reference():
    return load_reference_model(DEMO_DIR, dtype=torch.float64)


def demo_run(demo, prompts: dict[str, list[int]], params: SamplingParams, **engine) -> dict:
    model, tokenizer = demo
    config = EngineConfig(**{"num_kv_blocks": 128, "block_size": 16, **engine})
    eng = LLMEngine(model, config, CPU, eos_token_ids=(257,), tokenizer=tokenizer)
    for i, (rid, ids) in enumerate(prompts.items()):
        eng.add_request(rid, ids, params, index=i)
    done = {}
    for f in eng.run():
        done[f.request_id if params.n == 1 else (f.request_id, f.sample_index)] = f
    eng.block_manager.check_no_leaks()
    return done


class OpenAIPenalties(transformers.LogitsProcessor):
    """frequency and presence penalties as OpenAI defines them, over the generated tokens."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len :]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.frequency * counts - self.presence * (counts > 0)


def hf_generate(reference, prompt: list[int], max_new: int, processors=(), **gen) -> list[int]:
    config = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=max_new, pad_token_id=0, **{"eos_token_id": None, **gen}
    )
    reference.generation_config = config
    ids = torch.tensor([prompt])
    out = reference.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        generation_config=config,
        logits_processor=transformers.LogitsProcessorList(list(processors)),
    )
    return out[0, len(prompt) :].tolist()


PROMPT = "def fibonacci(n):\n    "


def test_penalties_and_min_tokens_generate_what_transformers_does(demo, reference):
    _, tokenizer = demo
    prompt = tokenizer.encode(PROMPT)
    params = SamplingParams(
        max_tokens=24, repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.4
    )
    got = demo_run(demo, {"p": prompt}, params)["p"].output_token_ids.tolist()
    want = hf_generate(
        reference, prompt, 24, [OpenAIPenalties(len(prompt), 0.6, 0.4)], repetition_penalty=1.4
    )
    assert got == want
    plain = demo_run(demo, {"p": prompt}, SamplingParams(max_tokens=24))["p"]
    assert plain.output_token_ids.tolist() != got  # the penalties changed something

    # min_tokens: no stop token before it (transformers' min_new_tokens, its eos our stop id).
    short = tokenizer.encode("Hi")
    space = tokenizer.encode(" ")[0]
    free = demo_run(demo, {"s": short}, SamplingParams(max_tokens=40, stop_token_ids=[space]))
    assert free["s"].finish_reason == "stop" and free["s"].output_len < 5
    params = SamplingParams(max_tokens=40, stop_token_ids=[space], min_tokens=5, ignore_eos=True)
    held = demo_run(demo, {"s": short}, params)["s"]
    want = hf_generate(reference, short, 40, min_new_tokens=5, eos_token_id=space)
    assert held.output_token_ids.tolist() == want[: want.index(space) + 1]
    assert held.finish_reason == "stop" and held.stop_reason == space and held.output_len > 5


def test_stop_strings_end_where_the_text_first_holds_one(demo):
    _, tokenizer = demo
    prompt = tokenizer.encode(PROMPT)
    base = demo_run(demo, {"p": prompt}, SamplingParams(max_tokens=40, ignore_eos=True))["p"]
    tokens = base.output_token_ids.tolist()
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    stop = text[5:7]  # two characters the greedy output holds
    # The reference: the shortest output whose text holds the stop string ending past the
    # text of the first min_tokens tokens (vLLM lets a match start there, not end there).
    for min_tokens in (0, 4):
        before = len(tokenizer.decode(tokens[:min_tokens]))
        cut = next(
            i
            for i in range(min_tokens + 1, len(tokens) + 1)
            if tokenizer.decode(tokens[:i]).find(stop, max(0, before - len(stop) + 1)) >= 0
        )
        for include in (False, True):
            params = SamplingParams(
                max_tokens=40, ignore_eos=True, stop=["zzz", stop], min_tokens=min_tokens,
                include_stop_str_in_output=include,
            )  # fmt: skip
            got = demo_run(demo, {"p": prompt}, params, async_scheduling=True)["p"]
            assert got.output_token_ids.tolist() == tokens[:cut]
            assert got.finish_reason == "stop" and got.stop_reason == stop
            decoded = tokenizer.decode(tokens[:cut])
            end = decoded.find(stop, max(0, before - len(stop) + 1)) + (len(stop) if include else 0)
            assert got.output_text == decoded[:end]


def test_stop_strings_need_a_tokenizer():
    engine = LLMEngine(tiny_model(), EngineConfig(num_kv_blocks=16), CPU)
    with pytest.raises(RequestRejected, match="stop strings need the model's tokenizer"):
        engine.add_request("a", [1, 2], SamplingParams(stop=["x"]))


def test_logprobs_equal_transformers_teacher_forced(demo, reference):
    _, tokenizer = demo
    prompt = tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=5, logprobs=3)
    got = demo_run(demo, {"p": prompt}, params)["p"]
    out = got.output_token_ids.tolist()
    with torch.no_grad():
        logits = reference(torch.tensor([prompt + out])).logits[0].double()
    ref = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)  # predicts each output token
    lp = got.logprobs
    np.testing.assert_allclose(lp.token_logprob, ref[torch.arange(len(out)), out], atol=1e-5)
    ranks = (ref >= ref[torch.arange(len(out)), out][:, None]).sum(-1)
    assert lp.token_rank.tolist() == ranks.tolist()
    np.testing.assert_allclose(lp.top_logprobs, ref.topk(3).values, atol=1e-5)
    assert lp.top_ids.shape == (12, 3) and lp.top_ids.dtype == np.int32


def test_n_samples_are_samples_with_seed_plus_index(demo):
    _, tokenizer = demo
    prompt = tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=40, n=3)
    samples = demo_run(demo, {"p": prompt}, params)
    assert sorted(samples) == [("p", 0), ("p", 1), ("p", 2)]
    outputs = []
    for i in range(3):
        alone = demo_run(demo, {"p": prompt}, SamplingParams(max_tokens=10, temperature=1.0,
                                                              seed=40 + i))["p"]  # fmt: skip
        assert samples[("p", i)].output_token_ids.tolist() == alone.output_token_ids.tolist()
        outputs.append(tuple(alone.output_token_ids.tolist()))
    assert len(set(outputs)) == 3
    # A resumed run asks for the missing samples only; they are the same samples.
    model, tok = demo
    eng = LLMEngine(model, EngineConfig(num_kv_blocks=64, block_size=16), CPU, tokenizer=tok)
    eng.add_request("p", prompt, params, samples=[2])
    (only,) = list(eng.run())
    assert only.sample_index == 2 and tuple(only.output_token_ids.tolist()) == outputs[2]


def test_n_without_seed_samples_differ_and_abort_takes_every_sample(demo):
    model, tokenizer = demo
    eng = LLMEngine(model, EngineConfig(num_kv_blocks=64, block_size=16), CPU, tokenizer=tokenizer)
    eng.add_request(
        "p", tokenizer.encode(PROMPT), SamplingParams(max_tokens=30, temperature=1.0, n=4)
    )
    with pytest.raises(RequestRejected, match="duplicate request id 'p'"):
        eng.add_request("p", [1], SamplingParams())
    eng.step()
    aborted = eng.abort(["p"])
    assert sorted(f.sample_index for f in aborted) == [0, 1, 2, 3]
    assert {f.request_id for f in aborted} == {"p"} and not eng.has_unfinished()


PENALIZED = dict(
    temperature=0.8, top_p=0.9, min_p=0.05, seed=3, repetition_penalty=1.2,
    frequency_penalty=0.5, presence_penalty=0.3, min_tokens=3, logprobs=2,
)  # fmt: skip


@pytest.mark.parametrize(
    "engine",
    [
        dict(max_num_seqs=64, max_num_batched_tokens=2048),
        dict(async_scheduling=True, max_num_seqs=4, max_num_batched_tokens=16),
        dict(async_scheduling=True, num_kv_blocks=12, max_num_seqs=8, enable_prefix_caching=True),
    ],
)
def test_penalized_sampling_is_batch_invariant(engine):
    """A request samples the same tokens alone or batched, asynchronously, preempted."""
    model = tiny_model(torch.float64)
    prompts = shared_prefix_prompts(seed=5, count=10)
    alone = {
        rid: run_requests(model, {rid: ids}, max_tokens=8, sampling=PENALIZED)[0][rid]
        for rid, ids in prompts.items()
    }
    done, eng = run_requests(model, prompts, max_tokens=8, sampling=PENALIZED, **engine)
    eng.block_manager.check_no_leaks()
    for rid, ref in alone.items():
        np.testing.assert_array_equal(done[rid].output_token_ids, ref.output_token_ids)
        np.testing.assert_array_equal(done[rid].logprobs.top_ids, ref.logprobs.top_ids)
        np.testing.assert_allclose(done[rid].logprobs.token_logprob, ref.logprobs.token_logprob)
