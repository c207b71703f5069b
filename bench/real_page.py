# python bench/real.py --render docs/results/real-amx.json          (that page again)
# python bench/real_page.py                 (every committed page, README's block, docs/engine.md's per-CPU table)
"""The real-model results pages, rendered from the JSON bench/real.py writes, and nothing else: every committed
page docs/results-real-<isa>.md is its docs/results/real-<isa>.json rendered (tests/test_bench_real.py re-renders
and compares), README.md's real-model block is README_JSON's headline table, and docs/engine.md's per-CPU table
is every committed run's step cells."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- real:begin -->", "<!-- real:end -->"
README_JSON = "docs/results/real-avx512-zen5-45-halfkv.json"  # the run README.md shows
ENGINE_BEGIN, ENGINE_END = "<!-- engine:begin -->", "<!-- engine:end -->"  # docs/engine.md's per-CPU table


def tag(result: dict) -> str:
    """The page's name part: the instruction set the engine ran on (amx, avx512, avx2, torch)."""
    return str(result.get("isa", "torch")).removeprefix("native-")


def _x(s: dict | None, quartiles: bool = True) -> str:
    """A speed ratio: median [quartiles] over requests (or min-max)."""
    if not s:
        return "–"
    lo, hi = (s["p25"], s["p75"]) if quartiles else (s["min"], s["max"])
    return f"{s['median']:.2f}× [{lo:.2f}–{hi:.2f}]"


def _tok(s: dict | None) -> str:
    """Tokens/s: median (min–max) over passes."""
    if not s:
        return "–"
    return f"{s['median']:.1f} ({s['min']:.1f}–{s['max']:.1f})"


def _frac(v) -> str:
    return "–" if not v else f"{v[0]}/{v[1]}"


def _bpw(e: dict) -> str:
    b = e.get("bytes_per_weight")
    return "" if b is None else f", {b:.2f} B"


def _label(e: dict) -> str:
    """Who and in what precision: 'ours int8, 1.00 B' / 'llama.cpp Q4_1 (the file), 0.63 B'."""
    if e.get("engine") == "llama.cpp":
        shipped = " (the file as shipped)" if e.get("as_shipped") else " (requantized)"
        return f"llama.cpp {e.get('type', '')}{shipped}" + _bpw(e)
    return f"{e.get('engine', 'ours')} {e.get('dtype', '')}".strip() + _bpw(e)


def _decoding(e: dict, named: bool = False) -> str:
    """How an engine decoded; named: with its heads' name (a cell that times several trained models)."""
    if e.get("decoder") != "blockwise":
        return e.get("decoder", "greedy")
    out = "exact blockwise" + (f", {e['heads']}" if named and e.get("heads") else "") + f", k = {e['k']}"
    if e.get("lookup"):
        out += f", lookup {e['lookup']}"
    if e.get("narrow"):
        out += f", narrow {e['narrow']}"
    if e.get("tree"):
        out += f", tree {e['tree']}"
    if e.get("adaptive"):
        out += ", adaptive"
    return out


def _table(header: list[str], align: str, lines: list[list[str]]) -> list[str]:
    rule = "|" + "|".join("---" if a == "l" else "---:" for a in align) + "|"
    return ["| " + " | ".join(header) + " |", rule, *("| " + " | ".join(c) + " |" for c in lines), ""]


def _order(e: dict) -> tuple:
    eng = {"llama.cpp": 0, "ours": 1}.get(e.get("engine"), 2)
    dt = {"fp32": 0, "int8": 1, "q4": 2, "bf16": 3}.get(e.get("dtype"), 4)
    return (eng, not e.get("as_shipped"), dt, e.get("decoder") != "greedy")


def _several_heads(cell: dict) -> bool:
    """Whether a cell times more than one trained model (its blockwise rows then name their heads)."""
    return len({e.get("heads") for e in cell["engines"] if e.get("decoder") == "blockwise"}) > 1


def headline_rows(cell: dict) -> list[list[str]]:
    """One line per engine of a batch-1 cell: precision and bytes, decoding, tokens/s, speed over our greedy of
    the same precision and over the reference (llama.cpp's greedy on the file), k-hat, exactness, fp32 answers."""
    named = _several_heads(cell)
    return [
        [
            _label(e),
            _decoding(e, named),
            _tok(e["tok_s"]),
            _x(e.get("vs_greedy")),
            "1 (reference)" if e["name"] == cell.get("reference") else _x(e.get("vs_reference")),
            f"{e['k_hat']:.2f}" if e.get("decoder") == "blockwise" and "k_hat" in e else "–",
            _frac(e.get("identical_to_greedy")),
            _frac(e.get("matches_fp32")),
        ]
        for e in sorted(cell["engines"], key=_order)
    ]


