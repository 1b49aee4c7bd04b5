"""Train the built-in ``demo`` model and show what its experts learned.

The demo is a tiny ``Qwen3MoeForCausalLM`` trained with transformers' own
class on text every Python install carries (the standard library's source,
its pydoc topics, docstrings and license), so anyone can rebuild it offline
and the saved checkpoint is, by construction, one transformers loads.

    python tools/train_demo.py train                  # writes moetrace/assets/demo/
    python tools/train_demo.py heldout -o heldout.jsonl
    moetrace record demo heldout.jsonl -o heldout.h5 --max-tokens 1
    python tools/train_demo.py evidence heldout.h5    # byte classes and sources per expert

Reproducible on one machine: fixed seeds, a sorted file list, deterministic
torch algorithms and a fixed thread count.  The corpus digest printed at the
start pins the exact text; another Python version has other text.
See docs/demo-model.md for the run that produced the shipped weights.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import keyword
import math
import re
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from moetrace.inputs.tokenizer import BYTE_BOS_ID, BYTE_EOS_ID, ByteTokenizer  # noqa: E402

DEFAULT_OUT = ROOT / "moetrace" / "assets" / "demo"
SOURCES = ("code", "prose", "tables")
# How often a training window comes from each source: tables are repetitive, so few.
MIX = {"code": 0.5, "prose": 0.35, "tables": 0.15}
HELDOUT_EVERY = 10  # about one document in ten, chosen by a hash of its name

MODEL_CONFIG: dict = {
    "vocab_size": 260,
    "hidden_size": 128,
    "intermediate_size": 512,  # the dense layer 0
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
    "bos_token_id": BYTE_BOS_ID,
    "eos_token_id": BYTE_EOS_ID,
}


# --- corpus -------------------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    source: str
    name: str
    text: str

    @property
    def heldout(self) -> bool:
        """Decided by the module (or topic) name, so a module's code and docstrings go together."""
        key = self.name.split(":", 1)[-1]
        digest = hashlib.blake2b(key.encode(), digest_size=4).digest()
        return int.from_bytes(digest, "little") % HELDOUT_EVERY == 0


def _docstrings(tree: ast.Module) -> Iterator[str]:
    nodes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    for node in ast.walk(tree):
        if isinstance(node, nodes):
            doc = ast.get_docstring(node, clean=True)
            if doc and len(doc) >= 80:  # one-liners are mostly code-shaped
                yield doc


def build_corpus(stdlib: Path) -> list[Document]:
    """Every document in a fixed order: sorted file names, then source order inside a file."""
    docs: list[Document] = []
    for path in sorted(stdlib.glob("*.py")):
        if path.name.startswith("_sysconfigdata"):  # describes the build machine, not Python
            continue
        text = path.read_text(encoding="utf-8")
        docs.append(Document("code", f"code:{path.stem}", text))
        try:
            tree = ast.parse(text)
        except SyntaxError:  # lib2to3-era test inputs live elsewhere; be safe anyway
            continue
        docs.append(Document("prose", f"doc:{path.stem}", "\n\n".join(_docstrings(tree)) + "\n"))
    topics_path = stdlib / "pydoc_data" / "topics.py"
    topics = ast.literal_eval(topics_path.read_text(encoding="utf-8").split("=", 1)[1].strip())
    for key in sorted(topics):
        docs.append(Document("prose", f"topic:{key}", topics[key]))
    license_path = stdlib / "LICENSE.txt"
    if license_path.exists():
        docs.append(Document("prose", "license:LICENSE", license_path.read_text(encoding="utf-8")))
    for path in sorted((stdlib / "encodings").glob("*.py")):
        text = path.read_text(encoding="utf-8")
        if "decoding_table = (" in text:  # the generated charmap tables: hex, names, quotes
            docs.append(Document("tables", f"table:{path.stem}", text))
    return [d for d in docs if d.text.strip()]


