# python bench/data.py                 (bundled corpus; --max-tokens 4096 --vocab-size 8000 --repeats 3)
"""Data pipeline benchmark, ratios measured in one run.

1. Padding efficiency = real tokens / padded tokens, over both padded tensors a batch makes
   (src [B,S] and tgt_in [B,T]; tgt_out has tgt_in's shape), for the training split:
   token-bucketed batches (TokenBucketBatchSampler) vs random batches under the same token budget
   (examples in random order, cut greedily so rows * max(length) <= max_tokens). Target: bucketed >= 0.9.
2. Tokenization throughput (datasets.map) with num_proc=1 vs num_proc=2: runs interleaved (1, 2, 1, 2, ...),
   datasets caching off so every run tokenizes; the best run of each is compared.
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default=str(Path(bpd_train.REPO_ROOT) / "conf" / "data" / "bible_en_fr.yaml"))
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--vocab-size", type=int, default=8000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--artifacts", default=None, help="where the tokenizer is cached (default: a temp dir)")
    args = ap.parse_args()

    cfg = OmegaConf.load(args.data)
    cfg.spm.vocab_size = args.vocab_size
    with tempfile.TemporaryDirectory() as tmp:
        art = Path(args.artifacts) if args.artifacts else Path(tmp) / "artifacts"
        corpus = load_corpus(cfg, cache_dir=Path(tmp) / "hf")
        train = corpus["train"]
        t0 = time.perf_counter()
        tok = get_tokenizer(cfg, art, train)
        spm_s = time.perf_counter() - t0

        # ---- tokenization throughput, num_proc 1 vs 2, interleaved
        datasets.disable_caching()
        times = {1: [], 2: []}
        enc = None
        for _ in range(args.repeats):
            for n in (1, 2):
                t0 = time.perf_counter()
                enc, _ = tokenize_split(train, tok, cfg, "train", num_proc=n)
                times[n].append(time.perf_counter() - t0)
        eps = {n: len(train) / min(ts) for n, ts in times.items()}

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
        "tokenize": {
            "examples_per_s_num_proc_1": round(eps[1]),
            "examples_per_s_num_proc_2": round(eps[2]),
            "speedup_2_over_1": round(eps[2] / eps[1], 3),
            "cpu_count": os.cpu_count(),
            "runs_s": {str(k): [round(x, 3) for x in v] for k, v in times.items()},
        },
    }
    print(
        f"padding efficiency: bucketed {eff['bucketed']:.3f} vs random {eff['random']:.3f}; "
        f"tokenization: {eps[1]:.0f} ex/s (num_proc=1) vs {eps[2]:.0f} ex/s (num_proc=2)",
        file=sys.stderr,
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
