# python bench/hf.py [--threads 1 2] [--batches 1 32] [--new-tokens 32] [--reps 3]  (~10-15 min on a 2-core CPU)
"""Greedy tokens/s of one imported Marian checkpoint in three engines: transformers `generate`,
CTranslate2 (its TransformersConverter on the same folder) and ours (`hf:` -> load_hf -> greedy).

The checkpoint: random weights at opus-mt size (d 512, 6+6 layers, 8 heads, ffn 2048, V 58101, swish, post-norm,
final_logits_bias), written with transformers MarianConfig + save_pretrained into a temp folder, with a
synthetic 58101-entry vocab.json (CTranslate2's converter reads the vocabulary through the tokenizer).
Sources: random token ids, 12-40 tokens + EOS.

Fair lengths: random weights stop at arbitrary points, so every engine generates exactly --new-tokens tokens per
sentence with EOS forbidden (transformers: min_new_tokens = max_new_tokens; CTranslate2: min_decoding_length =
max_decoding_length; ours: EOS added to the model's suppress_ids, the same -inf transformers' min-length
processor puts on EOS). The pad is never generated in any of the three (opus-mt's bad_words_ids in transformers,
the model's suppress_ids in ours; CTranslate2's Marian converter drops the pad row from the vocabulary). Tokens
are compared sentence by sentence (fp32 everywhere), from the first timed pass.

Timing: bench/protocol.py's measure(), the batches of one size as its units: one full untimed warm-up pass of every
engine over every batch, then --reps (>= 3) passes with the engines taking turns batch by batch (who goes first
rotating). Per engine: tokens/s of a pass, median over passes (min-max beside it); ours/CTranslate2 and
ours/transformers: the median over batches of each batch's rate ratio, with its quartiles. No best pass anywhere.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.protocol import MIN_REPS, Run, matches, measure, speedup, tok_s  # noqa: E402
from bpd_train.decoding import greedy  # noqa: E402

OPUS_MT = dict(
    d_model=512,
    encoder_layers=6,
    decoder_layers=6,
    encoder_attention_heads=8,
    decoder_attention_heads=8,
    encoder_ffn_dim=2048,
    decoder_ffn_dim=2048,
    vocab_size=58101,
)


def make_folder(out: Path) -> dict:
    """A Marian checkpoint folder as opus-mt ships it, random weights (seeded)."""
    import sentencepiece as spm
    import transformers

    text = out / "spm.txt"
    text.write_text("\n".join(f"word{i} token{i % 7} piece{i % 13}" for i in range(200)) + "\n")
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(out / "sp"),
        vocab_size=30,
        minloglevel=2,
        bos_id=-1,
        eos_id=1,
        unk_id=2,
        pad_id=-1,
    )
    v = OPUS_MT["vocab_size"]
    pad = v - 1
    vocab = {"</s>": 0, "<unk>": 1}
    vocab.update({f"t{i}": i for i in range(2, pad)})
    vocab["<pad>"] = pad
    (out / "vocab.json").write_text(json.dumps(vocab))
    for name in ("source.spm", "target.spm"):
        (out / name).write_bytes((out / "sp.model").read_bytes())
    transformers.MarianTokenizer(
        str(out / "source.spm"), str(out / "target.spm"), str(out / "vocab.json")
    ).save_pretrained(out)
    cfg = transformers.MarianConfig(
        **OPUS_MT,
        max_position_embeddings=512,
        activation_function="swish",
        scale_embedding=True,
        pad_token_id=pad,
        eos_token_id=0,
        decoder_start_token_id=pad,
        forced_eos_token_id=None,
        dropout=0.0,
    )
    torch.manual_seed(0)
    model = transformers.MarianMTModel(cfg).eval()
    with torch.no_grad():  # opus-mt's bias is zero at the pad and small elsewhere; a non-zero one tests the import
        model.final_logits_bias.normal_(0, 0.1)
    model.generation_config.bad_words_ids = [[pad]]
    model.save_pretrained(out)
    return {i: p for p, i in vocab.items()}


def rounded(spread: dict, nd: int) -> dict:
    return {k: round(v, nd) for k, v in spread.items()}


def time_batches(engines: dict, batches: list, reps: int, n_new: int, clock=time.perf_counter) -> dict:
    """One batch size: bench/protocol.py's measure() over `batches` (engines: ENGINES' names -> batch -> Run), its
    summaries as a row's fields: per engine `<name>_tok_s` (the median pass) and `tok_s_spread` (median, quartiles,
    min-max over passes), ours over each peer per batch (`ours_vs_ctranslate2`, `ours_vs_transformers`), identity
    to transformers from the first timed pass."""
    t = measure(engines, batches, reps, clock=clock)
    ref = t["transformers"]
    n_ref = len(ref.tokens)
    return {
        "sentences": n_ref,
        "new_tokens": n_new,
        "reps": reps,
        **{f"{k}_tok_s": round(tok_s(t[k])["median"], 1) for k in engines},
        "tok_s_spread": {k: rounded(tok_s(t[k]), 1) for k in engines},
        "ours_vs_ctranslate2": rounded(speedup(t["ctranslate2"], t["ours"]), 3),
        "ours_vs_transformers": rounded(speedup(ref, t["ours"]), 3),
        "lengths_equal": all(len(o) == n_new for k in engines for o in t[k].tokens),
        "stable": all(t[k].stable for k in engines),
        "identical_ours_vs_transformers": matches(t["ours"], ref)[0] / n_ref,
        "identical_ct2_vs_transformers": matches(t["ctranslate2"], ref)[0] / n_ref,
    }


def _fmt(s: dict, nd: int = 1, x: str = "", lo: str = "min", hi: str = "max") -> str:
    """'median (min-max)', or with lo/hi p25/p75 'median [quartiles]'."""
    o, c = ("(", ")") if lo == "min" else ("[", "]")
    return f"{s['median']:.{nd}f}{x} {o}{s[lo]:.{nd}f}-{s[hi]:.{nd}f}{c}"


def run(a) -> dict:
    import ctranslate2
    import transformers
    from ctranslate2.converters import TransformersConverter

    from bpd_train.engine.fastlinear import engine_name
    from bpd_train.model import BPDModel
    from bpd_train.sources.convert.hf import load_hf

    torch.set_num_threads(a.threads[0])
    rows = []
    with tempfile.TemporaryDirectory() as d:
        folder = Path(d) / "marian"
        folder.mkdir()
        t0 = time.perf_counter()
        id2piece = make_folder(folder)
        piece2id = {p: i for i, p in id2piece.items()}
        ct2_dir = Path(d) / "ct2"
        TransformersConverter(str(folder)).convert(str(ct2_dir), quantization=None)
        hf = transformers.MarianMTModel.from_pretrained(folder).eval()
        imported, _tok, _meta = load_hf(folder, tokenizer=False)
        c = imported.config
        # no EOS: every engine generates exactly --new-tokens tokens (see the module docstring)
        ours = BPDModel(dataclasses.replace(c, suppress_ids=tuple(sorted({*c.suppress_ids, c.eos_id}))))
        ours.load_state_dict(imported.state_dict())
        ours.eval()
        del imported
        print(f"setup {time.perf_counter() - t0:.1f}s (random opus-mt-size Marian, CTranslate2 conversion)", flush=True)
        g = torch.Generator().manual_seed(1)
        n_sent = max(a.batches) * a.batches_per_size
        lens = torch.randint(12, 41, (n_sent,), generator=g).tolist()
        srcs = [torch.randint(2, c.pad_id, (n,), generator=g).tolist() + [c.eos_id] for n in lens]
        n_new = a.new_tokens

        def pad_batch(batch):
            width = max(map(len, batch))
            ids = torch.full((len(batch), width), c.pad_id, dtype=torch.long)
            for i, s in enumerate(batch):
                ids[i, : len(s)] = torch.tensor(s)
            return ids

        def run_hf(batch):
            ids = pad_batch(batch)
            with torch.inference_mode():
                out = hf.generate(
                    input_ids=ids,
                    attention_mask=ids.ne(c.pad_id),
                    num_beams=1,
                    do_sample=False,
                    max_new_tokens=n_new,
                    min_new_tokens=n_new,
                )
            return Run([r[1:].tolist() for r in out])  # drop the decoder start

        def run_ours(batch):
            with torch.inference_mode():
                return Run(greedy(ours, pad_batch(batch), max_len=n_new).tokens)

        for threads in a.threads:
            torch.set_num_threads(threads)
            tr = ctranslate2.Translator(
                str(ct2_dir), device="cpu", compute_type="float32", inter_threads=1, intra_threads=threads
            )

            def run_ct2(batch):
                r = tr.translate_batch(
                    [[id2piece[i] for i in s[:-1]] for s in batch],
                    beam_size=1,
                    max_decoding_length=n_new,
                    min_decoding_length=n_new,
                    max_batch_size=len(batch),
                )
                return Run([[piece2id[p] for p in h.hypotheses[0]] for h in r])

            engines = {"transformers": run_hf, "ctranslate2": run_ct2, "ours": run_ours}
            for bs in a.batches:
                batches = [srcs[i : i + bs] for i in range(0, bs * a.batches_per_size, bs)]
                row = {"threads": threads, "batch": bs, **time_batches(engines, batches, a.reps, n_new)}
                rows.append(row)
                sp = row["tok_s_spread"]
                print(
                    f"threads={threads} batch={bs:2d} ({a.reps} passes): transformers {_fmt(sp['transformers'])}  "
                    f"CTranslate2 {_fmt(sp['ctranslate2'])}  ours {_fmt(sp['ours'])} tok/s; ours/CTranslate2 "
                    f"{_fmt(row['ours_vs_ctranslate2'], 2, 'x', 'p25', 'p75')}, ours/transformers "
                    f"{_fmt(row['ours_vs_transformers'], 2, 'x', 'p25', 'p75')}; identical to transformers: ours "
                    f"{row['identical_ours_vs_transformers']:.0%}, CTranslate2 {row['identical_ct2_vs_transformers']:.0%}",
                    flush=True,
                )
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next(
        (ln.split(":", 1)[1].strip() for ln in cpu.splitlines() if ln.startswith("Model name")), platform.processor()
    )
    return {
        "bench": "hf",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": model_name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ctranslate2": ctranslate2.__version__,
        "engine": engine_name(),
        "protocol": {"reps": a.reps, "warmup": "one full untimed pass per engine", "units": "batches"},
        "rows": rows,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    p.add_argument("--batches-per-size", type=int, default=3, help="batches timed per batch size (default 3)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated per sentence (default 32)")
    p.add_argument("--reps", type=int, default=MIN_REPS, help=f"timed passes (>= {MIN_REPS}; default {MIN_REPS})")
    a = p.parse_args(argv)
    if a.reps < MIN_REPS:
        p.error(f"--reps {a.reps}: the protocol times at least {MIN_REPS} passes")
    print(json.dumps(run(a)))


if __name__ == "__main__":
    main()
