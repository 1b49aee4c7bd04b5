"""One whole rollout-routing-replay (R3) loop: serve, roll out, train with replay, push weights.

    python examples/r3_loop.py                      # the demo model on the CPU, 4 steps
    python examples/r3_loop.py --model ~/models/OLMoE-1B-7B --steps 10   # on a GPU

Each step:

1. rollouts: a handful of prompts, ``--samples`` each at temperature 1,
   through ``moetrace serve``'s SGLang route ``/generate`` with the sampled
   tokens' log-probabilities and the routed experts of every token, as slime
   asks for them; a toy reward scores each completion;
2. a transformers copy of the same checkpoint scores the rollouts twice:
   routing by itself (``moetrace.r3.record_routing`` keeps what it chose) and
   under ``moetrace.r3.replay_routing`` with the rollouts' experts; the second
   forward carries the GRPO loss, and an optimizer step follows;
3. the new weights go back to the server as a weight version of their own:
   by ``torch.distributed`` broadcasts over a group the trainer hosts (slime's
   and AReaL's route, gloo on the CPU) or through a checkpoint on disk, in
   turns unless ``--transport`` names one; the next step's rollouts must
   carry that version.

Before the first step the trainer's starting weights go to the server the
same way (version "0"), so the two start equal even on a server that ran
something else before.

Per step it prints the reward, the training-inference mismatch of the sampled
tokens' log-probabilities without and with replay (mean |Δ log p| and the k3
estimate of KL(rollout || trainer)) and the router mismatch of the trainer's own
routing against the rollout's.  See docs/r3.md, "A whole loop".
"""

from __future__ import annotations

import argparse
import base64
import json
import string
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers
from serve_client import Server, ServerError, WeightSync, call
from transformers import AutoModelForCausalLM, AutoTokenizer

import moetrace.r3
from moetrace.analysis.diff import compare_rows
from moetrace.analysis.logprob_drift import LogprobDrift
from moetrace.errors import MoetraceError
from moetrace.models.demo import model_dir

PROMPTS = ("def fibonacci(n):", "The experts of a mixture", "import os\n", "Hello! Tell me")


class LoopError(Exception):
    """Something the loop cannot go on from; printed as one line."""


# ------------------------------------------------------------------------ rollouts


@dataclass
class Rollout:
    group: int  # the prompt it answers (GRPO's group)
    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: np.ndarray  # (outputs,) the rollout engine's log p of each sampled token
    routed_experts: np.ndarray  # (prompt + outputs - 1, hidden layers, top_k), vLLM's layout
    version: str
    reward: float = 0.0


def toy_reward(text: str) -> float:
    """The share of the completion's characters that are lowercase letters or spaces: prose."""
    allowed = set(string.ascii_lowercase + " ")
    return sum(ch in allowed for ch in text) / len(text) if text else 0.0


def roll_out(url: str, prompt_ids: list[list[int]], args, step: int, shape) -> list[Rollout]:
    """``--samples`` completions of each prompt, one ``/generate`` request each (as slime
    sends them), at once so the server batches them."""
    num_layers, top_k = shape

    def one(p: int, j: int) -> Rollout:
        body = {
            "rid": f"{args.run_name}-step{step}-p{p}-{j}",
            "input_ids": prompt_ids[p],
            "sampling_params": {
                "max_new_tokens": args.max_tokens,
                "temperature": 1.0,
                "sampling_seed": args.seed + 100_000 * step + 1000 * p + j,
            },
            "return_logprob": True,
            "return_routed_experts": True,
        }
        out = call(url, "/generate", body)
        meta = out["meta_info"]
        if meta["finish_reason"]["type"] == "abort":
            raise LoopError(f"rollout {body['rid']} was aborted")
        flat = np.frombuffer(base64.b64decode(meta["routed_experts"]), dtype=np.int32)
        rollout = Rollout(
            group=p,
            prompt_ids=prompt_ids[p],
            output_ids=out["output_ids"],
            logprobs=np.array([lp for lp, _, _ in meta["output_token_logprobs"]], np.float64),
            routed_experts=flat.reshape(-1, num_layers, top_k),
            version=meta["weight_version"],
            reward=toy_reward(out["text"]),
        )
        rows = len(rollout.prompt_ids) + len(rollout.output_ids) - 1
        if rollout.routed_experts.shape[0] != rows:
            raise LoopError(f"{body['rid']}: {rollout.routed_experts.shape[0]} rows, not {rows}")
        return rollout

    jobs = [(p, j) for p in range(len(prompt_ids)) for j in range(args.samples)]
    with ThreadPoolExecutor(min(len(jobs), 64)) as pool:
        return list(pool.map(lambda job: one(*job), jobs))