def corpus_digest(docs: list[Document]) -> str:
    h = hashlib.sha256()
    for d in docs:
        h.update(f"{d.source}\0{d.name}\0{len(d.text)}\0".encode())
        h.update(d.text.encode("utf-8"))
    return h.hexdigest()


def stream(docs: list[Document]) -> torch.Tensor:
    """Documents as one token stream, each framed by <|bos|> ... <|eos|>."""
    ids: list[int] = []
    for d in docs:
        ids.append(BYTE_BOS_ID)
        ids.extend(d.text.encode("utf-8"))
        ids.append(BYTE_EOS_ID)
    return torch.tensor(ids, dtype=torch.long)


def split(docs: list[Document]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    train = {s: stream([d for d in docs if d.source == s and not d.heldout]) for s in SOURCES}
    held = {s: stream([d for d in docs if d.source == s and d.heldout]) for s in SOURCES}
    return train, held


def sample_batch(
    streams: dict[str, torch.Tensor], batch: int, seq: int, gen: torch.Generator
) -> torch.Tensor:
    weights = torch.tensor([MIX[s] for s in SOURCES])
    picks = torch.multinomial(weights, batch, replacement=True, generator=gen)
    rows = []
    for p in picks.tolist():
        data = streams[SOURCES[p]]
        start = int(torch.randint(0, len(data) - seq - 1, (1,), generator=gen))
        rows.append(data[start : start + seq + 1])
    return torch.stack(rows)


def eval_windows(held: dict[str, torch.Tensor], per_source: int, seq: int) -> dict:
    """Evenly spaced held-out windows: the same ones at every evaluation."""
    out = {}
    for s, data in held.items():
        starts = torch.linspace(0, len(data) - seq - 2, per_source).long()
        out[s] = torch.stack([data[i : i + seq + 1] for i in starts.tolist()])
    return out


# --- training -----------------------------------------------------------------------


def make_model(seed: int, aux_coef: float):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**MODEL_CONFIG, router_aux_loss_coef=aux_coef)
    config.architectures = ["Qwen3MoeForCausalLM"]
    return Qwen3MoeForCausalLM._from_config(
        config, attn_implementation="sdpa", experts_implementation="grouped_mm"
    )


