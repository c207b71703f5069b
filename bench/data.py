# python bench/data.py                 (bundled corpus; --max-tokens 4096 --vocab-size 8000 --repeats 3)
"""Data pipeline benchmark, ratios measured in one run.

1. Padding efficiency = real tokens / padded tokens, over both padded tensors a batch makes
   (src [B,S] and tgt_in [B,T]; tgt_out has tgt_in's shape), for the training split:
   token-bucketed batches (TokenBucketBatchSampler) vs random batches under the same token budget
   (examples in random order, cut greedily so rows * max(length) <= max_tokens). Target: bucketed >= 0.9.
2. Tokenization throughput (datasets.map) with num_proc=1 vs num_proc=2, datasets caching off so every run
   tokenizes, timed by bench/protocol.py's measure(): one untimed warm-up run of each, then --repeats (>= 3) timed
   runs of each, the two taking turns (who goes first alternating). examples/s: the median run (spread beside it);
   speedup: 2's median run over 1's (the split is one unit), with the spread of the ratio pass by pass.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import datasets  # noqa: E402
import numpy as np  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

import bpd_train  # noqa: E402,F401  (registers ${repo_root:})
from bench.protocol import MIN_REPS, Run, measure, pass_speedup, speedup, spread  # noqa: E402
from bpd_train.data import TokenBucketBatchSampler, get_tokenizer, load_corpus, tokenize_split  # noqa: E402


def _efficiency(batches, src_len, tgt_len) -> float:
    real = padded = 0
    for b in batches:
        s, t = src_len[b], tgt_len[b]
        real += int(s.sum() + t.sum())
        padded += len(b) * int(s.max() + t.max())
    return real / padded


def _random_batches(lengths: np.ndarray, max_tokens: int, seed: int) -> list[np.ndarray]:
    order = np.random.default_rng(seed).permutation(len(lengths))
    batches, cur, cur_max = [], [], 0
    for i in order:
        m = max(cur_max, int(lengths[i]))
        if cur and (len(cur) + 1) * m > max_tokens:
            batches.append(np.asarray(cur))
            cur, m = [], int(lengths[i])
        cur.append(i)
        cur_max = m
    if cur:
        batches.append(np.asarray(cur))
    return batches


def tokenize_race(fns: dict, examples: int, repeats: int, clock=time.perf_counter) -> dict:
    """Time fns {num_proc: a function tokenizing the split} under the protocol, the whole split as one unit;
    the tokenize JSON's timing fields."""
    engines = {n: (lambda _unit, f=f: (f(), Run([[0] * examples]))[1]) for n, f in fns.items()}
    t = measure(engines, [None], repeats, clock=clock)
    rate = {n: spread([examples / rep[0] for rep in t[n].seconds]) for n in fns}
    per_pass = pass_speedup(t[1], t[2])
    return {
        "examples_per_s_num_proc_1": round(rate[1]["median"]),
        "examples_per_s_num_proc_2": round(rate[2]["median"]),
        "speedup_2_over_1": round(speedup(t[1], t[2])["median"], 3),
        "examples_per_s_spread": {str(n): {k: round(v) for k, v in r.items()} for n, r in rate.items()},
        "speedup_spread": {k: round(v, 3) for k, v in per_pass.items()},
        "runs_s": {str(n): [round(rep[0], 3) for rep in t[n].seconds] for n in fns},
        "repeats": repeats,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(Path(bpd_train.REPO_ROOT) / "conf" / "data" / "bible_en_fr.yaml"))
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument(
        "--repeats", type=int, default=3, help=f"timed runs of each tokenization (>= {MIN_REPS}); padding epochs"
    )
    ap.add_argument("--artifacts", default=None, help="where the tokenizer is cached (default: a temp dir)")
    args = ap.parse_args(argv)
    if args.repeats < MIN_REPS:
        ap.error(f"--repeats {args.repeats}: the protocol times at least {MIN_REPS} passes (a median needs them)")

    cfg = OmegaConf.load(args.data)
    cfg.spm.vocab_size = args.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        art = Path(args.artifacts) if args.artifacts else Path(tmp) / "artifacts"
        corpus = load_corpus(cfg, cache_dir=Path(tmp) / "hf")
        train = corpus["train"]
        t0 = time.perf_counter()
        tok = get_tokenizer(cfg, art, train)
        spm_s = time.perf_counter() - t0

        # ---- tokenization throughput, num_proc 1 vs 2, under the protocol
        datasets.disable_caching()
        done = {}

        def tokenize(n):
            done["enc"], _ = tokenize_split(train, tok, cfg, "train", num_proc=n)

        tokenized = tokenize_race({n: (lambda n=n: tokenize(n)) for n in (1, 2)}, len(train), args.repeats)
        enc = done["enc"]

        # ---- padding efficiency, bucketed vs random under the same budget
        src_len = np.asarray([len(s) for s in enc["src"]])
        tgt_len = np.asarray([len(t) + 1 for t in enc["tgt"]])
        lengths = np.asarray(enc["length"])
        effs = {"bucketed": [], "random": []}
        n_batches = {}
        for epoch in range(args.repeats):
            s = TokenBucketBatchSampler(lengths, args.max_tokens, seed=0)
            s.set_epoch(epoch)
            bb = [np.asarray(b) for b in s]
            rb = _random_batches(lengths, args.max_tokens, seed=epoch)
            effs["bucketed"].append(_efficiency(bb, src_len, tgt_len))
            effs["random"].append(_efficiency(rb, src_len, tgt_len))
            n_batches = {"bucketed": len(bb), "random": len(rb)}
        eff = {k: float(np.mean(v)) for k, v in effs.items()}

    result = {
        "bench": "data",
        "corpus": cfg.name,
        "pairs": {k: len(v) for k, v in corpus.items()},
        "train_kept": len(enc),
        "vocab_size": tok.vocab_size,
        "spm_train_s": round(spm_s, 2),
        "max_tokens": args.max_tokens,
        "padding_efficiency": {
            "bucketed": round(eff["bucketed"], 4),
            "random": round(eff["random"], 4),
            "bucketed_over_random": round(eff["bucketed"] / eff["random"], 3),
            "batches_per_epoch": n_batches,
            "target_bucketed": 0.9,
            "meets_target": eff["bucketed"] >= 0.9,
        },
        "tokenize": {**tokenized, "cpu_count": os.cpu_count()},
    }
    print(
        f"padding efficiency: bucketed {eff['bucketed']:.3f} vs random {eff['random']:.3f}; "
        f"tokenization: {tokenized['examples_per_s_num_proc_1']} ex/s (num_proc=1) vs "
        f"{tokenized['examples_per_s_num_proc_2']} ex/s (num_proc=2), median of {args.repeats}",
        file=sys.stderr,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