def grpo_advantages(rollouts: list[Rollout]) -> torch.Tensor:
    """Each reward less its group's mean, over the group's std (+1e-6): GRPO's outcome
    advantage as verl (``compute_grpo_outcome_advantage``) and slime compute it."""
    rewards = torch.tensor([r.reward for r in rollouts], dtype=torch.float64)
    groups = torch.tensor([r.group for r in rollouts])
    out = torch.zeros_like(rewards)
    for g in groups.unique():
        mine = groups == g
        r = rewards[mine]  # --samples >= 2: the unbiased std is defined
        out[mine] = (r - r.mean()) / (r.std() + 1e-6)
    return out


# ------------------------------------------------------------------------ the trainer


def sampled_logprobs(model, rollouts: list[Rollout], device) -> list[torch.Tensor]:
    """log p of each rollout's sampled tokens under ``model``, one forward over the batch
    (right-padded); each tensor has the rollout's output length."""
    seqs = [r.prompt_ids + r.output_ids for r in rollouts]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.long)
    for b, seq in enumerate(seqs):
        ids[b, : len(seq)] = torch.tensor(seq)
        mask[b, : len(seq)] = 1
    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
    out = []
    for b, r in enumerate(rollouts):
        start, n = len(r.prompt_ids), len(r.output_ids)  # logits at t predict token t + 1
        logp = logits[b, start - 1 : start - 1 + n].float().log_softmax(dim=-1)
        tokens = ids[b, start : start + n].to(device)
        out.append(logp.gather(1, tokens[:, None])[:, 0])
    return out


def drift(rollouts: list[Rollout], trainer: list[torch.Tensor]) -> dict:
    """mean |Δ log p| and k3 over every sampled token (trainer less rollout, verl's
    ``rollout_corr`` metrics; slime's ``train_rollout_logprob_abs_diff``)."""
    figures = LogprobDrift()
    for r, lp in zip(rollouts, trainer, strict=True):
        figures.add(r.logprobs, lp.detach().double().cpu().numpy())
    result = figures.result()  # None when every completion was empty
    if result is None:
        return {"abs_logprob_diff": float("nan"), "kl_k3": float("nan")}
    return {"abs_logprob_diff": result["mean_abs_logprob_diff"], "kl_k3": result["kl_k3"]}


def router_mismatch(rollouts: list[Rollout], own: list[np.ndarray], moe_layers) -> dict:
    """The share of (token, MoE layer) routers, and of tokens in any layer, whose expert set
    differs between the trainer's own routing and the rollout's (R3's figures)."""
    differ = []
    for r, mine in zip(rollouts, own, strict=True):
        theirs = r.routed_experts[:, moe_layers]
        set_diff, _, _ = compare_rows(theirs, mine[: len(theirs)])
        differ.append(set_diff)
    rows = np.concatenate(differ)  # (tokens, MoE layers) bool
    return {"router_mismatch": float(rows.mean()), "token_mismatch": float(rows.any(1).mean())}


def train_step(model, optimizer, rollouts: list[Rollout], device) -> dict:
    """One GRPO step with the rollouts' routing replayed; the mismatch figures beside it."""
    model.train()
    with torch.no_grad(), moetrace.r3.record_routing(model) as record:
        own_logprobs = sampled_logprobs(model, rollouts, device)
    moe_layers = list(record.shape.moe_layer_indices)
    metrics = {f"{k}_own": v for k, v in drift(rollouts, own_logprobs).items()}
    metrics |= router_mismatch(rollouts, record.sequences(), moe_layers)

    advantages = grpo_advantages(rollouts).to(device)
    replayed = [r.routed_experts for r in rollouts]
    with moetrace.r3.replay_routing(model, replayed, layout="vllm"):
        logprobs = sampled_logprobs(model, rollouts, device)
        # On-policy, one optimizer step per batch: PPO's ratio pi/pi_old is 1 when the
        # gradient is taken, so the clipped GRPO objective of slime's and verl's
        # compute_policy_loss reduces to -A * log p, a token mean per sequence (GRPO's
        # 1/|o_i|), then a mean over sequences.
        per_seq = [
            -a * lp.sum() / max(lp.numel(), 1) for a, lp in zip(advantages, logprobs, strict=True)
        ]
        loss = torch.stack(per_seq).mean()
        optimizer.zero_grad()
        loss.backward()
    optimizer.step()
    metrics |= {f"{k}_replay": v for k, v in drift(rollouts, logprobs).items()}
    metrics["loss"] = loss.item()
    return metrics


# ------------------------------------------------------------------------ the loop


def load_trainer(args: argparse.Namespace):
    """The transformers model, its tokenizer and optimizer, from the checkpoint MODEL names."""
    path = model_dir(args.model)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        dtype = getattr(torch, args.trainer_dtype)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(args.device)
    except (OSError, ValueError) as exc:
        reason = " ".join(str(exc).split())  # one line
        raise LoopError(f"cannot load {args.model} into transformers: {reason}") from None
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    return model, tokenizer, optimizer


