"""make demo-real's evaluation reports read back (bpd_train/app/real_model.py): which run each export format takes,
the precisions side by side, and the precision whose report the exports follow."""

from __future__ import annotations

import json
from pathlib import Path

from bpd_train.evaluation.report import exact_rows


def chosen(report: dict, runs: dict[str, Path]) -> tuple[str | None, str | None, str | None]:
    """(best run, best run with a transformers heads format (not chained), best Medusa run): the fastest under exact
    acceptance at the smallest batch size (ties: higher k̂). Every run has the frozen backbone's greedy output, so
    speed is the only thing between them."""
    rows = [r for r in exact_rows(report) if r["k"] > 1 and r["checkpoint"] in runs]
    rank = lambda r: (max(r["speedup"], r.get("adaptive_speedup") or 0.0), r["mean_accepted"])  # noqa: E731
    best = max(rows, key=rank, default=None)
    hf = max((r for r in rows if not r["checkpoint"].startswith("distill-chain")), key=rank, default=None)
    medusa = max((r for r in rows if r["checkpoint"].startswith("distill-medusa")), key=rank, default=None)
    return (best and best["checkpoint"]), (hf and hf["checkpoint"]), (medusa and medusa["checkpoint"])


def _batch1(rep: dict) -> dict | None:
    """A report's greedy and fastest exact blockwise decoding at its smallest batch size, in tokens/s (from the same
    timed passes as its speedups); None where no exact row was timed."""
    bs = min(rep["settings"]["batch_sizes"])
    rows = [r for r in rep["rows"] if r["rule"] == "exact" and r["batch_size"] == bs and r["k"] > 1]
    rows = [r for r in rows if r["agreement"] == 100.0 and r.get("blockwise_seconds")]
    if not rows:
        return None
    best = max(rows, key=lambda r: r["greedy_seconds"] / r["blockwise_seconds"])
    greedy = best["greedy_tokens"] / best["greedy_seconds"]
    return {"row": best, "greedy": greedy, "blockwise": best["tokens"] / best["blockwise_seconds"]}


def precisions(reports: list[Path]) -> str:
    """A markdown table over the evaluation reports (one per precision): greedy and the fastest exact blockwise
    decoding at batch 1 in tokens per second, so a user can pick the precision to serve in."""
    lines = [
        "| precision | greedy tok/s | fastest exact blockwise | tok/s | over greedy | k̂ | greedy chrF |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for path in reports:
        rep = json.loads(path.read_text("utf-8"))
        if (b := _batch1(rep)) is None:
            continue
        best = b["row"]
        lines.append(
            f"| {rep['settings']['dtype']} | {b['greedy']:.1f} | {best['checkpoint']} k = {best['k']} | "
            f"{b['blockwise']:.1f} | {best['greedy_seconds'] / best['blockwise_seconds']:.2f}× | "
            f"{best['mean_accepted']:.2f} | {best['chrf']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def fastest_precision(reports: list[Path]) -> tuple[Path, str]:
    """The report whose precision decodes fastest at batch 1 (its fastest exact setting, or greedy where nothing
    beats greedy), in tokens/s, and a line saying why: the exports and the bundle's carried settings come from it.
    The first report (decode.dtype's) where none was timed."""
    speeds = []
    for path in reports:
        rep = json.loads(path.read_text("utf-8"))
        if (b := _batch1(rep)) is not None:
            speeds.append((max(b["greedy"], b["blockwise"]), str(rep["settings"]["dtype"]), path))
    if not speeds:
        return reports[0], "no precision was timed: the exports follow decode.dtype's report"
    best = max(speeds, key=lambda t: t[0])
    others = ", ".join(f"{d} {v:.1f}" for v, d, p in speeds if p != best[2])
    return best[2], (
        f"{best[1]} decodes fastest at batch 1 here ({best[0]:.1f} tokens/s"
        + (f"; {others}" if others else "")
        + "): the exports and the bundle's carried settings come from its report"
    )
