# bash bench/gpu.sh        (on the GPU machine; this file is its python part: docs/GPU.md)
# python bench/gpu.py --device cpu --quick          (the same checks, tiny, on a CPU: what tests/test_bench_gpu.py runs)
"""What a CPU cannot check, in one run on one GPU; the last line printed is one JSON object.

Sections (each guarded: an error is reported in the JSON, the others still run):
  exactness   blockwise(Exact) == greedy over randomised models, batches and block sizes, fp32 (TF32 off)
  step_cost   one blockwise step (decode on k tokens + head 1 at the k positions + heads 2..k at one position)
              vs one greedy step (decode 1 token + head 1), demo size and Transformer-base size, k = 2/4/8,
              batch 1 and 32: median of interleaved timings, eager and (optional) replayed as CUDA graphs
  compile     (optional) the same steps under torch.compile(mode="reduce-overhead"), base size, batch 1
  speedup     blockwise vs greedy wall clock on random-weight models and, if present, the demo's trained runs
  train       bf16-mixed smoke base -> frozen chain with strategy=deepspeed_zero2, deepspeed_zero3 (every
              parameter partitioned: persistence threshold 0) and fsdp (per-layer units); the frozen backbone must
              come out bit-identical, the in-training blockwise evaluation agree 100% with greedy (CUDA only)
With --out-dir (default $OUT) it also writes gpu.json and gpu.md (a markdown summary) there.
Without CUDA (and without --device cpu) it prints one JSON line saying it skipped, and exits 0.
Only the public model/decoding API is used: the decoder internals change under it.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gzip
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bpd_train.decoding import Exact, blockwise, greedy  # noqa: E402
from bpd_train.model import BPDConfig, BPDModel  # noqa: E402

PAD, BOS, EOS = 0, 1, 2
# model sizes of the step-cost table: the demo preset and Transformer-base
SIZES = {
    "demo": dict(
        d_model=128, n_heads=4, n_encoder_layers=3, n_decoder_layers=3, d_ff=512, vocab_size=4000, head_d_hidden=128
    ),
    "base": dict(d_model=512, n_heads=8, n_encoder_layers=6, n_decoder_layers=6, d_ff=2048, vocab_size=32000),
}
# seconds kept back from the training chains for the optional torch.compile section that runs after them
COMPILE_RESERVE_S = 75
QUICK_SIZES = {"tiny": dict(d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=2, d_ff=64, vocab_size=50)}


def log(msg: str) -> None:
    print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------- exactness
def random_model(
    k: int,
    seed: int,
    vocab: int,
    device,
    d_model: int = 16,
    std: float = 0.08,
    eos_bias: float = 1.5,
    scale: float = 2.5,
) -> BPDModel:
    """Random model whose heads 2..k often (not always) agree with head 1 one step later, so blocks of
    several tokens get accepted and others rolled back (the construction of tests/test_decoding.py)."""
    torch.manual_seed(seed)
    cfg = BPDConfig(
        vocab_size=vocab,
        d_model=d_model,
        n_heads=2,
        n_encoder_layers=1,
        n_decoder_layers=2,
        d_ff=2 * d_model,
        block_size=k,
        dropout=0.0,
        max_positions=128,
    )
    m = BPDModel(cfg).eval()
    with torch.no_grad():
        if m.heads is not None:
            m.heads.fc2.weight.normal_(0, std)
        for name, p in m.named_parameters():
            if name.startswith("decoder_layers") and p.dim() == 2:
                p.mul_(scale)
        m.embed.weight[EOS] *= 1.0 + eos_bias
    return m.to(device)


def random_sources(batch: int, seed: int, vocab: int, max_src: int = 12) -> torch.Tensor:
    """[B,S] ids + EOS, right-padded with PAD, rows of different lengths."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_src + 1, (batch,), generator=g).tolist()
    src = torch.full((batch, max(lens)), PAD, dtype=torch.long)
    for i, n in enumerate(lens):
        src[i, : n - 1] = torch.randint(3, vocab, (n - 1,), generator=g)
        src[i, n - 1] = EOS
    return src


