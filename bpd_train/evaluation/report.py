"""Evaluation reports: report.json (everything), report.md (tables shaped like the paper's Table 1), PNG plots."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable

from bpd_train.io import atomic_write_json, atomic_write_text

NOTES = (
    "Cells: BLEU / k̂ / wall-clock speedup over greedy decoding of the same checkpoint. Row k = 1 is greedy "
    "decoding itself. k̂ = generated tokens per decoder call after the prefill call (per sentence, "
    "averaged over accepted blocks); speedup = greedy seconds ÷ blockwise seconds on the same batches, "
    'greedy and blockwise alternating, after warm-up. "(adaptive a×)": the same blockwise decoding with '
    "adaptive feeding (proposals only while the heads pay, else greedy steps; the same output), timed in the "
    "same run: what translate.py and Translator run on the CPU with exact acceptance."
)


def cell_text(r: dict) -> str:
    """One table cell of a result row: 'BLEU / k̂ / speedup×', and the adaptive speedup where it was timed."""
    out = f"{_fmt(r['bleu'])} / {_fmt(r['mean_accepted'])} / {_fmt(r['speedup'])}×"
    if r.get("adaptive_speedup") is not None:
        out += f" (adaptive {_fmt(r['adaptive_speedup'])}×)"
    return out


BEST_RULE = (
    "the fastest of: the base model (greedy, 1.00×) and every heads run whose exact blockwise decoding "
    "(output identical to its own greedy decoding) at the smallest batch size keeps BLEU within {drop:g} of "
    "the base model's greedy BLEU; speed is the measured speedup over greedy decoding"
)


def quality(entry: dict) -> dict:
    """A checkpoint's BLEU/chrF: its greedy output over the report's quality sentences (evaluate.bleu_sentences;
    exact blockwise output is that output). Reports without a quality set: the timed sentences' greedy scores."""
    q = entry.get("quality")
    if q:
        return q
    g = entry["greedy"]
    return {"sentences": None, "bleu": g.get("bleu"), "chrf": g.get("chrf"), "hyp_file": g.get("hyp_file")}


def quality_sentences(report: dict) -> int | None:
    """How many sentences the quality scores cover, when they are more than the timed ones (else None)."""
    d = report.get("data") or {}
    n = d.get("quality_sentences")
    return n if n and n != d.get("sentences") else None


def _over(report: dict) -> str:
    n = quality_sentences(report)
    return f" over {n} sentences" if n else ""


