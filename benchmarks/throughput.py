"""Output tokens/s of moetrace (capture on and off) and transformers, side by side on one GPU.

Same random prompts for every engine, greedy, EOS ignored so every request
generates exactly its output length.  Weights are random (``dummy``) in the
shapes of real checkpoints (``benchmarks/configs/*.json``).  ``--workload``
picks uniform lengths (the default: ``--prompt-len`` -> ``--output-len``),
mixed or long-tail ones (``benchmarks/workloads.py``); transformers runs on
the uniform workload only (its batch APIs take one output length).

    python benchmarks/throughput.py --config qwen3-30b-a3b --config olmoe-1b-7b
    python benchmarks/throughput.py --workload mixed --num-prompts 2048 --hf ''

Prints a table and writes the figures as JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from moetrace.config import EngineConfig
from moetrace.engine.llm_engine import LLMEngine
from moetrace.engine.model_runner import ModelRunner
from moetrace.engine.sampling import SamplingParams
from moetrace.models.loader import load_model

sys.path.insert(0, str(Path(__file__).parent))
import workloads  # noqa: E402

CONFIGS = Path(__file__).parent / "configs"
# Per model type, transformers' fastest path that works: its generate_batch paged cache does
# not fit MLA's head sizes (DeepSeek), so plain generate with SDPA attention there.
HF_PATHS = {"deepseek_v2": ("generate",), "deepseek_v3": ("generate",)}
HF_ATTENTION = {"deepseek_v2": "sdpa", "deepseek_v3": "sdpa"}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def device() -> torch.device:
    """CUDA for real figures; the CPU only to smoke-test this script on a tiny config."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def hbm_bandwidth(device: torch.device, nbytes: int = 4 << 30) -> float:
    """Device-to-device copy rate, bytes read plus written per second."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        dst.copy_(src)
    end.record()
    end.synchronize()
    return 2 * src.numel() * 2 * 10 / (start.elapsed_time(end) / 1e3)


def make_engine(
    model, capture: bool, args, num_blocks: int, kv_donor: LLMEngine | None = None
) -> LLMEngine:
    """An engine on ``model``; with ``kv_donor``, on that engine's KV cache.

    The capture-on and capture-off engines run one after the other, each
    draining its batch, and a slot is read only after its own run wrote it, so
    one cache serves both: a second 10 GB cache is what pushed Qwen3-30B-A3B
    past an 80 GB card.
    """
    config = EngineConfig(
        capture_routing=capture,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=num_blocks,
        enable_prefix_caching=False,
        enforce_eager=args.enforce_eager,
        max_cudagraph_capture_size=args.max_cudagraph_capture_size,
    )
    if kv_donor is None:
        return LLMEngine(model, config, device())
    shared = kv_donor.runner.kv_caches

    def reuse(runner: ModelRunner, num_blocks: int) -> None:
        runner.kv_caches = shared

    with mock.patch.object(ModelRunner, "_allocate_kv_cache", reuse):
        return LLMEngine(model, config, device())


def run_batch(engine: LLMEngine, prompts: list[list[int]], output_lens: list[int]) -> dict:
    sync()
    start = time.perf_counter()
    for i, (ids, n) in enumerate(zip(prompts, output_lens, strict=True)):
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=n, ignore_eos=True), index=i)
    finished = []
    marks = [time.perf_counter()]
    while engine.has_unfinished():
        finished += engine.step()
        marks.append(time.perf_counter())
    sync()
    elapsed = time.perf_counter() - start
    out_tokens = sum(f.output_len for f in finished)
    assert out_tokens == sum(output_lens)
    return {
        "seconds": elapsed,
        "output_tokens": out_tokens,
        "tok_s": out_tokens / elapsed,
        **phases(np.diff(marks), sum(map(len, prompts)), engine.config),
    }


def phases(step_s: np.ndarray, prompt_tokens: int, config: EngineConfig) -> dict:
    """Where a run's wall time goes: the prefill steps, a decode step, the last step.

    Each ``step()`` launches one step and completes the one before, so the
    first ``prefills + 1`` calls cover the prefill, and the last call only
    completes (it holds the finishing work of every request that ends there).
    """
    prefills = -(-prompt_tokens // config.max_num_batched_tokens) + 1
    decode = step_s[prefills:-1]
    return {
        "prefill_phase_s": float(step_s[:prefills].sum()),
        "decode_step_ms": float(np.median(decode) * 1e3) if decode.size else float("nan"),
        "decode_phase_s": float(decode.sum()),
        "last_step_ms": float(step_s[-1] * 1e3),
    }


def decode_step_profile(engine: LLMEngine, model, batch: int, last_plans: dict) -> dict:
    """Device time of one graph-replayed decode step at ``batch``, and the bytes it must read."""
    graphs = engine.runner.graphs
    plan = last_plans.get(batch)
    if graphs is None or batch not in graphs.graphs or plan is None or not plan.decode_only:
        return {}
    engine.runner.bind()
    # The last decode step, as it ran (in the decode-only graph where one was captured).
    graph = graphs.stage_graph(workloads.with_known_tokens(plan), batch)
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        graph.replay()
    end.record()
    end.synchronize()
    step_s = start.elapsed_time(end) / 1e3 / 20
    touched = 0
    item = next(model.parameters()).element_size()
    routed = engine.runner.capturer.buffer[:batch].cpu().numpy() if engine.runner.capturer else None
    for name, param in model.named_parameters():
        if ".experts." in name:  # counted per routed expert below
            continue
        if "embed_tokens" in name:
            touched += batch * param.shape[1] * param.element_size()
            continue
        touched += param.nbytes
    for block in model.moe_blocks():
        # One expert's share of every expert tensor (weights, MXFP4 scales, biases).
        per_expert = sum(p[0].nbytes for p in block.experts.parameters())
        used = (
            len(np.unique(routed[:, block.moe_index]))
            if routed is not None
            else block.experts.num_experts
        )
        touched += used * per_expert
    seq_lens = graphs.buffers[batch].seq_lens[:batch].cpu().numpy().astype(np.int64)
    kv_bytes = 0
    for layer in model.attention_layers():  # a sliding-window layer reads its window only
        window = getattr(layer, "sliding_window", None)
        tokens = np.minimum(seq_lens, window).sum() if window else seq_lens.sum()
        per_token = sum(math.prod(s) for s in layer.kv_cache_shapes(1, 1)) * item
        kv_bytes += int(tokens) * per_token
    return {"step_ms": step_s * 1e3, "weight_bytes": touched, "kv_bytes": kv_bytes}


def bench_moetrace(name: str, config: dict, prompts, output_lens, args, results: dict) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(config))
        dtype = "bfloat16" if device().type == "cuda" else "float32"
        loaded = load_model(tmp, device=device(), dtype=dtype, load_format="dummy")
    model = loaded.model
    tokens_per_seq = max(len(p) + n for p, n in zip(prompts, output_lens, strict=True))
    num_blocks = args.max_num_seqs * -(-tokens_per_seq // 16) + 64
    t0 = time.perf_counter()
    engines = {"capture": make_engine(model, True, args, num_blocks)}
    engines["no-capture"] = make_engine(model, False, args, num_blocks, engines["capture"])
    last_plans = {
        mode: workloads.keep_last_plans(e.runner.graphs) if e.runner.graphs else {}
        for mode, e in engines.items()
    }
    setup_s = time.perf_counter() - t0
    # Warm up on the measured batch's shapes: Triton compiles a kernel per tile
    # config on first use, and the prefill and mixed steps use configs the decode
    # graphs (compiled at capture) do not.  A first run in a fresh process pays
    # this once (Triton then caches it on disk); reported apart as warmup_s.
    warm_s = {}
    for mode, engine in engines.items():
        warm = [args.warmup_tokens] * len(prompts)
        warm_s[mode] = run_batch(engine, prompts, warm)["seconds"]
    runs: dict[str, list[float]] = {"capture": [], "no-capture": []}
    breakdowns: dict[str, list[dict]] = {"capture": [], "no-capture": []}
    for repeat in range(args.repeats):
        order = list(engines.items())
        for mode, engine in order if repeat % 2 == 0 else order[::-1]:  # neither always first
            run = run_batch(engine, prompts, output_lens)
            runs[mode].append(run["tok_s"])
            breakdowns[mode].append({k: v for k, v in run.items() if k != "tok_s"})
            print(
                f"[{name}] moetrace {mode}: {run['tok_s']:,.0f} tok/s (prefill "
                f"{run['prefill_phase_s']:.3f} s, decode {run['decode_phase_s']:.3f} s at "
                f"{run['decode_step_ms']:.2f} ms/step, last step {run['last_step_ms']:.1f} ms)",
                flush=True,
            )
    results["moetrace"] = {
        m: {"runs": r, "median": statistics.median(r), "breakdown": breakdowns[m]}
        for m, r in runs.items()
    }
    results["engine_setup_s"] = setup_s
    results["warmup_s"] = warm_s
    batch = min(args.max_num_seqs, len(prompts))
    results["decode_profile"] = decode_step_profile(
        engines["capture"], model, batch, last_plans["capture"]
    )
    # The same graph replay without capture: the device-side cost of capture, alone.
    results["decode_profile_no_capture"] = decode_step_profile(
        engines["no-capture"], model, batch, last_plans["no-capture"]
    )
    on, off = results["decode_profile"], results["decode_profile_no_capture"]
    if on and off:
        print(
            f"[{name}] decode graph replay at B={batch}: capture {on['step_ms']:.3f} ms, "
            f"no capture {off['step_ms']:.3f} ms",
            flush=True,
        )
    del engines, model, loaded
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_transformers(name: str, config: dict, prompts, args, results: dict) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    # transformers dequantizes MXFP4 experts to bf16 on a GPU without its MXFP4 kernels package;
    # DeepSeek-V3's FP8 config does not apply to dummy bf16 weights.
    skip = ("architectures", "quantization_config")
    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k not in skip})
    dtype = torch.bfloat16 if device().type == "cuda" else torch.float32
    kind = config.get("model_type")
    with device():
        model = AutoModelForCausalLM.from_config(
            hf_config, dtype=dtype, attn_implementation=HF_ATTENTION.get(kind)
        ).eval()
    paths = [p for p in args.hf if p in HF_PATHS.get(kind, args.hf)]
    gen = GenerationConfig(
        max_new_tokens=args.output_len, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    if "generate_batch" in paths:
        # Warm up first (kernel compilation, its graph capture), as moetrace's engines are.
        model.generate_batch(inputs=prompts[:8], generation_config=gen)
        sync()
        start = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=gen)
        sync()
        elapsed = time.perf_counter() - start
        produced = sum(len(o.generated_tokens) for o in out.values())
        results["hf_generate_batch"] = {
            "seconds": elapsed,
            "output_tokens": produced,
            "tok_s": produced / elapsed,
        }
        print(f"[{name}] transformers generate_batch: {produced / elapsed:,.0f} tok/s", flush=True)
    if "generate" in paths:
        subset = prompts[: args.hf_generate_prompts]
        total, elapsed = 0, 0.0
        for lo in range(0, len(subset), args.hf_generate_batch):
            ids = torch.tensor(subset[lo : lo + args.hf_generate_batch], device=device())
            sync()
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
            sync()
            elapsed += time.perf_counter() - start
            total += (out.shape[1] - ids.shape[1]) * ids.shape[0]
        results["hf_generate"] = {
            "seconds": elapsed,
            "output_tokens": total,
            "tok_s": total / elapsed,
            "prompts": len(subset),
            "batch": args.hf_generate_batch,
        }
        print(f"[{name}] transformers generate: {total / elapsed:,.0f} tok/s", flush=True)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--config", action="append", help="name under benchmarks/configs (repeatable)"
    )
    workloads.add_workload_arguments(parser, num_prompts=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--warmup-tokens",
        type=int,
        default=2,
        help="output tokens of each engine's unmeasured warm-up run over all prompts",
    )
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--max-cudagraph-capture-size", type=int, default=2048)
    parser.add_argument(
        "--hf", default="generate_batch,generate", help="transformers paths to run ('' for none)"
    )
    parser.add_argument(
        "--hf-generate-prompts", type=int, default=64, help="prompts for plain generate"
    )
    parser.add_argument("--hf-generate-batch", type=int, default=64)
    parser.add_argument(
        "--num-hidden-layers",
        type=int,
        default=None,
        help="build every config with this many layers (a model that does not fit one GPU)",
    )
    parser.add_argument(
        "--dense-experts",
        action="store_true",
        help="drop a config's quantization_config: experts in the model dtype, as a "
        "dequantized checkpoint (e.g. gpt-oss in bf16) has them",
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.hf = [x for x in args.hf.split(",") if x]
    names = args.config or ["olmoe-1b-7b", "qwen3-30b-a3b"]
    import transformers

    env = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (smoke test)",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "hbm_bytes_per_s": hbm_bandwidth(device()) if torch.cuda.is_available() else float("nan"),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
    }
    print(
        f"# {env['gpu']}, torch {env['torch']}, transformers {env['transformers']}, "
        f"HBM copy {env['hbm_bytes_per_s'] / 1e12:.2f} TB/s",
        flush=True,
    )
    all_results = {"env": env, "configs": {}}
    for name in names:
        config = json.loads((CONFIGS / f"{name}.json").read_text())
        if args.num_hidden_layers:
            config["num_hidden_layers"] = args.num_hidden_layers
        if args.dense_experts:
            config.pop("quantization_config", None)
        prompts, output_lens = workloads.prompts(args, config["vocab_size"])
        results: dict = {"workload": args.workload}
        bench_moetrace(name, config, prompts, output_lens, args, results)
        if args.hf and args.workload == "uniform":
            bench_transformers(name, config, prompts, args, results)
        all_results["configs"][name] = results
        if args.out:
            args.out.write_text(json.dumps(all_results, indent=2))
    print_table(all_results, env["hbm_bytes_per_s"])


def print_table(all_results: dict, hbm: float) -> None:
    print(
        "\n| config | moetrace capture | moetrace no capture | capture on/off | HF generate_batch | HF generate | vs HF's faster | decode step @B | at HBM bound |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in all_results["configs"].items():
        on = r["moetrace"]["capture"]["median"]
        off = r["moetrace"]["no-capture"]["median"]
        hb = r.get("hf_generate_batch", {}).get("tok_s")
        hg = r.get("hf_generate", {}).get("tok_s")
        prof = r.get("decode_profile") or {}
        bound_ms = (
            (prof.get("weight_bytes", 0) + prof.get("kv_bytes", 0)) / hbm * 1e3 if prof else None
        )
        print(
            f"| {name} | {on:,.0f} | {off:,.0f} | {on / off:.3f} | "
            f"{f'{hb:,.0f}' if hb else '-'} | {f'{hg:,.0f}' if hg else '-'} | "
            f"{f'{on / max(hb or 0, hg or 0):.1f}x' if hb or hg else '-'} | "
            f"{prof.get('step_ms', float('nan')):.2f} ms | {bound_ms if bound_ms else float('nan'):.2f} ms |"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