def check_exactness(device, quick: bool = False, accept=None) -> dict:
    """blockwise(accept) vs greedy token for token over random cases. accept=None means Exact(); a relaxed
    rule (TopK(3)) must show mismatches, which is how the tests know this check can fail."""
    accept = Exact() if accept is None else accept
    device = torch.device(device)
    ks = (2, 4, 8) if quick else tuple(range(1, 9))
    batches = (1, 7) if quick else (1, 5, 16, 32)
    vocabs = (7,) if quick else (7, 61)
    cases = mismatched_rows = rows = 0
    mismatches, accepted = [], []
    with torch.no_grad():
        for k in ks:
            for vocab in vocabs:
                for b in batches:
                    seed = 1000 * k + 10 * b + vocab
                    m = random_model(k, seed, vocab, device, d_model=16 if vocab < 32 else 32)
                    src = random_sources(b, seed, vocab).to(device)
                    max_len = (1.5, 4) if b % 2 else 24
                    g = greedy(m, src, max_len=max_len)
                    r = blockwise(m, src, block_size=k, accept=accept, max_len=max_len)
                    bad = [i for i, (x, y) in enumerate(zip(r.tokens, g.tokens)) if x != y]
                    cases += 1
                    rows += b
                    mismatched_rows += len(bad)
                    if k > 1:
                        accepted.append(r.mean_accepted)
                    if bad and len(mismatches) < 5:
                        i = bad[0]
                        mismatches.append(
                            dict(
                                k=k,
                                vocab=vocab,
                                batch=b,
                                seed=seed,
                                row=i,
                                greedy=g.tokens[i][:12],
                                blockwise=r.tokens[i][:12],
                            )
                        )
    return dict(
        ok=mismatched_rows == 0,
        accept=type(accept).__name__,
        cases=cases,
        rows=rows,
        mismatched_rows=mismatched_rows,
        mismatches=mismatches,
        # > 1 shows multi-token blocks were accepted, so the comparison was not vacuous
        mean_accepted=round(statistics.fmean(accepted), 3) if accepted else None,
        tf32=bool(torch.backends.cuda.matmul.allow_tf32) if device.type == "cuda" else None,
    )


# ---------------------------------------------------------------------------------------------- step cost
def size_model(spec: dict, k: int, device, dtype=torch.float32) -> BPDModel:
    torch.manual_seed(0)
    cfg = BPDConfig(block_size=k, dropout=0.0, max_positions=256, **spec)
    return BPDModel(cfg).eval().to(device=device, dtype=dtype)


class StepBench:
    """One model with k = max(ks) heads, a decoder state holding a prefix, and the step functions of the
    table. Each step decodes at the same cache position (state.lengths is set back after every call), so
    repeated timings measure the same work and a captured CUDA graph stays valid."""

    def __init__(self, spec: dict, ks, batch: int, device, prefix: int = 16, src_len: int = 24):
        self.device, self.ks = torch.device(device), tuple(ks)
        kmax = max(self.ks)
        self.model = size_model(spec, kmax, self.device)
        v = self.model.config.vocab_size
        g = torch.Generator().manual_seed(batch)
        src = torch.randint(4, v, (batch, src_len), generator=g)
        src[:, -1] = EOS
        self.tokens = torch.randint(4, v, (batch, kmax), generator=g).to(self.device)
        with torch.no_grad():
            self.state = self.model.start_decoding(self.model.encode(src.to(self.device)), prefix + kmax + 1)
            pre = torch.randint(4, v, (batch, prefix), generator=g).to(self.device)
            pre[:, 0] = BOS
            self.model.decode(self.state, pre)
        self.state.lengths = prefix
        self.prefix = prefix

    def greedy_step(self) -> torch.Tensor:
        m = self.model
        h = m.decode(self.state, self.tokens[:, :1])
        self.state.lengths = self.prefix
        return m.head_logits(h[:, -1], 0).argmax(-1)

    def block_step(self, k: int) -> torch.Tensor:
        m = self.model
        h = m.decode(self.state, self.tokens[:, :k])  # [B,k,D]
        self.state.lengths = self.prefix
        verify = m.head_logits(h, 0).argmax(-1)  # head 1 at the k positions
        propose = m.heads_logits(h[:, -1], 1, k).argmax(-1)  # heads 2..k at one position
        return torch.cat([verify, propose], dim=1)

    def steps(self) -> dict:
        out = {"greedy": self.greedy_step}
        for k in self.ks:
            out[f"k{k}"] = lambda k=k: self.block_step(k)
        return out


