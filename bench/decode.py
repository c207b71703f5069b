# python bench/decode.py            (2-4 minutes on a 2-core CPU, most of it training; --quick: smoke run)
"""Greedy vs blockwise decoding, measured in one run.

Trains two tiny models (k=4 and k=8 BPD heads, all weights jointly) on a task whose future tokens are
learnable: copying (or, with --task reverse, reversing) sequences of real English words from the bundled
corpus (else a built-in text). Then
times greedy and blockwise(Exact) decoding of the same held-out sequences on one thread, at batch 1 and
batch 32, under bench/protocol.py's measure() (one untimed warm-up pass, then --repeats >= 3 passes, the decoders
taking turns batch by batch), and reports agreement with greedy, k̂ (mean accepted block size), decoder calls,
wall-clock speedup (the median over batches of the rate ratio, with its spread) and speedup ÷ k̂. The last line
printed is one JSON object.

Targets: agreement 100%; speedup ÷ k̂ >= 0.8 at batch 1; speedup > 1.5x at batch 32 wherever
k̂ >= 3.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import math
import random
import re
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.protocol import MIN_REPS, Run, measure, speedup  # noqa: E402
from bpd_train.decoding import DecodeResult, blockwise, greedy  # noqa: E402
from bpd_train.model import BPDConfig, BPDModel  # noqa: E402

PAD, BOS, EOS, UNK = 0, 1, 2, 3

FALLBACK_TEXT = """
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of
foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light,
it was the season of Darkness, it was the spring of hope, it was the winter of despair, we had
everything before us, we had nothing before us, we were all going direct to Heaven, we were all going
direct the other way. In short, the period was so far like the present period, that some of its
noisiest authorities insisted on its being received, for good or for evil, in the superlative degree
of comparison only. There were a king with a large jaw and a queen with a plain face, on the throne of
England; there were a king with a large jaw and a queen with a fair face, on the throne of France. In
both countries it was clearer than crystal to the lords of the State preserves of loaves and fishes,
that things in general were settled for ever.
"""


def load_sentences(max_sentences: int = 20000) -> tuple[list[list[str]], str]:
    path = ROOT / "data" / "bible-en-fr" / "train.jsonl.gz"
    sents: list[list[str]] = []
    source = "built-in text"
    if path.is_file():
        try:
            with gzip.open(path, "rt", encoding="utf-8") as f:
                for line in f:
                    text = json.loads(line)["translation"]["en"]
                    sents.append(re.findall(r"[a-z']+", text.lower()))
                    if len(sents) >= max_sentences:
                        break
            source = str(path.relative_to(ROOT))
        except (OSError, ValueError, KeyError):
            sents = []
    if not sents:
        words = re.findall(r"[a-z']+", FALLBACK_TEXT.lower())
        sents = [words[i : i + 20] for i in range(0, len(words), 7)]
        source = "built-in text"
    return [s for s in sents if s], source


class Task:
    """Sequences of 4..max_len consecutive real words (top `vocab` words, others skipped); the target is
    the same sequence (copy) or its reverse."""

    def __init__(self, sentences, vocab: int, max_len: int, seed: int, kind: str = "copy"):
        self.kind = kind
        counts = Counter(w for s in sentences for w in s)
        self.words = [w for w, _ in counts.most_common(vocab)]
        self.ids = {w: i + 4 for i, w in enumerate(self.words)}
        self.stream = [self.ids[w] for s in sentences for w in s if w in self.ids]
        self.vocab_size = len(self.words) + 4
        self.max_len = max_len
        self.rng = random.Random(seed)
        cut = int(len(self.stream) * 0.9)
        self.train_stream, self.test_stream = self.stream[:cut], self.stream[cut:]

    def sample(self, test: bool = False) -> list[int]:
        stream = self.test_stream if test else self.train_stream
        n = self.rng.randint(4, self.max_len)
        i = self.rng.randrange(0, len(stream) - n)
        return stream[i : i + n]

    def target(self, src: list[int]) -> list[int]:
        return src[::-1] if self.kind == "reverse" else list(src)

    def batch(self, size: int, test: bool = False):
        srcs = [self.sample(test) for _ in range(size)]
        tgts = [self.target(s) for s in srcs]
        s_len = max(len(s) for s in srcs) + 1
        t_len = max(len(t) for t in tgts) + 1
        src = torch.full((size, s_len), PAD, dtype=torch.long)
        tgt_in = torch.full((size, t_len), PAD, dtype=torch.long)
        tgt_out = torch.full((size, t_len), PAD, dtype=torch.long)
        for i, (s, t) in enumerate(zip(srcs, tgts)):
            src[i, : len(s) + 1] = torch.tensor(s + [EOS])
            tgt_in[i, : len(t) + 1] = torch.tensor([BOS] + t)
            tgt_out[i, : len(t) + 1] = torch.tensor(t + [EOS])
        return src, tgt_in, tgt_out


def bpd_loss(model: BPDModel, src, tgt_in, tgt_out, heads: int):
    """Head i predicts tgt_out shifted by i. Head 1 gets half the weight (it carries the output; the
    others only propose), the other heads share the rest. All heads in one pass: k x T x V is tiny here."""
    h = model.features(model.encode(src), tgt_in)
    logits = model.heads_logits(h, 0, heads)  # [B,T,k,V]
    targets = torch.stack([F.pad(tgt_out[:, i:], (0, i), value=PAD) for i in range(heads)], dim=2)
    ce = F.cross_entropy(logits.flatten(0, 2), targets.flatten(), ignore_index=PAD, reduction="none")
    ce = ce.view(targets.shape)
    mask = targets != PAD
    per_head = (ce * mask).sum((0, 1)) / mask.sum((0, 1)).clamp(min=1)  # [k]
    if heads == 1:
        return per_head[0]
    return 0.5 * per_head[0] + 0.5 * per_head[1:].mean()


def fit(model: BPDModel, task: Task, args, steps: int, lr: float) -> tuple[float, float]:
    """AdamW on bpd_loss for a fixed number of steps (warmup, constant, cosine decay over the last 30%).
    Returns (final loss, seconds)."""
    k = model.config.block_size
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=True)
    t0 = time.perf_counter()
    model.train()
    loss = torch.tensor(float("nan"))
    for step in range(steps):
        frac = step / steps
        step_lr = lr * min(1.0, (step + 1) / 100)
        if frac > 0.7:
            step_lr *= 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (frac - 0.7) / 0.3))
        for group in opt.param_groups:
            group["lr"] = step_lr
        loss = bpd_loss(model, *task.batch(args.train_batch), heads=k)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    model.eval()
    return float(loss.detach()), time.perf_counter() - t0


def model_config(task: Task, args, k: int) -> BPDConfig:
    return BPDConfig(
        vocab_size=task.vocab_size,
        d_model=args.d_model,
        n_heads=4,
        n_encoder_layers=args.layers,
        n_decoder_layers=args.layers,
        d_ff=4 * args.d_model,
        dropout=0.0,
        max_positions=64,
        block_size=k,
        head_d_hidden=args.head_hidden,
    )


def time_decoders(model, batches, block_size: int, repeats: int = MIN_REPS, clock=time.perf_counter):
    """Greedy, blockwise and blockwise(adaptive=True) on `model` over the same batches, timed by race()."""
    fns = {
        "greedy": lambda src: greedy(model, src, max_len=(1.0, 4)),
        "blockwise": lambda src: blockwise(model, src, block_size=block_size, max_len=(1.0, 4)),
        "adaptive": lambda src: blockwise(model, src, block_size=block_size, max_len=(1.0, 4), adaptive=True),
    }
    return race(fns, batches, repeats, clock)


def race(fns: dict, batches, repeats: int = MIN_REPS, clock=time.perf_counter):
    """Decoders (name -> batch -> DecodeResult) timed by bench/protocol.py's measure() with the batches as units.
    Returns (name -> Timing, name -> its results over the batches merged)."""
    results = {n: {} for n in fns}

    def engine(name):
        def run(unit):
            i, src = unit
            r = results[name][i] = fns[name](src)
            return Run(r.tokens, r.calls)

        return run

    t = measure({n: engine(n) for n in fns}, list(enumerate(batches)), repeats, clock=clock)
    return t, {n: DecodeResult.merge([r[i] for i in range(len(batches))]) for n, r in results.items()}


def speeds(t: dict) -> dict:
    """race()'s timings as the row's fields: each decoder's median pass in seconds, and the speedups over greedy
    (the median over batches of the rate ratio; speedup_spread: its quartiles and min-max)."""
    sec = {n: statistics.median(sum(rep) for rep in tm.seconds) for n, tm in t.items()}
    up = {n: speedup(t["greedy"], t[n]) for n in ("blockwise", "adaptive")}
    return {
        "greedy_s": round(sec["greedy"], 4),
        "blockwise_s": round(sec["blockwise"], 4),
        "adaptive_s": round(sec["adaptive"], 4),
        "speedup": round(up["blockwise"]["median"], 3),
        "speedup_spread": {x: round(y, 3) for x, y in up["blockwise"].items()},
        "adaptive_speedup": round(up["adaptive"]["median"], 3),
        "reps": len(t["greedy"].seconds),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny smoke run (numbers meaningless)")
    ap.add_argument(
        "--task",
        choices=("copy", "reverse"),
        default="copy",
        help="reverse needs many more training steps than copy to be learnt",
    )
    ap.add_argument("--vocab", type=int, default=200)
    ap.add_argument("--max-words", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--head-hidden", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--steps4", type=int, default=800, help="training steps of the k=4 model")
    ap.add_argument("--steps8", type=int, default=1500, help="training steps of the k=8 model (k=8 learns slower)")
    ap.add_argument("--train-batch", type=int, default=32)
    ap.add_argument("--eval-sentences", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=MIN_REPS, help=f"timed passes (>= {MIN_REPS})")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--engine",
        action="store_true",
        help="run bench/engine.py instead (step-cost table, CTranslate2 comparison); its flags follow",
    )
    args, rest = ap.parse_known_args()
    if args.engine:
        sys.path.insert(0, str(ROOT / "bench"))
        import engine

        sys.exit(engine.main(rest))
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.repeats < MIN_REPS:
        ap.error(f"--repeats {args.repeats}: the protocol times at least {MIN_REPS} passes (a median needs them)")
    if args.quick:
        args.steps4, args.steps8, args.eval_sentences, args.repeats = 20, 20, 32, MIN_REPS
    torch.set_num_threads(1)  # timing on one core; the machine is shared

    t_start = time.perf_counter()
    sentences, source = load_sentences()
    task = Task(sentences, args.vocab, args.max_words, args.seed, args.task)
    test_rng = random.Random(args.seed + 1)
    task.rng = test_rng
    test = [task.sample(test=True) for _ in range(args.eval_sentences)]
    rows = []
    for k in (4, 8):
        # each model from scratch, all weights, on the BPD loss (head 1 weighted 1/2)
        task.rng = random.Random(args.seed + k)
        torch.manual_seed(args.seed + k)
        model = BPDModel(model_config(task, args, k))
        steps = args.steps4 if k == 4 else args.steps8
        loss, train_s = fit(model, task, args, steps, lr=args.lr)
        srcs = [s + [EOS] for s in test]
        ref = [task.target(s) for s in test]
        g_all = greedy(model, srcs, max_len=(1.0, 4))
        exact = sum(t == r for t, r in zip(g_all.tokens, ref)) / len(ref)
        print(
            f"k={k}: trained {steps} steps in {train_s:.0f}s, final loss {loss:.3f}, greedy exact match {exact:.1%}",
            file=sys.stderr,
        )
        weak = copy.deepcopy(model)  # the same backbone with untrained future heads (they repeat head 1)
        with torch.no_grad():
            weak.heads.fc2.weight.zero_()
            weak.heads.fc2.bias.zero_()
        for heads_name, m in (("trained", model), ("untrained", weak)):
            for bs in (1, 32):
                batches = [srcs[i : i + bs] for i in range(0, len(srcs), bs)]
                if bs == 1:
                    batches = batches[: max(1, len(batches) // 2)]  # half the sentences keep batch-1 timing short
                t, res = time_decoders(m, batches, k, args.repeats)
                rg, rb, ra = res["greedy"], res["blockwise"], res["adaptive"]
                agree = sum(a == b for a, b in zip(rg.tokens, rb.tokens)) / len(rg.tokens)
                agree_a = sum(a == b for a, b in zip(rg.tokens, ra.tokens)) / len(rg.tokens)
                sp = speeds(t)
                up_b, up_a = sp["speedup"], sp["adaptive_speedup"]
                row = {
                    "k": k,
                    "heads": heads_name,
                    "batch": bs,
                    "sentences": len(rg.tokens),
                    "agreement": agree,
                    "k_hat": round(rb.mean_accepted, 3),
                    "calls_greedy": rg.calls,
                    "calls_blockwise": rb.calls,
                    "call_ratio": round(rg.calls / max(rb.calls, 1), 3),
                    "greedy_s": sp["greedy_s"],
                    "blockwise_s": sp["blockwise_s"],
                    "speedup": up_b,
                    "speedup_spread": sp["speedup_spread"],
                    "reps": sp["reps"],
                    "speedup_per_k_hat": round(up_b / rb.mean_accepted, 3),
                    # what speedup / k̂ would be if a blockwise call cost exactly a greedy call and encoding were
                    # free: (greedy calls incl. prefill) / (blockwise calls incl. prefill) / k̂
                    "ideal_speedup_per_k_hat": round(
                        (rg.calls + rg.prefill_calls) / (rb.calls + rb.prefill_calls) / rb.mean_accepted, 3
                    ),
                    "adaptive": {
                        "agreement": agree_a,
                        "k_hat": round(ra.mean_accepted, 3),
                        "calls": ra.calls,
                        "speedup": up_a,
                    },
                    "greedy_exact_match": round(exact, 3),
                    "train_steps": steps,
                    "train_s": round(train_s, 1),
                }
                rows.append(row)
                print(
                    f"  {heads_name:9s} heads, batch {bs:2d}: agreement {agree:.0%}  k̂ {rb.mean_accepted:.2f}  "
                    f"calls {rg.calls}->{rb.calls}  speedup {up_b:.2f}x  speedup/k̂ {up_b / rb.mean_accepted:.2f}"
                    f" | adaptive: agreement {agree_a:.0%} k̂ {ra.mean_accepted:.2f} calls {ra.calls} "
                    f"speedup {up_a:.2f}x",
                    file=sys.stderr,
                )
    targets = {
        "agreement_100": all(r["agreement"] == 1.0 and r["adaptive"]["agreement"] == 1.0 for r in rows),
        "batch1_speedup_per_k_hat_ge_0.8": all(
            r["speedup_per_k_hat"] >= 0.8 for r in rows if r["batch"] == 1 and r["heads"] == "trained"
        ),
        "batch32_speedup_gt_1.5_where_k_hat_ge_3": all(
            r["speedup"] > 1.5 for r in rows if r["batch"] == 32 and r["k_hat"] >= 3
        ),
        "adaptive_never_slower_than_greedy_at_batch1": all(
            r["adaptive"]["speedup"] >= 1.0 for r in rows if r["batch"] == 1
        ),
    }
    print(
        json.dumps(
            {
                "bench": "decode",
                "task": args.task,
                "data": source,
                "device": "cpu",
                "threads": 1,
                "quick": args.quick,
                "model": {
                    "d_model": args.d_model,
                    "layers": args.layers,
                    "vocab": task.vocab_size,
                    "head_d_hidden": args.head_hidden,
                },
                "results": rows,
                "targets_met": targets,
                "total_s": round(time.perf_counter() - t_start, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
