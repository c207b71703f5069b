"""bench/gpu.py's decoding sections: blockwise == greedy on random models, the step-cost tables (both model
families) and wall-clock speedups. Only the public model/decoding API is used."""

from __future__ import annotations

import gzip
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # bench.protocol, however this file was loaded
    sys.path.insert(0, str(ROOT))

from bench.protocol import MIN_REPS, Run, matches, measure, speedup, spread, step_cost  # noqa: E402
from bpd_train.decoding import Exact, blockwise, greedy  # noqa: E402
from bpd_train.engine.weights import default_weights  # noqa: E402
from bpd_train.model import BPDConfig, BPDModel  # noqa: E402
from bpd_train.model.lm.config import LMConfig  # noqa: E402
from bpd_train.model.lm.model import LMModel  # noqa: E402

PAD, BOS, EOS = 0, 1, 2
# model sizes of the step-cost table: the demo preset and Transformer-base
SIZES = {
    "demo": dict(
        d_model=128, n_heads=4, n_encoder_layers=3, n_decoder_layers=3, d_ff=512, vocab_size=4000, head_d_hidden=128
    ),
    "base": dict(d_model=512, n_heads=8, n_encoder_layers=6, n_decoder_layers=6, d_ff=2048, vocab_size=32000),
}
QUICK_SIZES = {"tiny": dict(d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=2, d_ff=64, vocab_size=50)}
# decoder-only sizes of the LM step-cost table (Medusa heads, bf16): SmolLM2-135M's and SmolLM2-1.7B's shapes
LM_SIZES = {
    "smollm2_135m": dict(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536),
    "smollm2_1.7b": dict(vocab_size=49152, d_model=2048, n_layers=24, n_heads=32, n_kv_heads=32, d_ff=8192),
}
QUICK_LM_SIZES = {"tiny_lm": dict(vocab_size=50, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=64)}


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


def lm_size_model(spec: dict, k: int, device, dtype=torch.float32) -> LMModel:
    """A decoder-only model of `spec`'s shape with k Medusa heads, random weights made on `device` itself."""
    torch.manual_seed(0)
    cfg = LMConfig(block_size=k, heads="medusa", max_positions=256, eos_id=EOS, **spec)
    with torch.device(device):
        return LMModel(cfg).eval().to(dtype=dtype)


class StepBench:
    """One model with k = max(ks) heads, a decoder state holding a prefix, and the step functions of the
    table. Each step decodes at the same cache position (state.lengths is set back after every call), so
    repeated timings measure the same work and a captured CUDA graph stays valid."""

    def __init__(self, spec: dict, ks, batch: int, device, prefix: int = 16, src_len: int = 24, dtype=torch.float32):
        self.device, self.ks = torch.device(device), tuple(ks)
        kmax = max(self.ks)
        lm = "n_layers" in spec  # a decoder-only shape (LM_SIZES)
        self.model = (lm_size_model if lm else size_model)(spec, kmax, self.device, dtype)
        v = self.model.config.vocab_size
        g = torch.Generator().manual_seed(batch)
        self.tokens = torch.randint(4, v, (batch, kmax), generator=g).to(self.device)
        w = default_weights(self.model).get(self.model)  # the model's default (fp32) step weights
        with torch.no_grad():
            if lm:  # the prompt is the prefix: start_decoding caches it, decoder tokens start at length 0
                self.prompt = torch.randint(4, v, (batch, prefix + 1), generator=g).to(self.device)
                self.state = self.model.start_decoding(self.model.encode(self.prompt), kmax + 1, weights=w)
                prefix = 0
            else:
                src = torch.randint(4, v, (batch, src_len), generator=g)
                src[:, -1] = EOS
                self.state = self.model.start_decoding(
                    self.model.encode(src.to(self.device)), prefix + kmax + 1, weights=w
                )
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


def step_times(fns: dict, device, calls: int = 16, passes: int = MIN_REPS, clock=time.perf_counter) -> dict:
    """bench/protocol.py's measure() over step functions (no arguments): a pass calls every step `calls` times, the
    steps taking turns call by call; one untimed warm-up pass, then `passes` timed ones, CUDA synchronised around
    every timed call. Returns name -> Timing (seconds[pass][call])."""
    device = torch.device(device)
    engines = {n: (lambda _call, f=f: (f(), Run([], calls=1))[1]) for n, f in fns.items()}
    with torch.no_grad():
        return measure(engines, list(range(calls)), passes, clock=clock, sync=lambda: sync(device))


def cost_row(t: dict) -> dict:
    """greedy_ms: one greedy step, the median pass's mean; k*_greedy_steps: one step of that k in greedy steps,
    the median over passes of the pass's ratio (protocol.step_cost); *_range: min-max over passes."""
    g = t["greedy"]
    ms = spread([1e3 * sum(rep) / len(rep) for rep in g.seconds])
    row = {"greedy_ms": round(ms["median"], 4), "greedy_ms_range": [round(ms["min"], 4), round(ms["max"], 4)]}
    for n, tm in t.items():
        if n != "greedy":
            c = step_cost(g, tm)
            row[f"{n}_greedy_steps"] = round(c["median"], 3)
            row[f"{n}_greedy_steps_range"] = [round(c["min"], 3), round(c["max"], 3)]
    row["passes"] = len(g.seconds)
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


