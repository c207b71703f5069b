# python bench/engine.py [--threads 1 2] [--sizes demo base] [--skip-ct2]      (~3-6 min on a 2-core CPU)
"""The CPU decode engine, measured in one run (issue 11).

1. Step cost: one blockwise step at batch 1 (decode k tokens + head 1 at the k positions + heads 2..k at the
   accepted position) in units of one greedy step (decode 1 token + head 1), median of interleaved steps,
   random weights, at demo size (d 128, 3+3 layers, V 4k) and Transformer-base size (d 512, 6+6, ffn 2048,
   V 32k), k = 2, 4, 8, 1 and 2 threads: this project's engine (packed kernels) vs torch's F.linear path,
   and with the proposal pass over a draft vocabulary of the V/4 most frequent ids.
2. Greedy tokens/s against CTranslate2 (fp32 and int8) on the SAME weights (our model written as a
   CTranslate2 Transformer spec), batch 1 and 32, tokens checked identical in fp32.
The last line printed is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bpd_train.decoding import greedy  # noqa: E402
from bpd_train.model import BPDConfig, BPDModel  # noqa: E402
from bpd_train.model.fastlinear import engine_name, native_kernels  # noqa: E402
from bpd_train.model.packed import DecodeOptions  # noqa: E402

SIZES = {
    "demo": dict(vocab_size=4000, d_model=128, n_heads=4, n_encoder_layers=3, n_decoder_layers=3, d_ff=512),
    "base": dict(vocab_size=32000, d_model=512, n_heads=8, n_encoder_layers=6, n_decoder_layers=6, d_ff=2048),
}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def make_model(size: str, k: int = 8, head_hidden: int = 128, seed: int = 0) -> BPDModel:
    torch.manual_seed(seed)
    m = BPDModel(BPDConfig(**SIZES[size], block_size=k, head_d_hidden=head_hidden, dropout=0.0)).eval()
    if m.heads is not None:  # random, but not zero-initialised future heads (real proposals, real cost)
        with torch.no_grad():
            torch.nn.init.normal_(m.heads.fc2.weight, std=0.02)
    return m


def step_costs(m: BPDModel, ks, options: DecodeOptions, reps: int = 40, src_len: int = 25, cached: int = 20):
    """(greedy step ms, {k: blockwise step / greedy step}) at batch 1, steps interleaved."""
    v = m.config.vocab_size
    m.decode_options = options
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, v, (1, src_len), generator=g)
    src[0, -1] = m.config.eos_id
    with torch.inference_mode():
        st = m.start_decoding(m.encode(src), cached + 16)
        m.decode(st, torch.randint(4, v, (1, cached), generator=g))
        w = st.weights

        def greedy_step(x=torch.tensor([[5]])):
            st.lengths = cached
            h = m.decode(st, x)
            w.head1_argmax(h[:, 0]).cpu().numpy()

        def block_step(k):
            x = torch.randint(4, v, (1, k), generator=g)

            def f():
                st.lengths = cached
                h = m.decode(st, x)
                w.head1_argmax(h).cpu().numpy()              # verify at the k positions
                w.propose(h[:, 1], 1, k).cpu().numpy()        # heads 2..k at the accepted one
            return f
        fs = {"greedy": greedy_step, **{k: block_step(k) for k in ks}}
        times = {n: [] for n in fs}
        for f in fs.values():
            f(), f()
        order = list(fs.items())
        for rep in range(reps):
            random.Random(rep).shuffle(order)              # no step always runs right after another
            for n, f in order:
                t = time.perf_counter()
                f()
                times[n].append(time.perf_counter() - t)
    gms = statistics.median(times["greedy"])
    return gms * 1e3, {k: statistics.median(times[k]) / gms for k in ks}


def bench_steps(sizes, threads, reps):
    rows = []
    for size in sizes:
        m = make_model(size)
        draft = tuple(range(m.config.vocab_size // 4))
        for t in threads:
            torch.set_num_threads(t)
            for engine in ("native", "torch"):
                if engine == "native" and native_kernels() is None:
                    continue
                for label, opts in (("full", DecodeOptions()), ("draft V/4", DecodeOptions(draft_vocab=draft))):
                    if engine == "torch" and label != "full":
                        continue
                    with _engine(engine):
                        m._decode_cache = None
                        gms, ratio = step_costs(m, (2, 4, 8), opts, reps=reps)
                    row = dict(size=size, threads=t, engine=engine, proposals=label, greedy_ms=round(gms, 3),
                               **{f"k{k}": round(r, 2) for k, r in ratio.items()})
                    rows.append(row)
                    print(f"step cost  {size:4s} threads={t} {engine:6s} proposals={label:9s} greedy {gms:7.3f} ms  "
                          + "  ".join(f"k={k}: {r:.2f}" for k, r in ratio.items()), flush=True)
    return rows


class _engine:
    """Temporarily decode with torch's F.linear instead of the native kernels (for the A/B)."""

    def __init__(self, name):
        self.name = name

    def __enter__(self):
        import bpd_train.model.fastlinear as fl
        self.saved = (fl._ext, fl._ext_tried)
        if self.name == "torch":
            fl._ext, fl._ext_tried = None, True

    def __exit__(self, *exc):
        import bpd_train.model.fastlinear as fl
        fl._ext, fl._ext_tried = self.saved