HEADLINE_HEADER = [
    "engine, precision, bytes a weight",
    "decoding",
    "tokens/s, median (min–max) over passes",
    "× our greedy, same precision",
    "× llama.cpp greedy, same file",
    "k̂",
    "ids = greedy's",
    "answers = fp32's",
]


def _first(result: dict, kind: str) -> dict | None:
    return next((r for r in result["rows"] if r.get("kind") == kind), None)


def protocol_line(result: dict) -> str:
    p, q = result["protocol"], result["prompts"]
    src = f"`{q['file']}`" if q.get("file") else "the bench's eight general questions"
    return (
        f"{q['count']} requests ({src}), {result['new_tokens']} new tokens at most, batch 1 unless named; "
        f"{p['warmup']}, then {p['reps']} timed passes with the engines taking turns request by request; "
        f"prompt caches: {p['prompt_cache']}. Speed ratios are medians over requests of each request's rate ratio "
        "(its median over passes), [quartiles over requests]; tokens/s are per pass, median (min–max)."
    )


def machine_line(result: dict) -> str:
    llama = f", llama-cpp-python {result['llama_cpp']}" if result.get("llama_cpp") else ""
    load = result.get("load_average")
    busy = f", 1-min load average {load[0]:.1f} at the start and {load[1]:.1f} at the end" if load else ""
    return (
        f"{result['cpu']} ({result['isa']} engine), torch {result['torch']}{llama}, {result['date']}; "
        f"model {result['model']} (matrices {result.get('shipped_type', '?')}); {result.get('minutes', '?')} min{busy}"
    )


def headline(result: dict, link: str) -> str:
    """README's block: the first batch-1 cell's table, what produced it, and where the rest is."""
    cell = _first(result, "batch 1")
    if cell is None:
        raise ValueError("no batch-1 cell in this result")
    lines = [
        f"`{result['command']}` — {machine_line(result)}, {cell['threads']} thread(s). {protocol_line(result)} "
        f"Every cell, batch 8, step costs, per kind of request and transformers: [{link}]({link}).",
        "",
        *_table(HEADLINE_HEADER, "llrrrrrr", headline_rows(cell)),
    ]
    return "\n".join(lines).rstrip("\n")


def page(result: dict, json_name: str | None = None) -> str:
    """The whole results page of one run (json_name: its JSON's file name; real-<isa>.json unless given)."""
    name = json_name or f"real-{tag(result)}.json"
    out = [
        "# SmolLM2-135M-Instruct on a CPU: decoding speed under one protocol",
        "",
        f"Generated from its JSON by `python bench/real.py --render docs/results/{name}` (do not "
        f"edit). Measured by `{result['command']}` on {machine_line(result)}.",
        "",
        protocol_line(result),
        "",
        "Columns: `× our greedy` is exact blockwise decoding over greedy decoding of the same precision in the same "
        "cell; `ids = greedy's` counts the requests whose ids equal that greedy's (the exact rule); `answers = "
        "fp32's` counts those equal to the model's fp32 greedy answers (the file's own weights, untimed reference).",
        "",
    ]
    for cell in result["rows"]:
        if "skipped" in cell:
            out += [f"## {cell['kind']}, {cell['threads']} thread(s): skipped ({cell['skipped']})", ""]
            continue
        kind = cell["kind"]
        if kind == "batch 1":
            out += [f"## Batch 1, {cell['threads']} thread(s), every engine interleaved", ""]
            out += _table(HEADLINE_HEADER, "llrrrrrr", headline_rows(cell))
            out += per_kind_table(cell)
        elif kind == "batch":
            out += [f"## Batch {cell['batch']}, {cell['dtype']}, {cell['threads']} thread(s)", ""]
            out += _table(
                [
                    "decoding",
                    "tokens/s, median (min–max)",
                    "× greedy, median [quartiles] over batches",
                    "ids = greedy's",
                ],  # fmt: skip
                "lrrr",
                [
                    [
                        _decoding(e, _several_heads(cell)),
                        _tok(e["tok_s"]),
                        _x(e.get("vs_greedy")),
                        _frac(e.get("identical_to_greedy")),
                    ]  # fmt: skip
                    for e in cell["engines"]
                ],
            )
        elif kind == "step":
            out += [
                f"## What a k-row step costs, {cell['dtype']}, {cell['threads']} thread(s) (zero-initialised heads)",
                "",
            ]
            g = next(e for e in cell["engines"] if e.get("decoder") == "greedy")
            out += [f"Greedy: {_tok(g['tok_s'])} tokens/s over {cell['requests']} requests.", ""]
            out += _table(
                ["k", "step cost in greedy steps, median (min–max) over passes", "ids = greedy's"],
                "rrr",
                [
                    [
                        str(e["k"]),
                        f"{e['step_cost']['median']:.2f} ({e['step_cost']['min']:.2f}–{e['step_cost']['max']:.2f})",
                        _frac(e.get("identical_to_greedy")),
                    ]  # fmt: skip
                    for e in cell["engines"]
                    if "step_cost" in e
                ],
            )
        elif kind == "transformers":
            out += [
                f"## Greedy against transformers' generate (fp32, same file, no prompt cache on either side), "
                f"{cell['threads']} thread(s); transformers {cell.get('transformers', '?')}",
                "",
            ]
            out += _table(
                ["engine", "tokens/s, median (min–max)", "× transformers, median [quartiles]", "ids = transformers'"],
                "lrrr",
                [
                    [e["name"], _tok(e["tok_s"]), _x(e.get("vs_greedy")), _frac(e.get("identical_to_greedy"))]
                    for e in cell["engines"]
                ],
            )
    out += sampling_section([r for r in result["rows"] if r.get("kind") == "sampling"])
    return "\n".join(out).rstrip() + "\n"