def step_cost_table(
    device, sizes: dict, ks=(2, 4, 8), batches=(1, 32), calls: int = 16, graphs: bool = False, dtype=torch.float32
) -> dict:
    """Every size and batch: the steps' cost_row, eager and (graphs) replayed as CUDA graphs, timed by step_times."""
    device = torch.device(device)
    table, graph_table, graph_errors = {}, {}, {}
    for size, spec in sizes.items():
        for b in batches:
            key = f"{size}_b{b}"
            bench = StepBench(spec, ks, b, device, dtype=dtype)
            fns = bench.steps()
            table[key] = cost_row(step_times(fns, device, calls))
            if graphs:
                try:
                    graph_table[key] = cost_row(step_times(graphed(fns, device), device, calls))
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


def compiled_step_cost(device, spec: dict, ks=(8,), batch: int = 1, calls: int = 16) -> dict:
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
    t = step_times(both, device, calls)
    row = {"compile_s": round(compile_s, 1)}
    for kind in ("eager", "compiled"):
        row[kind] = cost_row({n.split("_", 1)[1]: tm for n, tm in t.items() if n.startswith(kind + "_")})
    # eager greedy's time per call over compiled greedy's, per pass: median over passes
    row["compiled_greedy_vs_eager"] = round(step_cost(t["compiled_greedy"], t["eager_greedy"])["median"], 3)
    return row


# ---------------------------------------------------------------------------------------------- speedup
def race(greedy_fn, block_fn, batches: list, k: int, device, reps: int = MIN_REPS, clock=time.perf_counter) -> dict:
    """Greedy vs blockwise (each: source batch -> DecodeResult) timed by bench/protocol.py's measure() with the
    batches as units (a warm-up pass, then `reps` >= 3 passes taking turns batch by batch, CUDA synchronised
    around every timed call): agreement, k-hat, and the speedup as the median over batches of the rate ratio."""
    device = torch.device(device)
    steps: dict[int, tuple[float, int]] = {}

    def greedy_run(unit):
        r = greedy_fn(unit[1])
        return Run(r.tokens, r.calls)

    def block_run(unit):
        i, src = unit
        r = block_fn(src)
        steps[i] = (r.mean_accepted * r.row_steps, r.row_steps)  # k-hat per row-step, as DecodeResult defines it
        return Run(r.tokens, r.calls)

    with torch.no_grad():
        t = measure(
            {"greedy": greedy_run, "blockwise": block_run},
            list(enumerate(batches)),
            reps,
            clock=clock,
            sync=lambda: sync(device),
        )
    g, b = t["greedy"], t["blockwise"]
    same, rows = matches(g, b)
    tok, row_steps = (sum(x) for x in zip(*steps.values()))
    up = speedup(g, b)
    return dict(
        k=k,
        agreement=round(same / rows, 4),
        mean_accepted=round(tok / max(row_steps, 1), 3),
        calls=b.calls,
        speedup=round(up["median"], 3),
        speedup_spread={x: round(y, 3) for x, y in up.items()},
        greedy_ms_per_batch=round(1e3 * statistics.median(sum(rep) for rep in g.seconds) / len(batches), 3),
        reps=reps,
    )


def time_decoders(model, batches: list[torch.Tensor], k: int, max_len, device, repeats: int = MIN_REPS) -> dict:
    """Greedy vs blockwise(Exact) on `model` over the same batches, timed by race()."""
    return race(
        lambda src: greedy(model, src, max_len=max_len),
        lambda src: blockwise(model, src, block_size=k, accept=Exact(), max_len=max_len),
        batches,
        k,
        device,
        repeats,
    )


def random_speedups(
    device, sizes: dict, ks=(4, 8), batch_sizes=(1, 32), sentences: int = 32, max_len=32, repeats: int = MIN_REPS
) -> dict:
    """Random weights: at these sizes the models repeat one token and the heads predict it too, so nearly every
    block is accepted: the side of the trade where the heads are right."""
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


def demo_speedups(device, demo_dir: Path, sentences: int = 64, repeats: int = MIN_REPS) -> dict:
    """The demo's trained head runs (make demo), if this tree has them: wall clock at batch 1 and 32."""
    from bpd_train.sources.loading import load

    runs = sorted(p for p in demo_dir.glob("*/heads/*") if (p / "checkpoints").is_dir())
    if not runs:
        where = demo_dir.resolve()
        return {"present": False, "looked_in": str(where.relative_to(ROOT) if where.is_relative_to(ROOT) else where)}
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
