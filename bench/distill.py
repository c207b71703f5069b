# Run: python bench/distill.py [--teacher PATH] [--sentences 64] [--reps 3] [--threads 1] [--device cpu|cuda]
"""Teacher beam-search throughput for distillation, as ratios measured in one run: sentences/s of beam 4 at batch 64
vs batch 1, and of beam 4 vs greedy. Timed by bench/protocol.py's measure(), the whole set of sentences one unit:
one untimed warm-up run of every config, then --reps (>= 3) passes in which the configs take turns (who goes first
rotating), CUDA synchronised around every timed run; sentences/s is the median run (spread beside it), ratios are
of the median runs. The decoding path is the one
`python distill.py` uses (length-sorted, token-budget batches, KV cache). Without --teacher it times a
random Transformer (vocab 8000, d_model 256, 3+3 layers) on real Bible source lengths; a random model never
emits EOS, so every sentence runs to its max_len (the worst case for beam search's early finish).
The last line of output is one JSON object."""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.protocol import MIN_REPS, Run, measure, spread  # noqa: E402
from bpd_train.decoding.batched import translate_ids  # noqa: E402
from bpd_train.model import BPDConfig, BPDModel  # noqa: E402


def sources(n: int, sp=None, vocab: int = 8000) -> list[list[int]]:
    """The first n English verses: real pieces with a teacher's tokenizer, else random ids of real lengths."""
    with gzip.open(REPO / "data/bible-en-fr/train.jsonl.gz", "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["translation"]["en"] for _, line in zip(range(n), f)]
    if sp is not None:
        return [ids + [2] for ids in sp.encode(texts)]
    g = torch.Generator().manual_seed(0)
    lens = [max(1, round(1.3 * len(t.split()))) for t in texts]  # ~1.3 pieces per word at an 8k vocabulary
    return [torch.randint(4, vocab, (n_,), generator=g).tolist() + [2] for n_ in lens]


def race(fns: dict, sentences: int, reps: int, clock=time.perf_counter, sync=None) -> tuple[dict, dict, dict]:
    """Time fns {config: a function decoding every sentence -> [(ids, score), ...]} under the protocol, all the
    sentences one unit. Returns (config -> sentences/s of the median run, config -> its spread over runs,
    config -> the outputs of its last run)."""
    outputs = {}

    def engine(name, f):
        def run(_unit):
            outputs[name] = f()
            return Run([list(ids) for ids, _ in outputs[name]])

        return run

    t = measure({n: engine(n, f) for n, f in fns.items()}, [None], reps, clock=clock, sync=sync)
    rate = {n: spread([sentences / rep[0] for rep in t[n].seconds]) for n in fns}
    return {n: sentences / statistics.median(rep[0] for rep in t[n].seconds) for n in fns}, rate, outputs


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--teacher", default=None, help="checkpoint, run folder or bundle (default: a random model)")
    ap.add_argument("--sentences", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3, help=f"timed runs of each config after a warm-up (>= {MIN_REPS})")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-len", type=float, nargs=2, default=(1.2, 8), metavar=("A", "B"))
    args = ap.parse_args(argv)
    if args.reps < MIN_REPS:
        ap.error(f"--reps {args.reps}: the protocol times at least {MIN_REPS} passes (a median needs them)")
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    if args.teacher:
        from bpd_train.sources.loading import load

        loaded = load(args.teacher)
        model, sp, what = loaded.model, loaded.tokenizer(), str(loaded.source)
    else:
        torch.manual_seed(0)
        model = BPDModel(
            BPDConfig(
                vocab_size=8000,
                d_model=256,
                n_heads=4,
                n_encoder_layers=3,
                n_decoder_layers=3,
                d_ff=1024,
                max_positions=256,
                dropout=0.0,
            )
        )
        sp, what = None, "random"
    model = model.to(dev).eval()
    src = sources(args.sentences, sp, model.config.vocab_size)
    configs = {  # name -> (beam size, sentences per batch)
        "beam4_batch64": (4, 64),
        "beam4_batch1": (4, 1),
        "greedy_batch64": (1, 64),
        "greedy_batch1": (1, 1),
    }
    ml = tuple(args.max_len)

    def decode(beam: int, bs: int):
        return translate_ids(
            model, src, beam_size=beam, length_penalty=0.6, max_len=ml, max_tokens=1 << 30, max_sentences=bs, device=dev
        )

    def same(a, b) -> bool:
        return all(ta == tb and (sa == sb or abs(sa - sb) <= 1e-3) for (ta, sa), (tb, sb) in zip(a, b, strict=True))

    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else None
    fns = {name: (lambda cfg=cfg: decode(*cfg)) for name, cfg in configs.items()}
    sps, spreads, outputs = race(fns, args.sentences, args.reps, sync=sync)
    tokens = {name: sum(len(t) for t, _ in out) for name, out in outputs.items()}
    for name in configs:
        print(f"{name:16s} {sps[name]:9.1f} sentences/s  ({tokens[name]} tokens, median of {args.reps})")
    result = {
        "bench": "distill",
        "teacher": what,
        "device": str(dev),
        "threads": args.threads,
        "sentences": args.sentences,
        "reps": args.reps,
        "max_len": list(ml),
        "sentences_per_s": {k: round(v, 2) for k, v in sps.items()},
        "sentences_per_s_spread": {n: {k: round(v, 2) for k, v in r.items()} for n, r in spreads.items()},
        "batch64_vs_batch1_beam4": round(sps["beam4_batch64"] / sps["beam4_batch1"], 2),
        "batch64_vs_batch1_greedy": round(sps["greedy_batch64"] / sps["greedy_batch1"], 2),
        "beam4_vs_greedy_batch64": round(sps["beam4_batch64"] / sps["greedy_batch64"], 3),
        "beam4_vs_greedy_batch1": round(sps["beam4_batch1"] / sps["greedy_batch1"], 3),
        # decoders promise results independent of batch composition (fp32): check it on the way
        # tokens exactly; scores to 1e-3 (fp32 attention over padded keys moves the 4th decimal by one)
        "batch_invariant": all(same(outputs[f"{d}_batch64"], outputs[f"{d}_batch1"]) for d in ("beam4", "greedy")),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