def interleaved_ms(fns: dict, device, reps: int, warmup: int = 3) -> dict:
    """Median milliseconds of each function, calls interleaved (A B C, C B A, ...) so drift hits all alike."""
    device = torch.device(device)
    names = list(fns)
    times = {n: [] for n in names}
    with torch.no_grad():
        for _ in range(warmup):
            for n in names:
                fns[n]()
        sync(device)
        for r in range(reps):
            for n in names if r % 2 == 0 else names[::-1]:
                t0 = time.perf_counter()
                fns[n]()
                sync(device)
                times[n].append(time.perf_counter() - t0)
    return {n: statistics.median(t) * 1e3 for n, t in times.items()}


def cost_row(ms: dict) -> dict:
    g = ms["greedy"]
    row = {"greedy_ms": round(g, 4)}
    row.update({f"{n}_greedy_steps": round(t / g, 3) for n, t in ms.items() if n != "greedy"})
    return row


def graphed(fns: dict, device) -> dict:
    """The same functions captured once as CUDA graphs and replayed (launch overhead removed)."""
    out = {}
    stream = torch.cuda.Stream(device)
    with torch.no_grad():
        for name, fn in fns.items():
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):  # warm-up off the default stream, as capture requires
                for _ in range(3):
                    fn()
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            out[name] = graph.replay
    return out


def step_cost_table(device, sizes: dict, ks=(2, 4, 8), batches=(1, 32), reps: int = 50, graphs: bool = False) -> dict:
    device = torch.device(device)
    table, graph_table, graph_errors = {}, {}, {}
    for size, spec in sizes.items():
        for b in batches:
            key = f"{size}_b{b}"
            bench = StepBench(spec, ks, b, device)
            fns = bench.steps()
            table[key] = cost_row(interleaved_ms(fns, device, reps))
            if graphs:
                try:
                    graph_table[key] = cost_row(interleaved_ms(graphed(fns, device), device, reps))
                except Exception as e:  # optional: reported, never fatal
                    graph_errors[key] = f"{type(e).__name__}: {e}"[:300]
            del bench, fns
            log(f"step cost {key}: {table[key]}")
    out = {"eager": table}
    if graphs:
        out["cuda_graphs"] = graph_table
        if graph_errors:
            out["cuda_graph_errors"] = graph_errors
    return out


def compiled_step_cost(device, spec: dict, ks=(8,), batch: int = 1, reps: int = 50) -> dict:
    """torch.compile(mode="reduce-overhead") of the greedy and blockwise steps vs eager, one size and batch."""
    bench = StepBench(spec, ks, batch, device)
    eager = bench.steps()
    compiled = {f"{n}": torch.compile(f, mode="reduce-overhead", fullgraph=False) for n, f in eager.items()}
    t0 = time.perf_counter()
    with torch.no_grad():
        for f in compiled.values():  # compile (and record the graphs) before timing
            for _ in range(3):
                f()
    compile_s = time.perf_counter() - t0
    both = {**{f"eager_{n}": f for n, f in eager.items()}, **{f"compiled_{n}": f for n, f in compiled.items()}}
    ms = interleaved_ms(both, device, reps)
    row = {"compile_s": round(compile_s, 1)}
    for kind in ("eager", "compiled"):
        row[kind] = cost_row({n.split("_", 1)[1]: t for n, t in ms.items() if n.startswith(kind + "_")})
    row["compiled_greedy_vs_eager"] = round(ms["eager_greedy"] / ms["compiled_greedy"], 3)
    return row


