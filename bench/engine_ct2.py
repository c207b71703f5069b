"""CTranslate2 against this project's engine on the same weights, for bench/engine.py: a model written as a
CTranslate2 Transformer spec, greedy tokens/s on random weights and on a trained bundle.

Timing: bench/protocol.py's measure() for ours and CTranslate2 alike (one full untimed warm-up pass of every engine
over every unit, then `reps` >= 3 passes with the engines taking turns unit by unit, who goes first rotating); the
units are the batches of one size (bench_ct2) or the sources at batch 1 (bench_bundle). Tokens/s: the median pass,
min-max beside it; ours over CTranslate2: the median over units of each unit's rate ratio, with its quartiles.
Outputs are compared from the first timed pass. No best pass anywhere."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from bench.protocol import MIN_REPS, Run, matches, measure, speedup, tok_s
from bpd_train.decoding import greedy
from bpd_train.engine.packed import DecodeOptions
from bpd_train.engine.weights import PackedWeights
from bpd_train.model import BPDConfig, BPDModel

ROOT = Path(__file__).resolve().parent.parent


def rounded(spread: dict, nd: int) -> dict:
    return {k: round(v, nd) for k, v in spread.items()}


def _fmt(s: dict, nd: int = 1, x: str = "", lo: str = "min", hi: str = "max") -> str:
    """'median (min-max)', or with lo/hi p25/p75 'median [quartiles]'."""
    o, c = ("(", ")") if lo == "min" else ("[", "]")
    return f"{s['median']:.{nd}f}{x} {o}{s[lo]:.{nd}f}-{s[hi]:.{nd}f}{c}"


def ours_vs_ct2(ours, ct2, batches: list, reps: int = MIN_REPS, clock=time.perf_counter) -> dict:
    """One cell of bench_ct2: measure() over `batches` with ours and CTranslate2 (batch -> Run), as a row's fields:
    `ours_tok_s` / `ct2_tok_s` (the median pass), `tok_s_spread` (per engine: median, quartiles, min-max over
    passes), `ratio` (ours over CTranslate2: the median over batches of the rate ratio) with `ratio_spread`, and
    `identical` (the share of sentences whose ids agree, first timed pass)."""
    t = measure({"ours": ours, "ct2": ct2}, batches, reps, clock=clock)
    same, n = matches(t["ours"], t["ct2"])
    r = speedup(t["ct2"], t["ours"])
    return dict(
        reps=reps,
        ours_tok_s=round(tok_s(t["ours"])["median"], 1),
        ct2_tok_s=round(tok_s(t["ct2"])["median"], 1),
        ratio=round(r["median"], 2),
        tok_s_spread={k: rounded(tok_s(v), 1) for k, v in t.items()},
        ratio_spread=rounded(r, 3),
        identical=round(same / n, 3),
        stable=t["ours"].stable and t["ct2"].stable,
    )


def to_ct2(m: BPDModel, out_dir: str) -> list[str]:
    """Write `m` (pre-norm Transformer, tied embeddings, sinusoidal positions) as a CTranslate2 model."""
    from ctranslate2.specs import transformer_spec

    c = m.config
    spec = transformer_spec.TransformerSpec.from_config(
        (c.n_encoder_layers, c.n_decoder_layers), c.n_heads, pre_norm=True
    )
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    pe = m.pe.numpy()

    def ln(dst, name):
        dst.gamma, dst.beta = sd[f"{name}.weight"], sd[f"{name}.bias"]

    def lin(dst, name):
        dst.weight, dst.bias = sd[f"{name}.weight"], sd[f"{name}.bias"]

    for side, spec_side in (("encoder", spec.encoder), ("decoder", spec.decoder)):
        emb = spec_side.embeddings[0] if side == "encoder" else spec_side.embeddings
        emb.weight = sd["embed.weight"]
        emb.multiply_by_sqrt_depth = True
        spec_side.position_encodings.encodings = pe
        ln(spec_side.layer_norm, f"{side}_norm")
        for i, layer in enumerate(spec_side.layer):
            p = f"{side}_layers.{i}"
            if side == "encoder":
                ln(layer.self_attention.layer_norm, f"{p}.norm1")
                lin(layer.self_attention.linear[0], f"{p}.attn.qkv")
                lin(layer.self_attention.linear[1], f"{p}.attn.out")
                ln(layer.ffn.layer_norm, f"{p}.norm2")
            else:
                ln(layer.self_attention.layer_norm, f"{p}.norm1")
                lin(layer.self_attention.linear[0], f"{p}.self_attn.qkv")
                lin(layer.self_attention.linear[1], f"{p}.self_attn.out")
                ln(layer.attention.layer_norm, f"{p}.norm2")
                lin(layer.attention.linear[0], f"{p}.cross_attn.q")
                lin(layer.attention.linear[1], f"{p}.cross_attn.kv")
                lin(layer.attention.linear[2], f"{p}.cross_attn.out")
                ln(layer.ffn.layer_norm, f"{p}.norm3")
            lin(layer.ffn.linear_0, f"{p}.ffn.fc1")
            lin(layer.ffn.linear_1, f"{p}.ffn.fc2")
    spec.decoder.projection.weight = sd["embed.weight"]
    vocab = ["<blank>", "<s>", "</s>", "<unk>"] + [f"t{i}" for i in range(4, c.vocab_size)]
    spec.register_source_vocabulary(vocab)
    spec.register_target_vocabulary(vocab)
    spec.config.bos_token, spec.config.eos_token, spec.config.unk_token = "<s>", "</s>", "<unk>"
    spec.config.decoder_start_token = "<s>"
    spec.validate()
    spec.optimize(quantization=None)
    spec.save(out_dir)
    return vocab


def bench_ct2(make_model, threads, batch_sizes, n_sent: int = 64, size: str = "base", reps: int = MIN_REPS):
    """Greedy tokens/s, ours against CTranslate2, on random sources; make_model() builds the greedy-only model of
    `size` (only once CTranslate2 is there to compare with). Each (threads, precision, batch size): ours_vs_ct2()."""
    try:
        import ctranslate2
    except ImportError:
        print("ctranslate2 not installed: pip install ctranslate2==4.8.5 (skipping the comparison)")
        return None
    m = make_model()
    v = m.config.vocab_size
    g = torch.Generator().manual_seed(2)
    lens = torch.randint(12, 40, (n_sent,), generator=g).tolist()
    srcs = [torch.randint(4, v, (n,), generator=g).tolist() + [m.config.eos_id] for n in lens]
    max_len = 48
    rows = []
    with tempfile.TemporaryDirectory() as d:
        vocab = to_ct2(m, d)
        index = {x: i for i, x in enumerate(vocab)}
        for t in threads:
            torch.set_num_threads(t)
            for ct2_type, our_dtype in (("float32", "fp32"), ("int8", "int8")):
                tr = ctranslate2.Translator(d, device="cpu", compute_type=ct2_type, inter_threads=1, intra_threads=t)
                pw = PackedWeights(DecodeOptions(dtype=our_dtype))

                def ours(batch, pw=pw):
                    return Run(greedy(m, batch, max_len=max_len, weights=pw).tokens)

                def ct2(batch, tr=tr):
                    r = tr.translate_batch(
                        [[vocab[i] for i in s] for s in batch],
                        beam_size=1,
                        max_decoding_length=max_len,
                        max_batch_size=len(batch),
                    )
                    return Run([[index[x] for x in h.hypotheses[0]] for h in r])

                for bs in batch_sizes:
                    batches = [srcs[i : i + bs] for i in range(0, n_sent, bs)]
                    row = dict(size=size, threads=t, dtype=our_dtype, batch=bs, **ours_vs_ct2(ours, ct2, batches, reps))
                    rows.append(row)
                    sp = row["tok_s_spread"]
                    print(
                        f"greedy tok/s {size} threads={t} {our_dtype:4s} (CT2 {ct2_type}) batch {bs:2d} ({reps} passes): "
                        f"ours {_fmt(sp['ours'])}  CTranslate2 {_fmt(sp['ct2'])}  ratio "
                        f"{_fmt(row['ratio_spread'], 2, 'x', 'p25', 'p75')}  identical outputs {row['identical']:.0%}",
                        flush=True,
                    )
    return rows


def time_decoders(fns: dict, srcs: list, reps: int = MIN_REPS, clock=time.perf_counter) -> list[dict]:
    """bench_bundle's timing: measure() over the sources at batch 1 (fns: name -> source -> Run; CTranslate2's named
    'CTranslate2 greedy float32' / '... int8', ours with 'greedy fp32' and 'greedy int8'), one row per decoder:
    `tok_s` (the median pass) with `tok_s_spread`, `vs_ct2` (over CTranslate2 greedy of the same precision, median
    over sources of the rate ratio, with quartiles; where CTranslate2 ran), `same_as_greedy` (ids as our greedy of
    that precision, first timed pass)."""
    t = measure(fns, srcs, reps, clock=clock)
    rows = []
    for name, tm in t.items():
        int8 = "int8" in name
        ref = t["greedy int8" if int8 else "greedy fp32"]
        same, n = matches(tm, ref)
        row = dict(
            decoder=name,
            reps=reps,
            tok_s=round(tok_s(tm)["median"], 1),
            tok_s_spread=rounded(tok_s(tm), 1),
            same_as_greedy=round(same / n, 3),
            stable=tm.stable,
        )
        peer = f"CTranslate2 greedy {'int8' if int8 else 'float32'}"
        if peer in t and peer != name:
            row["vs_ct2"] = rounded(speedup(t[peer], tm), 3)
        rows.append(row)
    return rows


def bench_bundle(bundle: str, threads: int = 1, n_sent: int = 80, draft_vocab: int = 1000, reps: int = MIN_REPS):
    """A trained bundle on the bundled validation sources at batch 1: CTranslate2 greedy (fp32, int8) on the
    bundle's backbone vs our greedy and exact blockwise (plain, draft vocabulary, adaptive). Tokens/s, by
    time_decoders()."""
    import gzip

    from bpd_train.app.export import load_bundle
    from bpd_train.decoding import blockwise
    from bpd_train.decoding.settings import draft_vocabulary

    torch.set_num_threads(threads)
    m, sp, _ = load_bundle(bundle)
    c = m.config
    with gzip.open(ROOT / "data" / "bible-en-fr" / "validation.jsonl.gz", "rt", encoding="utf-8") as f:
        lines = [json.loads(x)["translation"]["en"] for x in f]
    step = max(1, len(lines) // n_sent)
    srcs = [sp.encode(t, out_type=int)[: c.max_positions - 1] + [c.eos_id] for t in lines[::step][:n_sent]]
    max_len = (1.5, 10)
    draft = draft_vocabulary(sp, draft_vocab, c.eos_id)
    ours = {
        "greedy fp32": (DecodeOptions(), lambda pw, s: greedy(m, [s], max_len=max_len, weights=pw)),
        f"blockwise k={c.block_size} exact fp32": (
            DecodeOptions(),
            lambda pw, s: blockwise(m, [s], max_len=max_len, weights=pw),
        ),
        f"blockwise k={c.block_size} exact fp32, draft {draft_vocab}": (
            DecodeOptions(draft_vocab=draft),
            lambda pw, s: blockwise(m, [s], max_len=max_len, weights=pw),
        ),
        f"blockwise k={c.block_size} exact fp32, adaptive": (
            DecodeOptions(),
            lambda pw, s: blockwise(m, [s], max_len=max_len, adaptive=True, weights=pw),
        ),
        "greedy int8": (DecodeOptions(dtype="int8"), lambda pw, s: greedy(m, [s], max_len=max_len, weights=pw)),
        f"blockwise k={c.block_size} exact int8": (
            DecodeOptions(dtype="int8"),
            lambda pw, s: blockwise(m, [s], max_len=max_len, weights=pw),
        ),
    }
    # one packed-weight cache per decoder: switching options on one cache repacked the weights on every call, and
    # the packing was charged to whichever decoder came first after a switch
    models = {name: PackedWeights(opts) for name, (opts, _) in ours.items()}
    try:
        import ctranslate2
    except ImportError:
        ctranslate2 = None
    with tempfile.TemporaryDirectory() as d:
        fns = {}
        if ctranslate2 is not None:
            backbone = BPDModel(BPDConfig(**{**c.to_dict(), "block_size": 1})).eval()
            backbone.load_state_dict({n: t for n, t in m.state_dict().items() if not n.startswith("heads.")})
            vocab = to_ct2(backbone, d)
            index = {x: i for i, x in enumerate(vocab)}
            for ct2_type in ("float32", "int8"):
                tr = ctranslate2.Translator(d, device="cpu", compute_type=ct2_type, intra_threads=threads)

                def run_ct2(s, tr=tr):
                    n = len(s)
                    r = tr.translate_batch(
                        [[vocab[i] for i in s]], beam_size=1, max_decoding_length=int(max_len[0] * n + max_len[1])
                    )
                    return Run([[index[x] for x in r[0].hypotheses[0]]])

                fns[f"CTranslate2 greedy {ct2_type}"] = run_ct2
        for name, (_, fn) in ours.items():
            fns[name] = lambda s, mm=models[name], fn=fn: Run(fn(mm, s).tokens)
        rows = time_decoders(fns, srcs, reps)
        for row in rows:
            vs = f"  {_fmt(row['vs_ct2'], 2, 'x', 'p25', 'p75')} vs CTranslate2" if "vs_ct2" in row else ""
            print(
                f"bundle {Path(bundle).name} threads={threads} batch 1 ({reps} passes): {row['decoder']:45s} "
                f"{_fmt(row['tok_s_spread'])} tok/s{vs}  same output as our greedy of that precision: "
                f"{row['same_as_greedy']:.0%}",
                flush=True,
            )
    return rows
