"""Every supported family, at a real checkpoint's config shape, through the real CLI.

For each config in ``benchmarks/configs`` (tiny ones left out) this writes a
checkpoint directory holding only ``config.json``, runs
``moetrace record --load-format dummy`` on a few random-token prompts in a
subprocess, then ``moetrace inspect --json`` and ``moetrace verify`` on the
trace, and checks the trace against what the config implies, computed here
from the config fields and not from moetrace's models: which layers route,
how many experts, top-k, and ``prompt + output - 1`` rows per request.

    python benchmarks/family_smoke.py --out families.json          # one GPU
    python benchmarks/family_smoke.py --shrink --layers 2          # CPU, seconds

A config whose bf16 weights exceed ``--budget-gb`` (DeepSeek-V3: 671B) is
run at the depth that fits, and the script says so.  ``--shrink`` divides
widths, head counts and expert counts so that the script itself can be
proven on a CPU; the routing rules under test stay those of the config.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CONFIGS = Path(__file__).parent / "configs"
SUMMARY = re.compile(r"in ([\d.]+) s \(([\d,]+) output tok/s\)")
EXPERT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")
WIDTH_KEYS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def default_configs() -> list[Path]:
    """All shipped configs except the tiny test ones, which prove nothing about shape."""
    return sorted(p for p in CONFIGS.glob("*.json") if not p.stem.startswith("tiny"))


def num_experts(cfg: dict) -> int:
    return int(next(cfg[k] for k in EXPERT_KEYS if cfg.get(k)))


def top_k(cfg: dict) -> int:
    return int(cfg.get("num_experts_per_tok") or cfg["experts_per_token"])


def expected_moe_layers(cfg: dict) -> list[int]:
    """The routing layers as the Hugging Face reference code decides them from the config."""
    n = int(cfg["num_hidden_layers"])
    if "first_k_dense_replace" in cfg:  # DeepSeek: a dense prefix, then every freq-th layer
        k, freq = int(cfg["first_k_dense_replace"]), int(cfg.get("moe_layer_freq", 1))
        return [i for i in range(n) if i >= k and i % freq == 0]
    if "decoder_sparse_step" in cfg or "mlp_only_layers" in cfg:  # Qwen2-MoE / Qwen3-MoE
        step = int(cfg.get("decoder_sparse_step", 1))
        dense = set(cfg.get("mlp_only_layers") or [])
        return [i for i in range(n) if i not in dense and (i + 1) % step == 0]
    return list(range(n))


def with_layers(cfg: dict, layers: int) -> tuple[dict, list[str]]:
    """``cfg`` at a new depth, with the per-layer fields cut to match.

    DeepSeek's dense prefix is kept, but shortened so that at least one layer
    still routes (a 2-layer DeepSeek-V3 would otherwise have none).
    """
    cfg, notes = dict(cfg), []
    cfg["num_hidden_layers"] = layers
    if "first_k_dense_replace" in cfg and cfg["first_k_dense_replace"] >= layers:
        notes.append(f"first_k_dense_replace {cfg['first_k_dense_replace']} -> {layers - 1}")
        cfg["first_k_dense_replace"] = layers - 1
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    if cfg.get("mlp_only_layers"):
        cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < layers]
    if cfg.get("max_window_layers") is not None:
        cfg["max_window_layers"] = min(int(cfg["max_window_layers"]), layers)
    return cfg, notes


def shrink(cfg: dict, factor: int) -> dict:
    """A narrower model of the same family and routing rules, for a CPU run in seconds.

    Head dimensions stay as published (rotary and longrope factor lists are
    per head dimension); heads, widths and experts shrink.  Without an
    explicit ``head_dim`` the hidden size is heads x head_dim, so it follows
    the head count.  Expert counts stay at least 2 x top-k, and a multiple of
    DeepSeek's ``n_group``.
    """
    cfg = dict(cfg)
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    new_heads = max(1, heads // factor)
    new_kv = max(1, min(new_heads, kv // factor))
    while new_heads % new_kv:
        new_kv -= 1
    if "head_dim" in cfg or "qk_nope_head_dim" in cfg:
        cfg["hidden_size"] = max(64, int(cfg["hidden_size"]) // factor // 8 * 8)
    else:
        cfg["hidden_size"] = new_heads * (int(cfg["hidden_size"]) // heads)
    cfg["num_attention_heads"], cfg["num_key_value_heads"] = new_heads, new_kv
    for key in WIDTH_KEYS:
        if cfg.get(key):
            cfg[key] = max(16, int(cfg[key]) // factor)
    k, groups = top_k(cfg), int(cfg.get("n_group") or 1)
    for key in EXPERT_KEYS:
        if cfg.get(key):
            n = min(int(cfg[key]), max(2 * k, int(cfg[key]) // factor))
            cfg[key] = -(-n // groups) * groups
    return cfg


def count_params(cfg: dict) -> int:
    """Parameters of the model moetrace builds, counted on the meta device (no memory)."""
    import torch

    from moetrace.models.loader import instantiate

    model = instantiate(cfg, "family_smoke", torch.bfloat16, torch.device("meta"))
    return sum(p.numel() for p in model.parameters())


def cap_depth(cfg: dict, budget_bytes: float) -> tuple[dict, list[str]]:
    """The deepest version of ``cfg`` whose bf16 weights fit the budget (itself if it fits)."""
    if count_params(cfg) * 2 <= budget_bytes:
        return cfg, []
    first = int(cfg.get("first_k_dense_replace", 0)) + 1  # the dense prefix and one MoE layer
    base = count_params(with_layers(cfg, first)[0])
    per_layer = count_params(with_layers(cfg, first + 1)[0]) - base
    layers = first + int((budget_bytes / 2 - base) // per_layer)
    layers = max(first, min(layers, int(cfg["num_hidden_layers"]) - 1))
    while layers > first and count_params(with_layers(cfg, layers)[0]) * 2 > budget_bytes:
        layers -= 1
    capped, notes = with_layers(cfg, layers)
    note = (
        f"depth capped {cfg['num_hidden_layers']} -> {layers} layers "
        f"to fit {budget_bytes / 1e9:.0f} GB of bf16 weights"
    )
    return capped, [note, *notes]


def write_prompts(path: Path, cfg: dict, count: int, seed: int) -> None:
    """Random token ids: dummy weights need no tokenizer, and ids exercise the embedding."""
    rng = random.Random(seed)
    vocab = int(cfg["vocab_size"])
    with path.open("w") as f:
        for i in range(count):
            ids = [rng.randrange(vocab) for _ in range(rng.randint(8, 32))]
            f.write(json.dumps({"id": f"r{i}", "prompt_token_ids": ids}) + "\n")


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


def check_trace(trace: Path, cfg: dict, max_tokens: int) -> list[str]:
    """Differences between the trace and what the config implies; empty when they agree."""
    from moetrace import open_trace

    problems = []
    with open_trace(trace) as t:
        meta = t.metadata
        want = {
            "moe_layer_indices": expected_moe_layers(cfg),
            "num_experts": num_experts(cfg),
            "top_k": top_k(cfg),
        }
        for key, value in want.items():
            got = list(meta[key]) if key == "moe_layer_indices" else int(meta[key])
            if got != value:
                problems.append(f"{key}: trace {got}, config implies {value}")
        for r in t:
            prompt, output = len(r.prompt_token_ids), len(r.output_token_ids)
            if output != max_tokens:
                problems.append(f"{r.id}: {output} output tokens, asked {max_tokens}")
            if r.routed_experts.shape[0] != prompt + output - 1:
                problems.append(
                    f"{r.id}: {r.routed_experts.shape[0]} rows, want {prompt}+{output}-1"
                )
    return problems


def smoke(name: str, cfg: dict, args: argparse.Namespace, work: Path, device: str) -> dict:
    """One family end to end through the CLI; the row of the table and JSON."""
    cfg = {k: v for k, v in cfg.items() if k not in ("_source", "auto_map")}
    notes = []
    if cfg.pop("quantization_config", None) is not None:
        notes.append("quantization_config dropped (dummy weights are bf16)")
    if args.shrink:
        cfg = shrink(cfg, args.shrink_factor)
    if args.layers:
        cfg, more = with_layers(cfg, args.layers)
        notes += more
    cfg, more = cap_depth(cfg, args.budget_gb * 1e9)
    notes += more
    for note in notes:
        print(f"[{name}] {note}", flush=True)
    model = work / name
    model.mkdir()
    (model / "config.json").write_text(json.dumps(cfg, indent=2))
    prompts, out = work / f"{name}.jsonl", work / f"{name}.h5"
    write_prompts(prompts, cfg, args.num_prompts, args.seed)
    row = {
        "config": name,
        "params": count_params(cfg),
        "layers": int(cfg["num_hidden_layers"]),
        "moe_layers": len(expected_moe_layers(cfg)),
        "experts": num_experts(cfg),
        "top_k": top_k(cfg),
        "notes": notes,
    }
    cli = [sys.executable, "-m", "moetrace"]
    cmd = [*cli, "record", str(model), str(prompts), "-o", str(out), "--load-format", "dummy"]
    cmd += ["--max-tokens", str(args.max_tokens), "--ignore-eos", "--overwrite", "-q"]
    cmd += ["--device", device, "--max-model-len", str(args.max_model_len)]
    # Few sequences: decode graphs for batch 1..N only, so each family starts in seconds.
    cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    start = time.perf_counter()
    proc = run(cmd)
    wall = time.perf_counter() - start
    summary = SUMMARY.search(proc.stderr)
    if proc.returncode != 0 or summary is None:
        return {**row, "verify": "record failed", "error": proc.stderr.strip()[-2000:]}
    record_s, rate = float(summary.group(1)), float(summary.group(2).replace(",", ""))
    # load_s is everything but the recording loop: interpreter, imports, build, fill, writer.
    row.update(load_s=round(wall - record_s, 2), record_s=record_s, tok_s=rate)
    inspect = run([*cli, "inspect", str(out), "--json"])
    verify = run([*cli, "verify", str(out)])
    problems = [] if inspect.returncode == 0 else [f"inspect: {inspect.stderr.strip()}"]
    if inspect.returncode == 0:
        summary_json = json.loads(inspect.stdout)
        row["rows"] = summary_json["rows"]
        if summary_json["layers"] != row["moe_layers"]:
            problems.append(f"inspect layers {summary_json['layers']} != {row['moe_layers']}")
    if verify.returncode != 0:
        problems.append(f"verify: {(verify.stdout + verify.stderr).strip()}")
    problems += check_trace(out, cfg, args.max_tokens)
    row["verify"] = "ok" if not problems else "FAIL"
    if problems:
        row["error"] = "; ".join(problems)
    return row


def table(rows: list[dict]) -> str:
    head = (
        "| config | params | load s | record s | output tok/s | layers | experts | top_k | verify |"
    )
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        params = f"{r['params'] / 1e9:.2f}B" if r["params"] >= 1e8 else f"{r['params'] / 1e6:.1f}M"
        layers = f"{r['moe_layers']}/{r['layers']}"
        lines.append(
            f"| {r['config']} | {params} | {r.get('load_s', '-')} | {r.get('record_s', '-')} "
            f"| {r.get('tok_s', '-')} | {layers} | {r['experts']} | {r['top_k']} | {r['verify']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", nargs="*", help="config names in benchmarks/configs")
    parser.add_argument("--layers", type=int, help="override num_hidden_layers")
    parser.add_argument("--shrink", action="store_true", help="narrow every width (CPU runs)")
    parser.add_argument("--shrink-factor", type=int, default=8)
    parser.add_argument("--budget-gb", type=float, default=120.0, help="bf16 weight budget")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--out", type=Path, help="write the rows as JSON here")
    args = parser.parse_args()

    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not (args.shrink and args.layers):
        print("note: on the CPU, real shapes take long; --shrink --layers 2 takes seconds")
    paths = [CONFIGS / f"{n}.json" for n in args.config] if args.config else default_configs()
    rows = []
    with tempfile.TemporaryDirectory(prefix="family-smoke-") as tmp:
        for path in paths:
            print(f"[{path.stem}] recording on {device} ...", flush=True)
            row = smoke(path.stem, read_json(path), args, Path(tmp), device)
            print(f"[{path.stem}] {row['verify']} {row.get('error', '')}".rstrip(), flush=True)
            rows.append(row)
    print(table(rows))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        settings = {**vars(args), "out": str(args.out)}
        report = {"device": device, "args": settings, "rows": rows}
        args.out.write_text(json.dumps(report, indent=2))
    sys.exit(0 if all(r["verify"] == "ok" for r in rows) else 1)


if __name__ == "__main__":
    main()