# ---------------------------------------------------------------------------------------------- speedup
def time_decoders(model, batches: list[torch.Tensor], k: int, max_len, device, repeats: int = 3) -> dict:
    """Greedy vs blockwise(Exact) over the same batches, interleaved; agreement, k̂ and wall-clock ratio."""
    g_t, b_t, agree, rows, tok, steps, calls = 0.0, 0.0, 0, 0, 0.0, 0, 0
    with torch.no_grad():
        greedy(model, batches[0], max_len=max_len)  # warm-up (allocator, kernels)
        blockwise(model, batches[0], block_size=k, max_len=max_len)
        for rep in range(repeats):
            for src in batches:
                order = ("g", "b") if rep % 2 == 0 else ("b", "g")
                for which in order:
                    sync(device)
                    t0 = time.perf_counter()
                    if which == "g":
                        g = greedy(model, src, max_len=max_len)
                    else:
                        r = blockwise(model, src, block_size=k, accept=Exact(), max_len=max_len)
                    sync(device)
                    dt = time.perf_counter() - t0
                    if which == "g":
                        g_t += dt
                    else:
                        b_t += dt
                if rep == 0:
                    agree += sum(x == y for x, y in zip(r.tokens, g.tokens))
                    rows += len(g.tokens)
                    tok += r.mean_accepted * r.row_steps  # k̂ per row-step, as DecodeResult defines it
                    steps += r.row_steps
                    calls += r.calls
    return dict(
        k=k,
        agreement=round(agree / rows, 4),
        mean_accepted=round(tok / max(steps, 1), 3),
        calls=calls,
        speedup=round(g_t / b_t, 3),
        greedy_ms_per_batch=round(1e3 * g_t / (repeats * len(batches)), 3),
    )


def random_speedups(
    device, sizes: dict, ks=(4, 8), batch_sizes=(1, 32), sentences: int = 32, max_len=32, repeats: int = 2
) -> dict:
    """Random weights: heads rarely agree, so k̂ ~ 1 and this is the overhead side of the trade."""
    device = torch.device(device)
    out = {}
    for size, spec in sizes.items():
        for k in ks:
            model = size_model(spec, k, device)
            v = model.config.vocab_size
            src = random_sources(sentences, seed=k, vocab=v, max_src=24).to(device)
            for b in batch_sizes:
                batches = [src[i : i + b] for i in range(0, sentences, b)]
                if b == 1:
                    batches = batches[:8]
                out[f"{size}_k{k}_b{b}"] = time_decoders(model, batches, k, max_len, device, repeats)
                log(f"random speedup {size} k{k} b{b}: {out[f'{size}_k{k}_b{b}']}")
            del model
    return out


