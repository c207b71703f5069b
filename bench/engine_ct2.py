"""CTranslate2 against this project's engine on the same weights, for bench/engine.py: a model written as a
CTranslate2 Transformer spec, greedy tokens/s on random weights and on a trained bundle."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from bpd_train.decoding import greedy
from bpd_train.engine.packed import DecodeOptions
from bpd_train.model import BPDConfig, BPDModel

ROOT = Path(__file__).resolve().parent.parent


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


def bench_ct2(make_model, threads, batch_sizes, n_sent: int = 64, size: str = "base"):
    """Greedy tokens/s, ours against CTranslate2, on random sources; make_model() builds the greedy-only model of
    `size` (only once CTranslate2 is there to compare with)."""
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
        toks = [[vocab[i] for i in s] for s in srcs]
        index = {x: i for i, x in enumerate(vocab)}
        for t in threads:
            torch.set_num_threads(t)
            for ct2_type, our_dtype in (("float32", "fp32"), ("int8", "int8")):
                tr = ctranslate2.Translator(d, device="cpu", compute_type=ct2_type, inter_threads=1, intra_threads=t)
                m.decode_options = DecodeOptions(dtype=our_dtype)
                for bs in batch_sizes:
                    res = {"ours": [], "ct2": []}
                    ours_out, ct2_out = [], []
                    for rep in range(2):  # interleaved A B A B over the same batches
                        for i in range(0, n_sent, bs):
                            for who in ("ours", "ct2") if rep % 2 == 0 else ("ct2", "ours"):
                                t0 = time.perf_counter()
                                if who == "ours":
                                    out = greedy(m, srcs[i : i + bs], max_len=max_len).tokens
                                else:
                                    r = tr.translate_batch(
                                        toks[i : i + bs], beam_size=1, max_decoding_length=max_len, max_batch_size=bs
                                    )
                                    out = [[index[x] for x in h.hypotheses[0]] for h in r]
                                el = time.perf_counter() - t0
                                res[who].append((el, sum(len(o) for o in out)))
                                if rep == 0:
                                    (ours_out if who == "ours" else ct2_out).extend(out)
                    tps = {who: sum(n for _, n in v_) / sum(e for e, _ in v_) for who, v_ in res.items()}
                    same = sum(a == b for a, b in zip(ours_out, ct2_out)) / len(ours_out)
                    row = dict(
                        size=size,
                        threads=t,
                        dtype=our_dtype,
                        batch=bs,
                        ours_tok_s=round(tps["ours"], 1),
                        ct2_tok_s=round(tps["ct2"], 1),
                        ratio=round(tps["ours"] / tps["ct2"], 2),
                        identical=round(same, 3),
                    )
                    rows.append(row)
                    print(
                        f"greedy tok/s {size} threads={t} {our_dtype:4s} (CT2 {ct2_type}) batch {bs:2d}: ours "
                        f"{tps['ours']:7.1f}  CTranslate2 {tps['ct2']:7.1f}  ratio {tps['ours'] / tps['ct2']:.2f}  "
                        f"identical outputs {same:.0%}",
                        flush=True,
                    )
    return rows


def bench_bundle(bundle: str, threads: int = 1, n_sent: int = 80, draft_vocab: int = 1000):
    """A trained bundle on the bundled validation sources at batch 1: CTranslate2 greedy (fp32, int8) on the
    bundle's backbone vs our greedy and exact blockwise (plain, draft vocabulary, adaptive). Tokens/s."""
    import gzip

    from bpd_train.decoding import blockwise
    from bpd_train.decoding.settings import draft_vocabulary
    from bpd_train.export import load_bundle

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
        "greedy fp32": (DecodeOptions(), lambda mm, s: greedy(mm, [s], max_len=max_len)),
        f"blockwise k={c.block_size} exact fp32": (DecodeOptions(), lambda mm, s: blockwise(mm, [s], max_len=max_len)),
        f"blockwise k={c.block_size} exact fp32, draft {draft_vocab}": (
            DecodeOptions(draft_vocab=draft),
            lambda mm, s: blockwise(mm, [s], max_len=max_len),
        ),
        f"blockwise k={c.block_size} exact fp32, adaptive": (
            DecodeOptions(),
            lambda mm, s: blockwise(mm, [s], max_len=max_len, adaptive=True),
        ),
        "greedy int8": (DecodeOptions(dtype="int8"), lambda mm, s: greedy(mm, [s], max_len=max_len)),
        f"blockwise k={c.block_size} exact int8": (
            DecodeOptions(dtype="int8"),
            lambda mm, s: blockwise(mm, [s], max_len=max_len),
        ),
    }
    # one model per decoder: switching options on one model repacked its weights on every call, and the packing
    # was charged to whichever decoder came first after a switch
    import copy

    models = {name: copy.deepcopy(m) for name in ours}
    for name, (opts, _) in ours.items():
        models[name].decode_options = opts
    rows = []
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
                    return [index[x] for x in r[0].hypotheses[0]]

                fns[f"CTranslate2 greedy {ct2_type}"] = (None, run_ct2)
        fns.update(ours)
        totals = {name: [0.0, 0] for name in fns}
        outs = {name: [] for name in fns}
        for rep in range(2):
            for s in srcs:
                for name, (opts, fn) in fns.items():
                    t0 = time.perf_counter()
                    r = fn(s) if opts is None else fn(models[name], s)
                    el = time.perf_counter() - t0
                    toks = r if isinstance(r, list) else r.tokens[0]
                    if rep == 1:  # the first pass warms caches and builds packed weights
                        totals[name][0] += el
                        totals[name][1] += len(toks)
                        outs[name].append(toks)
        ref = outs["greedy fp32"]
        for name, (sec, ntok) in totals.items():
            same = sum(a == b for a, b in zip(outs[name], ref if "int8" not in name else outs["greedy int8"]))
            rows.append(dict(decoder=name, tok_s=round(ntok / sec, 1), same_as_greedy=round(same / len(ref), 3)))
            print(
                f"bundle {Path(bundle).name} threads={threads} batch 1: {name:45s} {ntok / sec:8.1f} tok/s  "
                f"same output as our greedy of that precision: {same / len(ref):.0%}",
                flush=True,
            )
    return rows