def lm_loss(model, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Next-byte cross-entropy, load-balancing loss and router logits of one batch."""
    out = model(input_ids=tokens[:, :-1], output_router_logits=True, use_cache=False)
    ce = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), tokens[:, 1:].reshape(-1))
    return ce, out.aux_loss, out.router_logits


def load_entropy(router_logits: tuple, num_experts: int, top_k: int) -> list[float]:
    """Normalised entropy of each MoE layer's top-k load: 1 is perfectly even, 0 one expert."""
    values = []
    for logits in router_logits:
        ids = logits.topk(top_k, dim=-1).indices.reshape(-1)
        p = torch.bincount(ids, minlength=num_experts).double()
        p = p / p.sum()
        h = -(p[p > 0] * p[p > 0].log()).sum() / math.log(num_experts)
        values.append(round(float(h), 3))
    return values


@torch.no_grad()
def evaluate(model, windows: dict[str, torch.Tensor]) -> dict[str, float]:
    model.eval()
    result = {s: round(float(lm_loss(model, w)[0]), 4) for s, w in windows.items()}
    model.train()
    return result


@torch.no_grad()
def routing_stats(model, windows: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """Held-out load balance and how strongly the chosen experts tell the byte class."""
    model.eval()
    e, k = MODEL_CONFIG["num_experts"], MODEL_CONFIG["num_experts_per_tok"]
    joint: list[np.ndarray] = []
    for source, w in windows.items():
        router_logits = model(input_ids=w[:, :-1], output_router_logits=True).router_logits
        classes = np.concatenate(
            [byte_classes(row.numpy(), code=source == "code") for row in w[:, :-1]]
        )
        for layer, logits in enumerate(router_logits):
            ids = logits.topk(k, dim=-1).indices.numpy()
            if len(joint) <= layer:
                joint.append(np.zeros((len(CLASSES), e), dtype=np.int64))
            for slot in range(k):
                np.add.at(joint[layer], (classes, ids[:, slot]), 1)
    model.train()
    loads = [j.sum(0) for j in joint]
    return {
        "load_entropy": [round(float(x), 3) for x in _entropy(np.stack(loads))],
        "dead_experts": [int((load == 0).sum()) for load in loads],
        "class_association": [round(uncertainty_coefficient(j), 3) for j in joint],
    }


def _entropy(counts: np.ndarray) -> np.ndarray:
    p = counts / counts.sum(1, keepdims=True)
    logp = np.log(np.where(p > 0, p, 1.0))
    return -(p * logp).sum(1) / math.log(counts.shape[1])


def train(args: argparse.Namespace) -> None:
    import transformers

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    stdlib = Path(args.stdlib)
    docs = build_corpus(stdlib)
    digest = corpus_digest(docs)
    train_streams, held_streams = split(docs)
    sizes = {s: (len(train_streams[s]), len(held_streams[s])) for s in SOURCES}
    print(f"corpus {stdlib} sha256 {digest}", flush=True)
    print(f"tokens (train, held out) per source: {sizes}", flush=True)

    model = make_model(args.seed, args.aux_coef)
    model.train()
    coef = args.aux_coef
    k, e = MODEL_CONFIG["num_experts_per_tok"], MODEL_CONFIG["num_experts"]
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    gen = torch.Generator().manual_seed(args.seed)
    windows = eval_windows(held_streams, args.eval_windows, args.seq)
    log: list[dict] = []
    start = time.perf_counter()
    running = 0.0
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        tokens = sample_batch(train_streams, args.batch, args.seq, gen)
        ce, aux, router_logits = lm_loss(model, tokens)
        (ce + coef * aux).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = float(ce.detach())
        running = loss if step == 0 else 0.95 * running + 0.05 * loss
        if step % args.log_every == 0 or step == args.steps - 1:
            entry = {
                "step": step,
                "train_ce": round(running, 4),
                "aux": round(float(aux), 4),
                "load_entropy": load_entropy(router_logits, e, k),
                "elapsed_s": round(time.perf_counter() - start, 1),
            }
            if step % (4 * args.log_every) == 0 or step == args.steps - 1:
                entry["heldout_ce"] = evaluate(model, windows)
            log.append(entry)
            print(json.dumps(entry), flush=True)
    elapsed = time.perf_counter() - start
    final = evaluate(model, windows)
    routing = routing_stats(model, windows)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    model.save_pretrained(out, safe_serialization=True)
    ByteTokenizer().save(out)
    summary = {
        "command": " ".join(["python", "tools/train_demo.py", *sys.argv[1:]]),
        "corpus_sha256": digest,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": args.threads,
        "aux_coef": args.aux_coef,
        "steps": args.steps,
        "batch": args.batch,
        "seq": args.seq,
        "tokens_seen": args.steps * args.batch * args.seq,
        "wall_s": round(elapsed, 1),
        "final_train_ce": round(running, 4),
        "heldout_ce": final,
        "heldout_routing": routing,
        "train_tokens": {s: sizes[s][0] for s in SOURCES},
        "heldout_tokens": {s: sizes[s][1] for s in SOURCES},
    }
    (out / "training.json").write_text(json.dumps({**summary, "log": log}, indent=1) + "\n")
    print(json.dumps(summary, indent=1), flush=True)


# --- held-out prompts and the evidence ------------------------------------------------

# Byte classes reported per expert.  "keyword" is a byte inside a Python keyword in
# code; elsewhere (prose) the same letters count as letters.
CLASSES = ("lower", "upper", "digit", "space", "newline", "punct", "keyword", "other")
_KEYWORD_RE = re.compile(rb"\b(?:" + b"|".join(k.encode() for k in keyword.kwlist) + rb")\b")


def byte_classes(ids: np.ndarray, code: bool) -> np.ndarray:
    """Class index of every token id."""
    out = np.full(len(ids), CLASSES.index("other"), dtype=np.int64)
    b = ids.astype(np.int64)
    ascii_ = b < 128
    low = ascii_ & (b >= ord("a")) & (b <= ord("z"))
    up = ascii_ & (b >= ord("A")) & (b <= ord("Z"))
    dig = ascii_ & (b >= ord("0")) & (b <= ord("9"))
    sp = (b == ord(" ")) | (b == ord("\t"))
    nl = b == ord("\n")
    punct = ascii_ & (b > 32) & (b < 127) & ~low & ~up & ~dig
    for name, mask in (
        ("lower", low),
        ("upper", up),
        ("digit", dig),
        ("space", sp),
        ("newline", nl),
        ("punct", punct),
    ):
        out[mask] = CLASSES.index(name)
    if code:
        raw = bytes(int(x) if x < 256 else 0 for x in ids)
        for m in _KEYWORD_RE.finditer(raw):
            out[m.start() : m.end()] = CLASSES.index("keyword")
    return out


def heldout(args: argparse.Namespace) -> None:
    """Write held-out windows as prompt lines ``{"id": "<source>:<doc>:<n>", ...}``."""
    docs = [d for d in build_corpus(Path(args.stdlib)) if d.heldout]
    lines = []
    for source in SOURCES:
        chunks = []
        for d in docs:
            if d.source != source:
                continue
            data = d.text.encode("utf-8")
            for n, pos in enumerate(range(0, len(data) - args.length + 1, args.length)):
                chunks.append(
                    (f"{source}:{d.name.split(':', 1)[1]}:{n}", data[pos:][: args.length])
                )
        step = max(1, len(chunks) // args.per_source)
        for cid, data in chunks[::step][: args.per_source]:
            lines.append({"id": cid, "prompt_token_ids": list(data)})
    Path(args.output).write_text("".join(json.dumps(x) + "\n" for x in lines))
    print(f"{len(lines)} prompts, {sum(len(x['prompt_token_ids']) for x in lines)} tokens")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def uncertainty_coefficient(joint: np.ndarray) -> float:
    """I(C; E) / H(C) of a (classes, experts) count table: 0 unrelated, 1 E determines C."""
    p = joint / joint.sum()
    pc, pe = p.sum(1, keepdims=True), p.sum(0, keepdims=True)
    nz = p > 0
    mi = float((p[nz] * np.log(p[nz] / (pc @ pe)[nz])).sum())
    hc = float(-(pc[pc > 0] * np.log(pc[pc > 0])).sum())
    return mi / hc if hc > 0 else 0.0


def class_expert_counts(trace_path: str) -> tuple[dict, dict, list[int]]:
    """(layer -> (classes, experts) counts, layer -> (sources, experts) counts, MoE layers)."""
    import moetrace

    by_class: dict[int, np.ndarray] = {}
    by_source: dict[int, np.ndarray] = {}
    with moetrace.open_trace(trace_path) as trace:
        e, layers = trace.num_experts, trace.num_moe_layers
        moe_layers = [int(x) for x in trace.metadata["moe_layer_indices"]]
        for layer in range(layers):
            by_class[layer] = np.zeros((len(CLASSES), e), dtype=np.int64)
            by_source[layer] = np.zeros((len(SOURCES), e), dtype=np.int64)
        for req in trace:
            source = req.id.split(":", 1)[0]
            ids = np.asarray(req.prompt_token_ids)
            rows = np.asarray(req.routed_experts)[: len(ids)]
            classes = byte_classes(ids[: len(rows)], code=source == "code")
            for layer in range(layers):
                for slot in range(rows.shape[2]):
                    np.add.at(by_class[layer], (classes, rows[:, layer, slot]), 1)
                    if source in SOURCES:
                        np.add.at(by_source[layer][SOURCES.index(source)], rows[:, layer, slot], 1)
    return by_class, by_source, moe_layers


def evidence(args: argparse.Namespace) -> None:
    """Markdown tables: per-layer association of experts with byte classes and sources."""
    by_class, by_source, moe_layers = class_expert_counts(args.trace)
    summary = []
    for layer, counts in by_class.items():
        summary.append(
            [
                str(moe_layers[layer]),
                f"{uncertainty_coefficient(counts):.3f}",
                f"{uncertainty_coefficient(by_source[layer]):.3f}",
            ]
        )
    print("Association of the chosen experts with the byte class and the source")
    print("(uncertainty coefficient I(X; expert) / H(X); 0 = unrelated):\n")
    print(_table(["layer", "byte class", "source"], summary))
    shown = moe_layers.index(args.layer) if args.layer is not None else 0
    counts = by_class[shown]
    src = by_source[shown]
    base = counts.sum(1) / counts.sum()
    src_base = src.sum(1) / src.sum()
    rows = []
    for expert in range(counts.shape[1]):
        col = counts[:, expert]
        total = int(col.sum())
        if total == 0:
            rows.append([str(expert), "0", "-", "-", "-"])
            continue
        share = col / total
        lift = np.where(base > 0, share / np.where(base > 0, base, 1), 0)
        top = int(np.argmax(lift * (col >= 20)))  # ignore classes the expert barely saw
        s_share = src[:, expert] / max(1, src[:, expert].sum())
        s_top = int(np.argmax(s_share / src_base))
        rows.append(
            [
                str(expert),
                f"{total / counts.sum():.1%}",
                f"{CLASSES[top]} ({share[top]:.0%} vs {base[top]:.0%})",
                ", ".join(
                    f"{CLASSES[c]} {share[c]:.0%}" for c in np.argsort(-share)[:3] if share[c] > 0
                ),
                f"{SOURCES[s_top]} ({s_share[s_top]:.0%} vs {src_base[s_top]:.0%})",
            ]
        )
    print(f"\nLayer {moe_layers[shown]}, per expert (share of the layer's selections):\n")
    print(
        _table(
            ["expert", "load", "most over-represented class", "top classes", "favoured source"],
            rows,
        )
    )
    print("\nBase rates: " + ", ".join(f"{c} {b:.1%}" for c, b in zip(CLASSES, base, strict=True)))


def main(argv: list[str] | None = None) -> None:
    stdlib_default = sysconfig.get_paths()["stdlib"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train and save the demo checkpoint")
    t.add_argument("--stdlib", default=stdlib_default, help="the Python Lib directory to read")
    t.add_argument("--out", default=str(DEFAULT_OUT))
    t.add_argument("--steps", type=int, default=720)
    t.add_argument("--batch", type=int, default=8)
    t.add_argument("--seq", type=int, default=512)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--warmup", type=int, default=40)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--aux-coef", type=float, default=0.05, help="load-balancing loss weight")
    t.add_argument("--threads", type=int, default=1, help="fixed: results depend on it")
    t.add_argument("--log-every", type=int, default=40)
    t.add_argument("--eval-windows", type=int, default=8, help="held-out windows per source")
    h = sub.add_parser("heldout", help="write held-out text as a prompts file")
    h.add_argument("-o", "--output", required=True)
    h.add_argument("--stdlib", default=stdlib_default)
    h.add_argument("--per-source", type=int, default=24)
    h.add_argument("--length", type=int, default=384, help="bytes per prompt")
    ev = sub.add_parser("evidence", help="byte classes and sources per expert, from a trace")
    ev.add_argument("trace")
    ev.add_argument("--layer", type=int, default=None, help="decoder layer to detail")
    args = parser.parse_args(argv)
    {"train": train, "heldout": heldout, "evidence": evidence}[args.command](args)


if __name__ == "__main__":
    main()