def demo_sources(tokenizer_path: Path, n: int, device) -> torch.Tensor:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_path))
    texts = []
    with gzip.open(ROOT / "data" / "bible-en-fr" / "validation.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["translation"]["en"])
            if len(texts) == n:
                break
    ids = [sp.encode(t)[:126] + [EOS] for t in texts]
    src = torch.full((len(ids), max(map(len, ids))), PAD, dtype=torch.long)
    for i, row in enumerate(ids):
        src[i, : len(row)] = torch.tensor(row)
    return src.to(device)


def demo_speedups(device, demo_dir: Path, sentences: int = 64, repeats: int = 2) -> dict:
    """The demo's trained head runs (make demo), if this tree has them: wall clock at batch 1 and 32."""
    from bpd_train.loading import load

    runs = sorted(p for p in demo_dir.glob("*/heads/*") if (p / "checkpoints").is_dir())
    if not runs:
        return {"present": False, "looked_in": str(demo_dir)}
    out = {"present": True}
    for run in runs:
        lm = load(run, map_location=device)
        model = lm.model.eval()
        src = demo_sources(lm.tokenizer_path, sentences, device)
        k = model.config.block_size
        for b in (1, 32):
            batches = [src[i : i + b] for i in range(0, sentences, b)][: (16 if b == 1 else None)]
            out[f"{run.name}_b{b}"] = time_decoders(model, batches, k, (1.5, 10), device, repeats)
            log(f"demo speedup {run.name} b{b}: {out[f'{run.name}_b{b}']}")
    return out


# ---------------------------------------------------------------------------------------------- training
def _metrics(run: Path) -> list[dict]:
    return [r for m in run.rglob("metrics.csv") for r in csv.DictReader(m.open())]


GPU_TRAINER = ("trainer=gpu", "trainer.devices=1", "trainer.precision=bf16-mixed")


# strategy -> (config group option, extra overrides) of the training chains
TRAIN_CHAINS = {
    "deepspeed_zero2": ("deepspeed_zero2", ()),
    # threshold 0: the smoke model's parameters are all below DeepSpeed's default (1e5) and would never be
    # partitioned; real sizes are, so partition everything here
    "deepspeed_zero3": ("deepspeed_zero3", ("strategy.param_persistence_threshold=0",)),
    "fsdp": ("fsdp", ()),
}


def train_chain(
    strategy: str,
    art: Path,
    timeout: float,
    spm_from: Path | None,
    logdir: Path | None,
    trainer=GPU_TRAINER,
    overrides=(),
) -> dict:
    """python train.py +regime=base, then +regime=frozen, experiment=smoke, by default on one GPU in bf16-mixed."""
    from bpd_train.loading import load  # the one resolver: also reads DeepSpeed ZeRO folders

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    env.setdefault("TORCH_EXTENSIONS_DIR", str(Path(tempfile.gettempdir()) / "bpd-torch-ext"))
    group, extra_over = TRAIN_CHAINS.get(strategy, (strategy, ()))
    common = [
        "experiment=smoke",
        *trainer,
        f"strategy={group}",
        *extra_over,
        *overrides,
        "logger=csv",
        "progress_bar=none",
        f"paths.artifacts={art}",
    ]
    res: dict = {"strategy": strategy}
    if spm_from is not None:  # the tokenizer the first chain trained: no second sentencepiece run
        shutil.copytree(spm_from, art / spm_from.parent.name / "spm")
    deadline = time.monotonic() + timeout
    for regime, extra in (("base", []), ("frozen", ["trainer.val_check_interval=10"])):
        left = deadline - time.monotonic()
        if left < 20:
            res[regime] = {"ok": False, "error": "no time left"}
            return res
        cmd = [
            sys.executable,
            str(ROOT / "train.py"),
            f"+regime={regime}",
            *common,
            *extra,
            f"hydra.run.dir={art}-hydra/{regime}",
        ]
        t0 = time.monotonic()
        try:
            p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=left)
            rc, text = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = "timeout", f"{e.stdout or ''}{e.stderr or ''}"
            text = text.decode(errors="replace") if isinstance(text, bytes) else text
        if logdir is not None:
            (logdir / f"train-{strategy}-{regime}.log").write_text(text[-200_000:])
        res[regime] = {
            "rc": rc,
            "s": round(time.monotonic() - t0, 1),
            "log_mentions_bf16": "bf16" in text.lower(),
        }  # Lightning names the precision it set up
        if rc != 0:
            res[regime].update(ok=False, tail=text[-1500:])
            return res
        res[regime]["ok"] = True
    corpus = next(art.glob("*/base")).parent
    base = load(corpus / "base")
    frozen_run = next((corpus / "heads").glob("frozen-k*"))
    frozen = load(frozen_run)
    fsd, bsd = frozen.model.state_dict(), base.model.state_dict()
    rows = _metrics(frozen_run)
    agree = [float(r["val/agreement"]) for r in rows if r.get("val/agreement")]
    losses = [float(r["val/loss"]) for r in rows if r.get("val/loss")]
    res.update(
        # a frozen backbone must come through the strategy bit-identical (bf16 engines may round it)
        backbone_identical=all(torch.equal(fsd[k].float(), v.float()) for k, v in bsd.items()),
        heads_trained=any(bool(fsd[k].abs().sum() > 0) for k in fsd if k.startswith("heads.fc2")),
        val_agreement=agree,
        val_loss_finite=bool(losses) and all(math.isfinite(x) for x in losses),
        checkpoint=str(next((frozen_run / "checkpoints").glob("last*")).name),
    )
    # identity_p1 promises the base model's greedy output bit for bit: a rounded backbone breaks that promise
    res["ok"] = bool(
        res["heads_trained"] and res["val_loss_finite"] and res["backbone_identical"] and agree and min(agree) == 100.0
    )
    res["spm"] = str(corpus / "spm")
    return res