def _draws(cell: dict) -> str:
    """What a sampling cell draws from: 'T = 0.7, top-p 0.9'."""
    out = f"T = {cell['temperature']:g}"
    if cell.get("top_k"):
        out += f", top-k {cell['top_k']}"
    if cell.get("top_p", 1.0) < 1.0:
        out += f", top-p {cell['top_p']:g}"
    return out


SAMPLING_HEADER = [
    "decoding",
    "tokens/s, median (min–max) over passes",
    "× plain sampling, median [quartiles] over requests",
    "mean accepted block",
    "k̂",
    "tokens",
]


def sampling_section(cells: list[dict]) -> list[str]:
    """The sampling cells: plain sampling against blockwise sampling with the heads, per temperature, batch size
    and precision."""
    if not cells:
        return []
    out = [
        "## Sampling",
        "",
        "Plain sampling (one token per decoder call) against blockwise sampling with the trained heads: both draw "
        "from the model's sampling distribution, softmax(logits / T) within top-k / top-p. `match` keeps a draft "
        "only where it is the token plain sampling picks there (the same answers as plain sampling, token for "
        "token); `speculative` accepts a draft with probability min(1, p/q) and redraws a rejection from the "
        "residual (answers distributed alike, not the same ones). Request i draws from seed + i in every engine; "
        "speed is compared as each request's rate. `mean accepted block`: tokens a row step added, over every row "
        "step; `k̂`: tokens per decoder call, the batch's rows together.",
        "",
    ]
    for cell in cells:
        out += [
            f"### {_draws(cell)}, batch {cell['batch']}, {cell['dtype']}, {cell['threads']} thread(s), "
            f"seed {cell.get('seed', 0)}",
            "",
        ]
        out += _table(
            SAMPLING_HEADER,
            "lrrrrr",
            [
                [
                    "plain sampling"
                    if e.get("decoder") == "sampling"
                    else f"blockwise sampling, {e.get('heads', 'heads')}, k = {e['k']}"
                    + (f", lookup {e['lookup']}" if e.get("lookup") else "")
                    + (f", narrow {e['narrow']}" if e.get("narrow") else "")
                    + (f", tree {e['tree']}" if e.get("tree") else "")
                    + (f", {e['verify']}" if e.get("verify") else ""),
                    _tok(e["tok_s"]),
                    _x(e.get("vs_plain")),
                    f"{e['mean_accepted']:.2f}" if "mean_accepted" in e else "–",
                    f"{e['k_hat']:.2f}" if "k_hat" in e else "–",
                    str(e["tokens"]),
                ]
                for e in cell["engines"]
            ],
        )
    return out


def per_kind_table(cell: dict) -> list[str]:
    """Per kind of request: k-hat / speed over greedy of the same precision, for each blockwise engine."""
    blk = [e for e in sorted(cell["engines"], key=_order) if "per_kind" in e]
    if not blk:
        return []
    kinds = list(blk[0]["per_kind"])
    lines = [
        [k, str(blk[0]["per_kind"][k]["requests"])]
        + [
            f"{e['per_kind'][k]['k_hat']:.2f} / {e['per_kind'][k]['vs_greedy']['median']:.2f}×"
            if e["per_kind"][k].get("k_hat") is not None
            else "–"
            for e in blk
        ]
        for k in kinds
    ]
    named = _several_heads(cell)
    head = [
        "kind of request",
        "requests",
        *(f"{e['dtype']}{', ' + e['heads'] if named and e.get('heads') else ''}: k̂ / × greedy" for e in blk),
    ]
    return ["Per kind of request (k̂, and the median over that kind's requests of the speed over greedy):", ""] + _table(
        head, "lr" + "r" * len(blk), lines
    )


def page_path(json_path: Path) -> Path:
    """docs/results/real-<isa>.json -> docs/results-real-<isa>.md."""
    return json_path.parent.parent / f"results-{json_path.stem}.md"


