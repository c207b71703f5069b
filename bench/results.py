# python bench/results.py --report artifacts/demo/bible_en_fr/eval/demo-k4/report.json [--bench engine.json] --readme
# python bench/results.py --readme            (copy docs/results.md's headline block into README.md again)
# make results                               (the first form, on make demo's report)
"""docs/results.md from measurements, never by hand: the evaluation report of `make demo` (report.json, written by
evaluate.py / the pipeline) and optionally the last JSON line of `python bench/engine.py --regimes ...`.

The page starts with the headline block, between the markers below; `--readme` copies that block into README.md
between the same markers, and tests/test_docs.py fails when the two differ. Every table carries a header line with
the command that produced it, the CPU, threads, torch version and date.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bpd_train.app.cli import exits_on_user_error  # noqa: E402
from bpd_train.engine.fastlinear import cpu_model as machine_cpu  # noqa: E402  (for reports that did not record one)
from bpd_train.evaluation.report import cell_text, quality, quality_sentences  # noqa: E402
from bpd_train.io import atomic_write_bytes, atomic_write_text  # noqa: E402

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
BLOCK = re.compile(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), re.S)
DEMO_REPORT = "artifacts/demo/bible_en_fr/eval/demo-k4/report.json"
PLOTS = ("speedup_vs_k.png", "bleu_vs_khat.png")
PLACEHOLDER = (
    "No results yet: run `make demo`, then `make results` "
    "(`python bench/results.py --report " + DEMO_REPORT + " --readme`) writes the table here."
)


class ResultsError(ValueError):
    pass


def _fmt(x, nd=2) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def report_header(report: dict) -> str:
    env, d = report.get("environment", {}), report.get("data", {})
    cpu = env.get("cpu")
    cpu = (
        f"CPU {cpu}"
        if cpu
        else (f"CPU {machine_cpu()} (read when this page was generated; the report names {env.get('device')})")
    )
    command = str(report.get("command", "?")).replace(f"{ROOT}/", "")  # paths relative to the clone, not this machine's
    return (
        f"`{command}` — {cpu}, {env.get('threads')} thread(s), torch {env.get('torch')}, "
        f"{str(report.get('created', '?'))[:10]}; {d.get('name', 'corpus')} {d.get('split', '')}, "
        f"{d.get('sentences')} sentences"
        + (f" timed, BLEU over {quality_sentences(report)}" if quality_sentences(report) else "")
        + f", {d.get('src_lang', '?')} → {d.get('tgt_lang', '?')}"
        + decode_note(report)
        + "."
    )


def decode_note(report: dict) -> str:
    """How the heads runs decoded (the first one's settings; evaluate applies one setting to all): engine, precision,
    proposals."""
    dec = next((c.get("decode") for c in report.get("checkpoints", []) if c.get("k", 1) > 1 and c.get("decode")), None)
    if not dec:
        return ""
    over = f"a draft vocabulary of {dec['draft_vocab']} tokens" if dec.get("draft_vocab") else "the full vocabulary"
    prec = f" in {dec['proposal_dtype']}" if dec.get("proposal_dtype") else ""
    return (
        f"; {dec.get('engine', '?')} engine, {dec.get('dtype', 'fp32')} decoding, heads 2..k propose over {over}{prec}"
    )


def headline_table(report: dict) -> str:
    """Rows: greedy (k = 1), then every (k, batch) of exact acceptance; columns: the evaluated checkpoints; cells
    BLEU / k̂ / speedup over greedy decoding of the same checkpoint."""
    cks = report["checkpoints"]
    rows = [r for r in report["rows"] if r["rule"] == "exact"]
    if not cks or not rows:
        raise ResultsError("the report has no exact-acceptance rows: evaluate with decode.rules including exact")
    cell = {(r["checkpoint"], r["k"], r["batch_size"]): r for r in rows}
    keys = sorted({(r["k"], r["batch_size"]) for r in rows if r["k"] > 1})
    lines = [
        "| k, batch | " + " | ".join(c["name"] for c in cks) + " |",
        "|---|" + "---|" * len(cks),
        "| 1 (greedy) | " + " | ".join(f"{_fmt(c['greedy']['bleu'])} / 1.00 / 1.00×" for c in cks) + " |",
    ]
    n = quality_sentences(report)
    if n:  # BLEU over more sentences than are timed: what each regime costs (exact output = greedy output)
        sign = lambda x: "" if x is None else f" ({x:+.2f})"  # noqa: E731
        lines.append(
            f"| BLEU, {n} sentences (Δ base) | "
            + " | ".join(
                f"{_fmt(quality(c)['bleu'])}{sign(c.get('bleu_vs_base')) if c.get('regime') != 'base' else ''}"
                for c in cks
            )
            + " |"
        )
    for k, bs in keys:
        cells = []
        for c in cks:
            r = cell.get((c["name"], k, bs))
            cells.append("–" if r is None else cell_text(r))
        lines.append(f"| {k}, {bs} | " + " | ".join(cells) + " |")
    agree = sorted({r["agreement"] for r in rows if r.get("agreement") is not None})
    note = (
        "Cells: BLEU / k̂ (mean accepted block size) / wall-clock speedup over greedy decoding of the same "
        "checkpoint; exact acceptance, agreement with greedy "
        + (f"{agree[0]:g}%" if len(agree) == 1 else f"{_fmt(agree[0], 1)}–{_fmt(agree[-1], 1)}%")
        + "."
        + (
            " In brackets: the same decoding with adaptive feeding (proposals only while the heads pay, else "
            "greedy steps; the same output), timed in the same run: what `translate` and `Translator` run on the "
            "CPU."
            if any(r.get("adaptive_speedup") is not None for r in rows)
            else ""
        )
        + (
            f" The BLEU row scores greedy output (which exact blockwise output equals) over {n} sentences of the "
            f"split; the cells, over the {report['data'].get('sentences')} that are timed, move by about a point "
            "between runs of the same regime."
            if n
            else ""
        )
    )
    return "\n".join(lines) + "\n\n" + note


def headline_block(report: dict | None, plots: list[str], rel: str) -> str:
    """The block between the markers. `rel`: path prefix from the page holding the block to docs/."""
    if report is None:
        return PLACEHOLDER + "\n"
    lines = [report_header(report), "", headline_table(report), ""]
    best = report.get("best") or {}
    if best.get("checkpoint"):
        lines += [f"Exported as the recommended run: **{best['checkpoint']}** — {best['reason']}.", ""]
    if plots:
        lines += [" ".join(f"![{Path(p).stem}]({rel}{p})" for p in plots), ""]
    return "\n".join(lines)


def bench_section(bench: dict, command: str, date: str) -> str:
    rows = bench.get("regimes")
    if not rows:
        raise ResultsError(
            "the bench JSON has no 'regimes' rows: use the last line of `python bench/engine.py --regimes RUN...`"
        )
    threads = sorted({r["threads"] for r in rows})
    decoders = list(dict.fromkeys(r["decoder"] for r in rows if r["decoder"] != "greedy"))
    key = {(r["run"], r["batch"], r["dtype"], r["decoder"]): r for r in rows}
    lines = [
        "## The engine's options on the same runs",
        "",
        f"`{command}` — CPU {bench.get('cpu', '?')}, {'/'.join(map(str, threads))} thread(s), torch "
        f"{bench.get('torch', 'not recorded')}, engine {bench.get('engine', '?')}, {date}.",
        "",
        "Speedup over greedy decoding of the same checkpoint and precision (k̂ in brackets); every decoder "
        "decodes the same batches, interleaved.",
        "",
        "| run | batch | dtype | " + " | ".join(decoders) + " |",
        "|---|---:|---|" + "---|" * len(decoders),
    ]
    for run, bs, dt in dict.fromkeys((r["run"], r["batch"], r["dtype"]) for r in rows):
        cells = []
        for name in decoders:
            r = key.get((run, bs, dt, name))
            cells.append(
                "–"
                if r is None
                else f"{r['speedup']:.2f}× ({r['khat']:.2f})"
                + ("" if r.get("same", 1.0) == 1.0 else f", {r['same']:.0%} = greedy")
            )
        lines.append(f"| {run} | {bs} | {dt} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def page(block: str, report_path: str | None, report: dict | None, bench: str) -> str:
    how = "python bench/results.py --report " + (report_path or DEMO_REPORT) + " --readme"
    lines = [
        "# Results",
        "",
        "Generated by `" + how + "` (`make results`) from the evaluation report of `make demo`;",
        "do not edit by hand. README.md shows the block between the markers.",
        "",
        BEGIN,
        block + END,
        "",
    ]
    if report is not None:
        lines += [
            "## Full evaluation report",
            "",
            f"The report beside the table (`{Path(report_path).with_name('report.md')}`) has every rule, "
            "batch size, chrF, decoder calls and seconds; the regimes are explained in "
            "[getting-started.md](getting-started.md).",
            "",
        ]
    if bench:
        lines += [bench]
    return "\n".join(lines)


def extract_block(text: str, where: str = "text") -> str:
    m = BLOCK.search(text)
    if m is None:
        raise ResultsError(f"{where} has no {BEGIN} … {END} block")
    return m.group(1)


def replace_block(text: str, block: str, where: str = "text") -> str:
    extract_block(text, where)
    return BLOCK.sub(lambda _: BEGIN + "\n" + block + END, text, count=1)


def generate(
    report_path: str | None, bench_path: str | None, bench_command: str | None, docs: Path, readme: Path | None
) -> str:
    report = None
    if report_path:
        from bpd_train.evaluation.report import load_report

        try:
            report = load_report(report_path)
        except (OSError, ValueError) as e:
            raise ResultsError(str(e)) from None
    plots = []
    if report is not None:
        src = Path(report_path)
        src = src if src.is_dir() else src.parent
        (docs / "results").mkdir(parents=True, exist_ok=True)
        for name in PLOTS:
            if (src / name).is_file():
                atomic_write_bytes(docs / "results" / name, (src / name).read_bytes())
                plots.append("results/" + name)
    bench = ""
    if bench_path:
        try:
            lines = [x for x in Path(bench_path).read_text(encoding="utf-8").splitlines() if x.strip()]
            data = json.loads(lines[-1])
        except (OSError, ValueError, IndexError) as e:
            raise ResultsError(f"{bench_path}: not the JSON line of bench/engine.py ({e})") from None
        command = data.get("command") or bench_command
        if not command:
            raise ResultsError("say which command wrote the bench JSON: --bench-command 'python bench/engine.py ...'")
        date = data.get("date") or time.strftime("%Y-%m-%d", time.gmtime(Path(bench_path).stat().st_mtime))
        bench = bench_section(data, command, date)
    out = page(headline_block(report, plots, ""), report_path, report, bench)
    docs.mkdir(parents=True, exist_ok=True)
    atomic_write_text(docs / "results.md", out)
    if readme is not None:
        copy_to_readme(docs / "results.md", readme)
    return out


def copy_to_readme(results_md: Path, readme: Path) -> None:
    block = extract_block(results_md.read_text(encoding="utf-8"), str(results_md))
    # links in docs/results.md are relative to docs/; in README.md to the repository root
    block = re.sub(r"\]\((results/[^)]+)\)", r"](docs/\1)", block)
    atomic_write_text(readme, replace_block(readme.read_text(encoding="utf-8"), block, str(readme)))


def readme_block_matches(results_md: Path, readme: Path) -> bool:
    want = re.sub(r"\]\((results/[^)]+)\)", r"](docs/\1)", extract_block(results_md.read_text(encoding="utf-8")))
    return extract_block(readme.read_text(encoding="utf-8")) == want


@exits_on_user_error
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report", help=f"an evaluation report.json or its folder (make demo: {DEMO_REPORT})")
    ap.add_argument("--bench", help="a file whose last line is bench/engine.py --regimes' JSON")
    ap.add_argument("--bench-command", help="the command that wrote --bench (when its JSON does not record it)")
    ap.add_argument("--docs", default=str(ROOT / "docs"), help="where results.md (and results/*.png) go")
    ap.add_argument(
        "--readme",
        nargs="?",
        const=str(ROOT / "README.md"),
        default=None,
        help="also copy the headline block into this README (default README.md)",
    )
    ap.add_argument("--placeholder", action="store_true", help="write the page without results (fresh clone)")
    a = ap.parse_args(argv)
    if a.report or a.bench or a.placeholder:
        if a.bench and not a.report:
            raise ResultsError("--bench needs --report (the page's headline comes from the evaluation report)")
        generate(a.report, a.bench, a.bench_command, Path(a.docs), Path(a.readme) if a.readme else None)
    elif a.readme:
        copy_to_readme(Path(a.docs) / "results.md", Path(a.readme))
    else:
        raise ResultsError("nothing to do: give --report REPORT (and --readme), or --readme alone")
    print(f"wrote {Path(a.docs) / 'results.md'}" + (f" and the block in {a.readme}" if a.readme else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