# ---------------------------------------------------------------------------------------------- main
def write_json(path: Path | None, obj: dict) -> None:
    if path is None:
        return
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj) + "\n")
    os.replace(tmp, path)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: run the decoding checks on the CPU (logic only; numbers meaningless)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes and few cases")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=430.0,
        help="stop starting sections after this many seconds (bench/gpu.sh kills at 450 s)",
    )
    ap.add_argument(
        "--skip",
        default="",
        help="comma-separated sections to leave out: exactness,step_cost,compile,speedup,demo,train",
    )
    ap.add_argument(
        "--demo-dir",
        type=Path,
        default=ROOT / "artifacts" / "demo",
        help="where `make demo` put its runs (carried to the device if you want demo speedups)",
    )
    ap.add_argument("--partial", type=Path, default=None, help="rewrite this file with the results so far")
    ap.add_argument(
        "--out-dir",
        type=Path,
        default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
        help="also write gpu.json and the training logs here (default: $OUT when set)",
    )
    args = ap.parse_args(argv)
    known = {"exactness", "step_cost", "compile", "speedup", "demo", "train"}
    bad = set(filter(None, args.skip.split(","))) - known
    if bad:
        ap.error(f"--skip: unknown section(s) {sorted(bad)}; choose from {sorted(known)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    t_start = time.monotonic()
    result: dict = {"bench": "gpu", "device": args.device, "quick": args.quick, "torch": torch.__version__}
    if args.device == "cuda" and not torch.cuda.is_available():
        result.update(skipped="no CUDA device visible (torch.cuda.is_available() is False)", ok=None)
        print(json.dumps(result))
        return 0
    device = torch.device(args.device)
    if device.type == "cuda":
        # the exactness claim and the step-cost table are for fp32; TF32 matmuls would be a lower precision
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        result.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda, tf32=False)
    else:
        torch.set_num_threads(1)
    result["packages"] = package_versions()
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    sections: dict = {}
    errors: dict = {}
    result.update(sections=sections, errors=errors)
    sizes = QUICK_SIZES if args.quick else SIZES
    cuda = device.type == "cuda"

    def run(name: str, fn, required: bool = True, min_left: float = 15) -> None:
        if name in skip:
            sections[name] = {"skipped": "--skip"}
            return
        left = args.budget_s - (time.monotonic() - t_start)
        if left < min_left:
            sections[name] = {"skipped": f"time budget ({args.budget_s:.0f} s) spent"}
            if required:
                errors[name] = "not run: time budget spent"
            return
        log(f"{name} ({left:.0f} s of the budget left)")
        t0 = time.monotonic()
        try:
            sections[name] = fn()
            sections[name]["s"] = round(time.monotonic() - t0, 1)
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"[:500]
            sections[name] = {"error": errors[name], "traceback": traceback.format_exc()[-1500:]}
            if not required:  # optional sections report their failure without failing the run
                del errors[name]
            log(f"{name} failed: {errors.get(name, sections[name]['error'])}")
        write_json(args.partial, result)

    run("exactness", lambda: check_exactness(device, args.quick))
    reps = 10 if args.quick else 50
    run(
        "step_cost",
        lambda: step_cost_table(device, sizes, reps=reps, graphs=cuda, batches=(1, 4) if args.quick else (1, 32)),
    )
    run(
        "speedup",
        lambda: random_speedups(
            device,
            sizes,
            batch_sizes=(1, 4) if args.quick else (1, 32),
            sentences=8 if args.quick else 32,
            max_len=8 if args.quick else 32,
            repeats=1 if args.quick else 2,
        ),
    )
    run("demo", lambda: demo_speedups(device, args.demo_dir), required=False)
    if cuda:

        def train() -> dict:
            out: dict = {}
            with tempfile.TemporaryDirectory(prefix="bpd-gpu-train-") as tmp:
                spm = None
                chains = list(TRAIN_CHAINS)
                for i, strategy in enumerate(chains):
                    left = args.budget_s - COMPILE_RESERVE_S - (time.monotonic() - t_start)
                    share = left / (len(chains) - i)  # what is left, split between the chains still to run
                    # a shorter base run: the chains check that training works, not what it reaches
                    out[strategy] = train_chain(
                        strategy, Path(tmp) / strategy / "art", share, spm, args.out_dir, overrides=("steps.base=20",)
                    )
                    if out[strategy].get("spm"):
                        spm = Path(out[strategy].pop("spm"))
                    write_json(args.partial, result)
            out["ok"] = all(out[s].get("ok") for s in TRAIN_CHAINS)
            return out

        run("train", train)
    else:
        sections["train"] = {
            "skipped": "CUDA only: Lightning's DeepSpeed and FSDP strategies refuse CPU "
            "(the CPU suite covers them through shims)"
        }
    if cuda:  # last: optional, and its compile time is the least predictable
        run(
            "compile",
            lambda: compiled_step_cost(device, SIZES["base"] if not args.quick else sizes["tiny"]),
            required=False,
            min_left=COMPILE_RESERVE_S - 15,
        )
    else:
        sections["compile"] = {"skipped": "CUDA only (reduce-overhead mode records CUDA graphs)"}
    required_ok = [sections[s].get("ok", True) for s in ("exactness", "train") if s in sections]
    result["ok"] = not errors and all(x is not False for x in required_ok)
    result["wall_s"] = round(time.monotonic() - t_start, 1)
    write_json(args.partial, result)
    if args.out_dir is not None:
        write_json(args.out_dir / "gpu.json", result)
        tmp = args.out_dir / "gpu.md.tmp"
        tmp.write_text(markdown_summary(result))
        os.replace(tmp, args.out_dir / "gpu.md")
    print(json.dumps(result))
    return 0 if result["ok"] else 1