def committed(root: Path = ROOT) -> list[tuple[Path, Path]]:
    """Every committed (JSON, page) pair."""
    return [(j, page_path(j)) for j in sorted((root / "docs" / "results").glob("real-*.json"))]


def extract_block(text: str, begin: str = BEGIN, end: str = END) -> str:
    if begin not in text or end not in text:
        raise ValueError(f"no {begin} ... {end} block")
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def replace_block(text: str, block: str, begin: str = BEGIN, end: str = END) -> str:
    head, rest = text.split(begin, 1)
    return f"{head}{begin}\n{block}\n{end}{rest.split(end, 1)[1]}"


ISA_ORDER = {"native-avx2": 0, "native-avx512": 1, "native-amx": 2}


def cpu_short(cpu: str) -> str:
    """'Intel(R) Xeon(R) Processor (family 6 model 207; amx_tile, ...)' -> 'Intel Xeon (family 6 model 207)'."""
    name, _, rest = cpu.partition(" (")
    name = " ".join(w for w in name.replace("(R)", "").replace("(TM)", "").split() if w != "Processor")
    fam = rest.split(";")[0].rstrip(")") if rest.startswith("family") else ""
    return f"{name} ({fam})" if fam else name


def engine_table(runs: list[tuple[str, dict]]) -> str:
    """docs/engine.md's per-CPU table: for every committed run (its JSON's name, its result) and precision, the
    CPU, the bytes a weight reads, greedy tokens/s and what a k-row step costs in greedy steps, from the run's step
    cells."""
    lines = []
    for name, result in sorted(runs, key=lambda r: (ISA_ORDER.get(r[1].get("isa"), 3), r[1].get("cpu", ""), r[0])):
        b1 = _first(result, "batch 1") or {"engines": []}
        bpw = {e.get("dtype"): e.get("bytes_per_weight") for e in b1["engines"] if e.get("engine") == "ours"}
        for cell in (r for r in result["rows"] if r.get("kind") == "step"):
            g = next(e for e in cell["engines"] if e.get("decoder") == "greedy")
            cost = {e["k"]: e["step_cost"]["median"] for e in cell["engines"] if "step_cost" in e}
            b = bpw.get(cell["dtype"])
            lines.append(
                [
                    result["isa"].removeprefix("native-"),
                    cpu_short(result.get("cpu", "")),
                    f"{cell['dtype']}, {b:.2f} B" if b is not None else cell["dtype"],
                    _tok(g["tok_s"]),
                    *(f"{cost[k]:.2f}" if k in cost else "–" for k in (4, 8)),
                    f"{cell['threads']}",
                    f"[{name}](results/{name}), {result['date']}",
                ]
            )
    cpus = sorted({f"{r['cpu']}" for _, r in runs})
    head = [
        "kernels",
        "CPU",
        "precision, bytes a weight",
        "greedy tokens/s, median (min–max)",
        "k = 4 step",
        "k = 8 step",
    ]
    out = _table([*head, "threads", "from"], "lllrrrrl", lines)
    return "\n".join([*out, "CPU: " + "; ".join(cpus) + "."]).rstrip("\n")


def engine_block(root: Path = ROOT) -> str:
    runs = [(j.name, json.loads(j.read_text(encoding="utf-8"))) for j, _ in committed(root)]
    return engine_table(runs)


def readme_block(root: Path = ROOT) -> str:
    j = root / README_JSON
    result = json.loads(j.read_text(encoding="utf-8"))
    return headline(result, str(page_path(j).relative_to(root)))


def render(json_path: Path, page_to: Path | None = None, readme: Path | None = None) -> None:
    from bpd_train.io import atomic_write_text

    result = json.loads(Path(json_path).read_text(encoding="utf-8"))
    atomic_write_text(page_to or page_path(Path(json_path)), page(result, Path(json_path).name))
    if readme is not None:
        link = "docs/" + (page_to or page_path(Path(json_path))).name
        atomic_write_text(readme, replace_block(readme.read_text(encoding="utf-8"), headline(result, link)))


def main() -> int:
    sys.path.insert(0, str(ROOT))
    from bpd_train.io import atomic_write_text

    for j, p in committed():
        render(j, p)
        print(f"wrote {p.relative_to(ROOT)}")
    readme = ROOT / "README.md"
    atomic_write_text(readme, replace_block(readme.read_text(encoding="utf-8"), readme_block()))
    print("wrote README.md's real-model block")
    engine = ROOT / "docs" / "engine.md"
    text = engine.read_text(encoding="utf-8")
    atomic_write_text(engine, replace_block(text, engine_block(), ENGINE_BEGIN, ENGINE_END))
    print("wrote docs/engine.md's per-CPU table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