def run(args: argparse.Namespace) -> None:
    model, tokenizer, optimizer = load_trainer(args)
    shape = (model.config.num_hidden_layers, model.config.num_experts_per_tok)
    prompt_ids = [tokenizer.encode(p) for p in args.prompt or PROMPTS]
    serve_options = ["--device", args.device, "--dtype", args.server_dtype]
    server = Server(args.url, args.model, serve_options, args.trace_out)
    sync = WeightSync(
        server.url,
        model,
        master_address=args.master_address,
        backend=args.update_backend,
        disk_dir=args.weights_dir,
    )
    if args.metrics_out:
        args.metrics_out.write_text("")
    try:
        # The trainer's weights first, whatever the server served before (slime's train.py
        # does the same before its first rollout): version "0".
        version = "0"
        sync.push(version, transport_of(0, args.transport))
        print(
            f"{args.model} at {server.url}, weights {version!r} pushed by "
            f"{transport_of(0, args.transport)}: {len(prompt_ids)} prompts x {args.samples} "
            f"samples of {args.max_tokens} tokens a step; mismatch figures read 'trainer "
            "routing by itself -> replaying the rollout's experts'",
            flush=True,
        )
        for step in range(args.steps):
            started = time.perf_counter()
            rollouts = roll_out(server.url, prompt_ids, args, step, shape)
            seen = {r.version for r in rollouts}
            if seen != {version}:
                raise LoopError(f"step {step}: rollouts carry versions {seen}, not {version!r}")
            metrics = train_step(model, optimizer, rollouts, torch.device(args.device))
            transport = transport_of(step + 1, args.transport)
            version = str(step + 1)
            sync.push(version, transport)
            metrics |= {
                "step": step,
                "reward": float(np.mean([r.reward for r in rollouts])),
                "rollout_version": seen.pop(),
                "pushed_version": version,
                "transport": transport,
                "seconds": time.perf_counter() - started,
            }
            print(report(metrics), flush=True)
            if args.metrics_out:
                with args.metrics_out.open("a") as out:
                    out.write(json.dumps(metrics) + "\n")
        final = call(server.url, "/get_weight_version")["weight_version"]
        if final != version:
            raise LoopError(f"the server serves version {final!r}, not {version!r}")
    finally:
        sync.close()
        server.stop()


def transport_of(push: int, transport: str) -> str:
    """How the ``push``-th update (0: the starting weights) travels."""
    if transport != "alternate":
        return transport
    return "distributed" if push % 2 == 0 else "disk"


def report(m: dict) -> str:
    """One line: mismatch figures as "own routing -> replayed routing"."""
    return (
        f"step {m['step']}  reward {m['reward']:.3f}  "
        f"|dlogp| {m['abs_logprob_diff_own']:.4f} -> {m['abs_logprob_diff_replay']:.4f}  "
        f"k3 {m['kl_k3_own']:.1e} -> {m['kl_k3_replay']:.1e}  "
        f"router mismatch {m['router_mismatch']:.2%} (tokens {m['token_mismatch']:.2%})  "
        f"weights {m['pushed_version']!r} by {m['transport']}  {m['seconds']:.1f} s"
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="a checkpoint directory, a cached id, demo")
    p.add_argument("--url", help="a running `moetrace serve --enable-weight-updates "
                   "--enable-return-routed-experts` of the same model (else one is started)")  # fmt: skip
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable; default: four)")
    p.add_argument("--samples", type=int, default=4, help="completions per prompt (GRPO's group)")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--transport", choices=("alternate", "distributed", "disk"), default="alternate")
    p.add_argument("--device", default="cuda" if cuda else "cpu", help="the trainer's and server's")
    p.add_argument("--server-dtype", default="bfloat16", help="the rollout engine's --dtype")
    p.add_argument("--trainer-dtype", default="float32")
    p.add_argument("--update-backend", choices=("gloo", "nccl"), default="gloo",
                   help="the broadcast group's backend (nccl: trainer and server on other GPUs)")  # fmt: skip
    p.add_argument("--master-address", default="127.0.0.1", help="this host, as the server sees it")
    p.add_argument("--weights-dir", help="where disk updates go (the server must see it)")
    p.add_argument("--trace-out", type=Path, help="the started server's --trace-out")
    p.add_argument("--metrics-out", type=Path, help="each step's figures as a JSON line")
    p.add_argument("--run-name", default=f"r3loop-{int(time.time())}", help="rollout id prefix")
    args = p.parse_args(argv)
    if args.steps < 1 or args.samples < 2 or args.max_tokens < 1:
        p.error("--steps and --max-tokens must be positive, --samples at least 2 (a group)")
    if args.url and args.trace_out:
        p.error("--trace-out sets up a server this script starts; give it to yours instead")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    transformers.utils.logging.disable_progress_bar()  # no bar per load and save
    try:
        run(args)
    except (LoopError, ServerError, MoetraceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