def markdown_summary(result: dict) -> str:
    """gpu.md: one line per section and check, for a person reading the device call's files."""

    def mark(v):
        return {True: "ok", False: "FAILED", None: "-"}.get(v, str(v))

    lines = [
        f"# bench/gpu.py on {result.get('gpu', result.get('device'))}",
        "",
        f"overall: **{mark(result.get('ok'))}**, torch {result.get('torch')}, CUDA {result.get('cuda', '-')}, "
        f"{result.get('wall_s', '?')} s",
        "",
    ]
    if result.get("skipped"):
        return "\n".join(lines + [f"skipped: {result['skipped']}", ""])
    lines += ["| section | result | seconds | notes |", "|---|---|---|---|"]
    for name, sec in (result.get("sections") or {}).items():
        if "skipped" in sec:
            lines.append(f"| {name} | skipped | - | {sec['skipped']} |")
            continue
        if "error" in sec:
            lines.append(f"| {name} | FAILED | - | {str(sec['error'])[:200]} |")
            continue
        note = ""
        if name == "exactness":
            note = f"{sec.get('mismatched_rows')} mismatched rows in {sec.get('cases')} cases"
        elif name == "train":
            note = "; ".join(
                f"{s}: {mark(v.get('ok'))} (backbone identical {v.get('backbone_identical')}, "
                f"agreement {v.get('val_agreement')})"
                for s, v in sec.items()
                if isinstance(v, dict)
            )
        elif name == "speedup":
            note = ", ".join(
                f"{k} x{v.get('speedup', 0):.2f}" for k, v in sec.items() if isinstance(v, dict) and "speedup" in v
            )
        lines.append(f"| {name} | {mark(sec.get('ok', True))} | {sec.get('s', '-')} | {note} |")
    for name, err in (result.get("errors") or {}).items():
        lines.append(f"\nerror in {name}: {err}")
    return "\n".join(lines) + "\n"


def package_versions() -> dict:
    """Versions of what the training section needs (carried or the image's) and whether each imports: the
    carried wheels go in with --no-deps, so a clash with the image's versions shows up here, not in pip."""
    import importlib
    from importlib import metadata

    out = {}
    for dist, module in (
        ("lightning", "lightning"),
        ("hydra-core", "hydra"),
        ("omegaconf", "omegaconf"),
        ("datasets", "datasets"),
        ("deepspeed", "deepspeed"),
        ("pydantic", "pydantic"),
        ("pyarrow", "pyarrow"),
        ("fsspec", "fsspec"),
        ("huggingface-hub", "huggingface_hub"),
        ("sentencepiece", "sentencepiece"),
    ):
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
            continue
        try:
            with contextlib.redirect_stdout(sys.stderr):  # deepspeed logs to stdout on import; ours is the JSON
                importlib.import_module(module)
            out[dist] = version
        except Exception as e:  # installed but broken: say why
            out[dist] = f"{version} (import fails: {type(e).__name__}: {str(e)[:150]})"
    return out


if __name__ == "__main__":
    sys.exit(main())