def _fmt(x, nd=2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    return f"{x:.{nd}f}"


def _col_name(entry: dict) -> str:
    name, regime = entry["name"], entry.get("regime")
    return name if not regime or regime in name else f"{name} ({regime})"


def table1(report: dict, rule: str, batch_size: int, checkpoints: Iterable[dict] | None = None) -> str:
    """Rows k, columns checkpoints (regimes), cells 'BLEU / k̂ / speedup×' for one acceptance rule and batch size."""
    cks = list(checkpoints if checkpoints is not None else report["checkpoints"])
    rows = [r for r in report["rows"] if r["rule"] == rule and r["batch_size"] == batch_size]
    ks = sorted({1} | {r["k"] for r in rows})
    cell = {(r["checkpoint"], r["k"]): r for r in rows}
    lines = ["| k | " + " | ".join(_col_name(c) for c in cks) + " |", "|---:|" + "---|" * len(cks)]
    for k in ks:
        cells = []
        for c in cks:
            if k == 1:
                cells.append(f"{_fmt(c['greedy']['bleu'])} / 1.00 / 1.00×")
            elif (c["name"], k) in cell:
                cells.append(cell_text(cell[(c["name"], k)]))
            else:
                cells.append("–")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _combos(report: dict) -> list[tuple[str, str, int]]:
    seen = []
    for r in report["rows"]:
        key = (r["rule"], r.get("rule_label", r["rule"]), r["batch_size"])
        if key not in seen:
            seen.append(key)
    if not seen:  # only plain models (k = 1): one greedy table per batch size
        seen = [("greedy", "Greedy", b) for b in report["settings"]["batch_sizes"]]
    return seen


# ------------------------------------------------------------------------------------ comparison points
def base_entry(report: dict) -> dict | None:
    """The base model among the evaluated checkpoints (the first, if several): every regime starts from it."""
    return next((c for c in report["checkpoints"] if c.get("regime") == "base"), None)


def _diff(a, b):
    return None if a is None or b is None or any(isinstance(x, float) and math.isnan(x) for x in (a, b)) else a - b


def add_comparisons(report: dict) -> None:
    """What each run cost: its greedy BLEU minus the base model's greedy BLEU and minus the teacher's beam BLEU on
    the same sentences (exact blockwise output is the greedy output, so this is its BLEU at every k), and the run
    to recommend (report["best"], see BEST_RULE)."""
    base, teacher = base_entry(report), report.get("teacher") or {}
    base_bleu = quality(base)["bleu"] if base else None
    report["comparison"] = {
        "base": base["name"] if base else None,
        "base_bleu": base_bleu,
        "teacher_bleu": teacher.get("bleu"),
        "teacher_train_bleu": teacher.get("train_bleu"),
    }
    for c in report["checkpoints"]:
        c["bleu_vs_base"] = _diff(quality(c)["bleu"], base_bleu)
        c["bleu_vs_teacher"] = _diff(quality(c)["bleu"], teacher.get("bleu"))
    report["best"] = choose_best(report)


def exact_rows(report: dict) -> list[dict]:
    """The report's rows of exact blockwise decoding at its smallest batch size whose output is greedy's (agreement
    100 %) and whose speed was measured: what a recommendation chooses among."""
    bs = min(report["settings"]["batch_sizes"])
    return [
        r
        for r in report["rows"]
        if r["rule"] == "exact"
        and r["batch_size"] == bs
        and r["agreement"] == 100.0
        and r["speedup"] is not None
        and not math.isnan(r["speedup"])
    ]


def choose_best(report: dict) -> dict:
    """The run to hand a user (the demo exports it): see BEST_RULE. Ties go to the higher k̂."""
    drop = float(report["settings"].get("max_bleu_drop", 1.0))
    rule = BEST_RULE.format(drop=drop) + (f"; BLEU{_over(report)} of the split" if _over(report) else "")
    base = base_entry(report)
    if base is None:
        return {
            "checkpoint": None,
            "path": None,
            "rule": rule,
            "reason": "no base model among the evaluated checkpoints: no BLEU to hold the heads runs to",
        }
    floor = quality(base)["bleu"] - drop
    costs = bleu_costs(report, base)
    rows = [r for r in exact_rows(report) if r["model_k"] > 1]
    bleu = {c["name"]: quality(c)["bleu"] for c in report["checkpoints"]}  # exact output = greedy output
    ok = [r for r in rows if bleu[r["checkpoint"]] >= floor - 1e-9]
    fastest = max(ok, key=lambda r: (r["speedup"], r["mean_accepted"]), default=None)
    path = {c["name"]: c["path"] for c in report["checkpoints"]}
    if fastest is not None and fastest["speedup"] > 1.0:
        return {
            "checkpoint": fastest["checkpoint"],
            "path": path[fastest["checkpoint"]],
            "k": fastest["k"],
            "rule": rule,
            "bleu_vs_base": costs,
            "reason": f"{fastest['speedup']:.2f}× at k = {fastest['k']}, BLEU "
            f"{bleu[fastest['checkpoint']]:.2f} vs base {quality(base)['bleu']:.2f}"
            f"{_over(report)}",
        }
    lost = sorted({r["checkpoint"] for r in rows} - {r["checkpoint"] for r in ok})
    why = (
        "no heads run is within the BLEU margin"
        if not ok
        else f"no heads run within the BLEU margin is faster than greedy decoding (best: {fastest['checkpoint']}, "
        f"{fastest['speedup']:.2f}× at k = {fastest['k']})"
    )
    if lost:
        why += f"; lost too much BLEU: {', '.join(lost)}"
    return {
        "checkpoint": base["name"],
        "path": base["path"],
        "k": 1,
        "rule": rule,
        "bleu_vs_base": costs,
        "reason": f"the base model: {why}",
    }


def bleu_costs(report: dict, base: dict) -> dict[str, float]:
    """What each heads run costs (or gains) in BLEU against the base, over the report's quality sentences."""
    b = quality(base)["bleu"]
    return {
        c["name"]: round(quality(c)["bleu"] - b, 2)
        for c in report["checkpoints"]
        if c is not base and quality(c)["bleu"] is not None and b is not None
    }


def comparison_table(report: dict) -> str:
    """One row per checkpoint: greedy BLEU, its difference from the base and the teacher, k̂ and speedup at its k."""
    bs = min(report["settings"]["batch_sizes"]) if report["rows"] else None
    n = quality_sentences(report)
    lines = [
        f"| checkpoint | regime | BLEU{f' ({n} sentences)' if n else ''} | Δ base | Δ teacher | "
        f"k̂ (exact, k, batch {bs}) | speedup |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for c in report["checkpoints"]:
        row = next(
            (
                r
                for r in report["rows"]
                if r["checkpoint"] == c["name"] and r["rule"] == "exact" and r["k"] == c["k"] and r["batch_size"] == bs
            ),
            None,
        )
        sign = lambda x: "–" if x is None else f"{x:+.2f}"  # noqa: E731
        lines.append(
            f"| {c['name']} | {c.get('regime') or '–'} | {_fmt(quality(c)['bleu'])} | "
            f"{sign(c.get('bleu_vs_base'))} | {sign(c.get('bleu_vs_teacher'))} | "
            f"{_fmt(row['mean_accepted']) if row else '–'} | {_fmt(row['speedup']) + '×' if row else '–'} |"
        )
    return "\n".join(lines)


def comparison_markdown(report: dict) -> list[str]:
    cmp, t = report.get("comparison") or {}, report.get("teacher")
    lines = ["## What each run cost", ""]
    base = (
        f"base model `{cmp['base']}`: greedy BLEU {_fmt(cmp['base_bleu'])}{_over(report)}"
        if cmp.get("base")
        else "base model: not among the evaluated checkpoints"
    )
    lines.append(base + "  ")
    if t:
        how = f"beam {t.get('beam_size')}, α {t.get('length_penalty')}"
        if t.get("bleu") is not None:
            here = f"BLEU {_fmt(t.get('bleu'))} on {t.get('sentences') or 'these'} evaluation sentences"
        elif t.get("self_distilled"):  # the model answered its own prompts: its greedy BLEU is the base's column
            here = "the base model itself (self-distillation, greedy): see its row"
        else:
            here = f"not decoded here ({t.get('missing', 'checkpoint missing')})"
        lines.append(
            f"teacher `{t.get('teacher_path')}` ({how}; corpus `{t.get('corpus')}`): {here}; BLEU "
            f"{_fmt(t.get('train_bleu'))} on the {t.get('train_sentences')} training sources it "
            "re-translated  "
        )
    else:
        lines.append("teacher: no distillation corpus given (evaluate.distilled)  ")
    n = quality_sentences(report)
    lines += [
        "",
        "Δ = the checkpoint's greedy BLEU minus the base's / the teacher's on the same sentences (exact "
        "blockwise output equals greedy output, so this is what the regime cost at any k)"
        + (
            f"; BLEU over {n} sentences of the split (evaluate.bleu_sentences), where the tables above "
            f"decode and time {(report.get('data') or {}).get('sentences')}."
            if n
            else "."
        ),
        "",
        comparison_table(report),
        "",
    ]
    best = report.get("best")
    if best:
        lines += [
            "## Recommended run",
            "",
            f"Rule: {best['rule']}.  ",
            f"Choice: **{best['checkpoint'] or 'none'}** — {best['reason']}.",
            *(
                [
                    "",
                    "BLEU against the base: "
                    + ", ".join(f"{name} {d:+.2f}" for name, d in best["bleu_vs_base"].items())
                    + ".",
                ]
                if best.get("bleu_vs_base")
                else []
            ),
            "",
        ]
    return lines


def detail_table(rows: list[dict]) -> str:
    head = (
        "| checkpoint | k | rule | batch | BLEU | chrF | k̂ | calls | greedy calls | agreement % | greedy s | "
        "blockwise s | speedup | adaptive |"
    )
    lines = [head, "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['checkpoint']} | {r['k']} | {r.get('rule_label', r['rule'])} | {r['batch_size']} | "
            f"{_fmt(r['bleu'])} | {_fmt(r['chrf'])} | {_fmt(r['mean_accepted'])} | {r['calls']} | "
            f"{r['greedy_calls']} | {_fmt(r['agreement'], 1)} | {_fmt(r['greedy_seconds'], 3)} | "
            f"{_fmt(r['blockwise_seconds'], 3)} | {_fmt(r['speedup'])}× | "
            f"{_fmt(r.get('adaptive_speedup'))}{'×' if r.get('adaptive_speedup') is not None else ''} |"
        )
    return "\n".join(lines)


def markdown(report: dict, plots: list[str] | None = None) -> str:
    d, env = report.get("data", {}), report.get("environment", {})
    title = f"{d.get('name', 'corpus')} {d.get('split', '')}".strip()
    lines = [
        f"# Blockwise parallel decoding: {title}, {d.get('sentences')} sentences",
        "",
        f"Command: `{report.get('command', '')}`  ",
        f"Device: {env.get('device')}, torch {env.get('torch')}, {env.get('threads')} thread(s); "
        f"{report.get('created', '')}  ",
        f"Direction: {d.get('src_lang', '?')} → {d.get('tgt_lang', '?')}; max_len {report['settings']['max_len']}  ",
        f"BLEU signature: `{report['signatures']['bleu']}`  ",
        f"chrF signature: `{report['signatures']['chrf']}`",
        "",
        NOTES,
        "",
    ]
    for rule, label, bs in _combos(report):
        what = "decoding" if rule == "greedy" else "acceptance"
        lines += [f"## {label} {what}, batch size {bs}", "", table1(report, rule, bs), ""]
    if "comparison" in report:
        lines += comparison_markdown(report)
    if report["rows"]:
        lines += ["## All results", "", detail_table(report["rows"]), ""]
    n = quality_sentences(report)
    more = f" | BLEU, {n} sentences | chrF, {n} sentences" if n else ""
    lines += [
        "## Checkpoints",
        "",
        f"| name | regime | k | greedy BLEU | greedy chrF{more} | path |",
        "|---|---|---:|---:|---:|" + ("---:|---:|" if n else "") + "---|",
    ]
    for c in report["checkpoints"]:
        q = f" | {_fmt(quality(c)['bleu'])} | {_fmt(quality(c)['chrf'])}" if n else ""
        lines.append(
            f"| {c['name']} | {c.get('regime') or '–'} | {c['k']} | {_fmt(c['greedy']['bleu'])} | "
            f"{_fmt(c['greedy']['chrf'])}{q} | `{c['path']}` |"
        )
    lines.append("")
    for p in plots or []:
        lines += [f"![{Path(p).stem}]({p})", ""]
    return "\n".join(lines)


def write_plots(report: dict, out_dir: Path) -> list[str]:
    """speedup_vs_k.png (one panel per batch size) and bleu_vs_khat.png; matplotlib's Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows, written = report["rows"], []
    if not rows:
        return written
    bss = sorted({r["batch_size"] for r in rows})
    series = sorted({(r["checkpoint"], r.get("rule_label", r["rule"])) for r in rows})
    fig, axes = plt.subplots(1, len(bss), figsize=(5 * len(bss), 4), squeeze=False)
    for ax, bs in zip(axes[0], bss):
        for ck, rule in series:
            pts = sorted(
                (r["k"], r["speedup"])
                for r in rows
                if r["batch_size"] == bs and r["checkpoint"] == ck and r.get("rule_label", r["rule"]) == rule
            )
            if pts:
                ax.plot([1] + [p[0] for p in pts], [1.0] + [p[1] for p in pts], marker="o", label=f"{ck} {rule}")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set(title=f"batch size {bs}", xlabel="block size k", ylabel="speedup over greedy (×)")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "speedup_vs_k.png", dpi=110)
    plt.close(fig)
    written.append("speedup_vs_k.png")

    bs0 = bss[0]
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for ck, rule in series:
        pts = sorted(
            (r["mean_accepted"], r["bleu"], r["k"])
            for r in rows
            if r["batch_size"] == bs0 and r["checkpoint"] == ck and r.get("rule_label", r["rule"]) == rule
        )
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{ck} {rule}")
            for x, y, k in pts:
                ax.annotate(f"k={k}", (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    for c in report["checkpoints"]:
        ax.scatter([1.0], [c["greedy"]["bleu"]], marker="x", color="black")
    ax.set(xlabel="mean accepted block size k̂", ylabel="BLEU", title="BLEU vs k̂ (x: greedy)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_dir / "bleu_vs_khat.png", dpi=110)
    plt.close(fig)
    written.append("bleu_vs_khat.png")
    return written


def write_report(report: dict, out_dir: str | os.PathLike, plots: bool = True) -> None:
    out_dir = Path(out_dir)
    written = write_plots(report, out_dir) if plots else []
    report["files"]["plots"] = written
    atomic_write_json(out_dir / "report.json", _finite(report))
    atomic_write_text(out_dir / "report.md", markdown(report, written))


def _finite(obj):
    """JSON has no NaN/Infinity: write null instead."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


# ------------------------------------------------------------------------------------- model cards (export)
def load_report(path: str | os.PathLike) -> dict:
    p = Path(path)
    if p.is_dir():
        p = p / "report.json"
    if not p.is_file():
        raise FileNotFoundError(f"evaluation report {p} does not exist")
    report = json.loads(p.read_text(encoding="utf-8"))
    if report.get("format") != "bpd-train-eval-report":
        raise ValueError(f"{p} is not a bpd-train evaluation report")
    return report


def find_report(eval_root: str | os.PathLike, source_id: str) -> Path | None:
    """The newest report.json under eval_root/*/ that evaluated the weights with this content id."""
    hits = []
    for p in Path(eval_root).glob("*/report.json"):
        try:
            r = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if any(c.get("source_id") == source_id for c in r.get("checkpoints", [])):
            hits.append(p)
    return max(hits, key=lambda p: p.stat().st_mtime) if hits else None


CARRIED = ("dtype", "draft_top_tokens", "proposal_dtype", "lookup", "narrow", "tree")  # what a bundle carries


def recommended_settings(report_path: str | os.PathLike, source_id: str | None = None) -> dict | None:
    """The decode settings that paid for the checkpoint with this content id in its evaluation, for its bundle to
    carry ({"settings": {...}, "why": "..."}): the fastest exact setting at the smallest batch size whose output
    equalled greedy's everywhere (its k and the report's proposal settings), or greedy decoding where none beat
    greedy; None where the report does not cover it."""
    report = load_report(report_path)
    names = {c["name"] for c in report["checkpoints"] if source_id is None or c.get("source_id") == source_id}
    s = report["settings"]
    bs = min(s["batch_sizes"])
    rows = [
        r
        for r in report["rows"]
        if r["checkpoint"] in names and r["rule"] == "exact" and r["batch_size"] == bs and r["k"] > 1
        and r["agreement"] == 100.0 and r.get("speedup") is not None
    ]  # fmt: skip
    if not rows:
        return None
    best = max(rows, key=lambda r: (r["speedup"], r["mean_accepted"]))
    s = dict(s)
    if s.get("dtype") == "auto":  # the precision it resolved to for this checkpoint's file (decode.dtype=auto)
        ck = next((c for c in report["checkpoints"] if c["name"] == best["checkpoint"]), {})
        s["dtype"] = (ck.get("decode") or {}).get("dtype", "fp32")
    rp = Path(report_path) / "report.json" if Path(report_path).is_dir() else Path(report_path)
    where = f"{rp.parent.name}/{rp.name}, batch {bs}, {s.get('dtype', 'fp32')}"
    if best["speedup"] <= 1.0:  # greedy decoding, in the precision it was timed in
        why = f"no exact setting beat greedy decoding ({where}: best {best['speedup']:.2f}x at k = {best['k']})"
        return {"settings": {"method": "greedy", **({"dtype": s["dtype"]} if "dtype" in s else {})}, "why": why}
    settings = {"method": "blockwise", "block_size": best["k"], **{k: s[k] for k in CARRIED if k in s}}
    why = f"the fastest exact setting in its evaluation ({where}: {best['speedup']:.2f}x, k-hat {best['mean_accepted']:.2f})"
    return {"settings": settings, "why": why}


def card_section(report_path: str | os.PathLike, source_id: str | None = None) -> str | None:
    """Markdown for a model card: the Table-1 tables restricted to the checkpoint with this content id."""
    report = load_report(report_path)
    cks = [c for c in report["checkpoints"] if source_id is None or c.get("source_id") == source_id]
    if not cks:
        return None
    names = {c["name"] for c in cks}
    sub = dict(report, checkpoints=cks, rows=[r for r in report["rows"] if r["checkpoint"] in names])
    d = report.get("data", {})
    lines = [
        f"From `{Path(report_path)}`: {d.get('name')} {d.get('split')}, {d.get('sentences')} sentences, "
        f"{report.get('environment', {}).get('device')}.",
        "",
        NOTES,
        "",
        f"BLEU signature: `{report['signatures']['bleu']}`",
        "",
    ]
    for rule, label, bs in _combos(sub):
        what = "decoding" if rule == "greedy" else "acceptance"
        lines += [f"### {label} {what}, batch size {bs}", "", table1(sub, rule, bs), ""]
    return "\n".join(lines)