# ---- CTranslate2 on the same weights ----
def to_ct2(m: BPDModel, out_dir: str) -> list[str]:
    """Write `m` (pre-norm Transformer, tied embeddings, sinusoidal positions) as a CTranslate2 model."""
    from ctranslate2.specs import transformer_spec
    c = m.config
    spec = transformer_spec.TransformerSpec.from_config((c.n_encoder_layers, c.n_decoder_layers), c.n_heads,
                                                        pre_norm=True)
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


def bench_ct2(threads, batch_sizes, n_sent: int = 64, size: str = "base"):
    try:
        import ctranslate2
    except ImportError:
        print("ctranslate2 not installed: pip install ctranslate2==4.8.5 (skipping the comparison)")
        return None
    m = make_model(size, k=1)
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
                tr = ctranslate2.Translator(d, device="cpu", compute_type=ct2_type, inter_threads=1,
                                            intra_threads=t)
                m.decode_options = DecodeOptions(dtype=our_dtype)
                for bs in batch_sizes:
                    res = {"ours": [], "ct2": []}
                    ours_out, ct2_out = [], []
                    for rep in range(2):  # interleaved A B A B over the same batches
                        for i in range(0, n_sent, bs):
                            for who in (("ours", "ct2") if rep % 2 == 0 else ("ct2", "ours")):
                                t0 = time.perf_counter()
                                if who == "ours":
                                    out = greedy(m, srcs[i:i + bs], max_len=max_len).tokens
                                else:
                                    r = tr.translate_batch(toks[i:i + bs], beam_size=1, max_decoding_length=max_len,
                                                           max_batch_size=bs)
                                    out = [[index[x] for x in h.hypotheses[0]] for h in r]
                                el = time.perf_counter() - t0
                                res[who].append((el, sum(len(o) for o in out)))
                                if rep == 0:
                                    (ours_out if who == "ours" else ct2_out).extend(out)
                    tps = {who: sum(n for _, n in v_) / sum(e for e, _ in v_) for who, v_ in res.items()}
                    same = sum(a == b for a, b in zip(ours_out, ct2_out)) / len(ours_out)
                    row = dict(size=size, threads=t, dtype=our_dtype, batch=bs, ours_tok_s=round(tps["ours"], 1),
                               ct2_tok_s=round(tps["ct2"], 1), ratio=round(tps["ours"] / tps["ct2"], 2),
                               identical=round(same, 3))
                    rows.append(row)
                    print(f"greedy tok/s {size} threads={t} {our_dtype:4s} (CT2 {ct2_type}) batch {bs:2d}: ours "
                          f"{tps['ours']:7.1f}  CTranslate2 {tps['ct2']:7.1f}  ratio {tps['ours'] / tps['ct2']:.2f}  "
                          f"identical outputs {same:.0%}", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--sizes", nargs="+", default=["demo", "base"], choices=sorted(SIZES))
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument("--skip-ct2", action="store_true")
    ap.add_argument("--quick", action="store_true", help="demo size, 1 thread, few reps, small CT2 run")
    a = ap.parse_args(argv)
    if a.quick:
        a.threads, a.sizes, a.reps = [1], ["demo"], 5
    print(f"CPU: {cpu_model()} ({os.cpu_count()} cores), torch {torch.__version__}, engine {engine_name()}",
          flush=True)
    result = {"cpu": cpu_model(), "engine": engine_name(), "step_cost": bench_steps(a.sizes, a.threads, a.reps)}
    if not a.skip_ct2:
        result["ctranslate2"] = [row for size in a.sizes
                                 for row in (bench_ct2(a.threads, [1, 32] if not a.quick else [4],
                                                       n_sent=64 if not a.quick else 8, size=size) or [])]
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
