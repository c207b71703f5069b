"""The report's comparison points (base greedy BLEU, the distillation teacher's BLEU, each run's difference from
them) and the rule that picks the run to hand a user (what `make demo` exports)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _eval_tiny import build_tiny, read_pairs

from bpd_train.evaluation.report import BEST_RULE, choose_best, comparison_markdown
from bpd_train.evaluation.runner import EvalSettings, evaluate_inputs, expand_inputs

SACREBLEU = str(Path(sys.executable).parent / "sacrebleu")


def _manifest(folder: Path, teacher: Path, beam_size: int) -> Path:
    """A distillation corpus folder as distill.py leaves it, reduced to what the report reads."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(
        json.dumps(
            {
                "format": 1,
                "teacher_id": "train-b1-a0.6-test",
                "teacher_path": str(teacher),
                "beam_size": beam_size,
                "length_penalty": 0.6,
                "max_len": [0.5, 4],
                "split": "train",
                "complete": True,
                "shards": [],
                "teacher_bleu": {"bleu": 12.34, "num_sentences": 500},
            }
        )
    )
    return folder


@pytest.fixture(scope="module")
def compared(tmp_path_factory):
    """frozen-k4 and base on 6 validation sentences; the teacher is the base model itself with beam 1 (= greedy),
    so its BLEU on these sentences must equal the base's greedy BLEU."""
    tiny = build_tiny(tmp_path_factory)
    pairs = read_pairs("validation", 6)
    tmp = tmp_path_factory.mktemp("compare")
    teacher_dir = _manifest(tmp / "distill" / "t", tiny["base"] / "checkpoints" / "last.ckpt", beam_size=1)
    settings = EvalSettings(rules=["exact"], batch_sizes=[1], max_len=[0.5, 4], progress=False)
    out = tmp / "report"
    report = evaluate_inputs(
        expand_inputs([str(tiny["run"]), str(tiny["base"])]),
        [p[0] for p in pairs],
        [p[1] for p in pairs],
        settings,
        out,
        plots=False,
        distilled_dir=teacher_dir,
    )
    return out, report, tiny


def test_report_gives_base_and_teacher_bleu_and_each_difference(compared):
    out, _, _ = compared
    report = json.loads((out / "report.json").read_text())
    ck = {c["name"]: c for c in report["checkpoints"]}
    base, frozen, t = ck["base"]["greedy"]["bleu"], ck["frozen-k4"]["greedy"]["bleu"], report["teacher"]
    assert report["comparison"] == {
        "base": "base",
        "base_bleu": base,
        "teacher_bleu": t["bleu"],
        "teacher_train_bleu": 12.34,
    }
    assert (
        t["bleu"] == base and (out / t["hyp_file"]).read_text() == (out / ck["base"]["greedy"]["hyp_file"]).read_text()
    )
    cli = subprocess.run(
        [SACREBLEU, str(out / "ref.txt"), "-i", str(out / t["hyp_file"]), "-m", "bleu", "-w", "6", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert t["bleu"] == pytest.approx(json.loads(cli.stdout)["score"], abs=1e-6)
    assert ck["frozen-k4"]["bleu_vs_base"] == pytest.approx(frozen - base) != 0
    assert ck["frozen-k4"]["bleu_vs_teacher"] == pytest.approx(frozen - t["bleu"])
    assert ck["base"]["bleu_vs_base"] == 0
    md = (out / "report.md").read_text()
    assert "## What each run cost" in md and "BLEU 12.34 on the 500 training sources" in md
    row = next(line for line in md.splitlines() if line.startswith("| frozen-k4 | frozen |"))
    assert f"{frozen - base:+.2f}" in row and f"{frozen - t['bleu']:+.2f}" in row
    assert "## Recommended run" in md and f"Choice: **{report['best']['checkpoint']}**" in md


def test_teacher_checkpoint_gone_keeps_the_manifest_number(compared, tmp_path):
    _, _, tiny = compared
    pairs = read_pairs("validation", 2)
    d = _manifest(tmp_path / "t", tmp_path / "deleted.ckpt", beam_size=4)
    s = EvalSettings(rules=["exact"], batch_sizes=[2], max_len=[0.5, 2], progress=False)
    report = evaluate_inputs(
        expand_inputs([str(tiny["base"])]),
        [p[0] for p in pairs],
        [p[1] for p in pairs],
        s,
        tmp_path / "r",
        plots=False,
        distilled_dir=d,
    )
    assert report["teacher"]["bleu"] is None and report["teacher"]["train_bleu"] == 12.34
    assert "does not exist" in report["teacher"]["missing"]
    assert "not decoded here" in (tmp_path / "r" / "report.md").read_text()


def test_quality_over_more_sentences_than_are_timed(compared, tmp_path):
    """evaluate.bleu_sentences: each checkpoint's (and the teacher's) BLEU over 8 sentences while 3 of them are
    timed; the scores are sacrebleu's on the written files, the timed greedy output is the same sentences' output
    in the larger set, and the base comparison uses the larger set."""
    _, _, tiny = compared
    pairs = read_pairs("validation", 8)
    timed = [pairs[i] for i in (0, 3, 6)]
    teacher_dir = _manifest(tmp_path / "distill" / "t", tiny["base"] / "checkpoints" / "last.ckpt", beam_size=1)
    settings = EvalSettings(rules=["exact"], batch_sizes=[1, 2], max_len=[0.5, 4], progress=False)
    out = tmp_path / "report"
    report = evaluate_inputs(
        expand_inputs([str(tiny["base"]), str(tiny["run"])]),
        [p[0] for p in timed],
        [p[1] for p in timed],
        settings,
        out,
        plots=False,
        distilled_dir=teacher_dir,
        quality=([p[0] for p in pairs], [p[1] for p in pairs]),
    )
    assert report["data"]["sentences"] == 3 and report["data"]["quality_sentences"] == 8
    refs = tmp_path / "refs8.txt"
    refs.write_text("".join(p[1] + "\n" for p in pairs))
    ck = {c["name"]: c for c in report["checkpoints"]}
    for c in ck.values():
        q = c["quality"]
        lines = (out / q["hyp_file"]).read_text().splitlines()
        assert q["sentences"] == len(lines) == 8
        cli = subprocess.run(
            [SACREBLEU, str(refs), "-i", str(out / q["hyp_file"]), "-m", "bleu", "-w", "6", "--format", "json"],
            capture_output=True,
            text=True,
            check=True,
        )
        assert q["bleu"] == pytest.approx(json.loads(cli.stdout)["score"], abs=1e-6)
        assert (out / c["greedy"]["hyp_file"]).read_text().splitlines() == [lines[i] for i in (0, 3, 6)]
    base_q = ck["base"]["quality"]["bleu"]
    assert report["comparison"]["base_bleu"] == base_q
    assert ck["base"]["quality"]["chrf"] != ck["base"]["greedy"]["chrf"]  # two sets of sentences indeed
    assert report["teacher"]["sentences"] == 8 and report["teacher"]["bleu"] == base_q  # the base, beam 1
    assert ck["frozen-k4"]["bleu_vs_base"] == pytest.approx(ck["frozen-k4"]["quality"]["bleu"] - base_q)
    md = (out / "report.md").read_text()
    assert "greedy BLEU " + f"{base_q:.2f} over 8 sentences" in md and "BLEU (8 sentences)" in md
    assert report["best"]["rule"].endswith("; BLEU over 8 sentences of the split")


def test_best_holds_runs_to_the_quality_bleu_not_the_timed_sentences():
    report = _report({"self-k4": (8.0, 1.4), "frozen-k4": (10.0, 1.05)})  # 2 under the base on the timed ones
    assert choose_best(report)["checkpoint"] == "frozen-k4"
    for c, q in zip(report["checkpoints"], (9.0, 8.6, 10.0)):  # over the whole split: 0.4 under the base
        c["quality"] = {"sentences": 100, "bleu": q}
    report["data"] = {"sentences": 10, "quality_sentences": 100}
    best = choose_best(report)
    assert best["checkpoint"] == "self-k4" and "BLEU 8.60 vs base 9.00 over 100 sentences" in best["reason"]


def _report(runs: dict[str, tuple[float, float]], base_bleu: float = 10.0) -> dict:
    """A report with a base model and heads runs name -> (BLEU, batch-1 exact speedup)."""
    cks = [{"name": "base", "regime": "base", "k": 1, "path": "/a/base", "greedy": {"bleu": base_bleu}}]
    rows = []
    for name, (bleu, speedup) in runs.items():
        cks.append({"name": name, "regime": name.split("-")[0], "k": 4, "path": f"/a/{name}", "greedy": {"bleu": bleu}})
        for bs, sp in ((1, speedup), (32, speedup * 3)):  # batch 32 is never what the rule looks at
            rows.append(
                {
                    "checkpoint": name,
                    "model_k": 4,
                    "k": 4,
                    "rule": "exact",
                    "batch_size": bs,
                    "bleu": bleu,
                    "agreement": 100.0,
                    "speedup": sp,
                    "mean_accepted": 2.0,
                }
            )
        rows.append(
            {
                "checkpoint": name,
                "model_k": 4,
                "k": 4,
                "rule": "top2",
                "batch_size": 1,
                "bleu": bleu,
                "agreement": 90.0,
                "speedup": speedup * 2,
                "mean_accepted": 3.0,
            }
        )
    return {"settings": {"batch_sizes": [1, 32], "max_bleu_drop": 1.0}, "checkpoints": cks, "rows": rows}


def test_best_is_the_fastest_run_within_one_bleu_of_the_base():
    best = choose_best(_report({"frozen-k4": (10.0, 1.05), "finetune-k4": (9.1, 1.10), "both-k4": (5.0, 1.30)}))
    assert best["checkpoint"] == "finetune-k4" and best["path"] == "/a/finetune-k4"
    assert best["rule"] == BEST_RULE.format(drop=1.0) and "within 1 of the base" in best["rule"]


def test_best_says_what_every_heads_run_costs_in_bleu(tmp_path):
    report = _report({"frozen-k4": (10.0, 1.05), "finetune-k4": (9.1, 1.10), "both-k4": (5.0, 1.30)})
    best = choose_best(report)
    assert best["bleu_vs_base"] == {"frozen-k4": 0.0, "finetune-k4": -0.9, "both-k4": -5.0}
    assert choose_best(_report({"both-k4": (5.0, 1.30)}))["bleu_vs_base"] == {"both-k4": -5.0}  # base chosen: said too
    report["best"] = best
    assert "BLEU against the base: frozen-k4 +0.00, finetune-k4 -0.90, both-k4 -5.00." in "\n".join(
        comparison_markdown(report)
    )


def test_best_falls_back_to_the_base_and_says_why():
    best = choose_best(_report({"both-k4": (5.0, 1.30)}))
    assert best["checkpoint"] == "base" and best["path"] == "/a/base"
    assert "no heads run is within the BLEU margin" in best["reason"] and "both-k4" in best["reason"]
    best = choose_best(_report({"frozen-k4": (10.0, 0.8), "both-k4": (5.0, 1.3)}))
    assert best["checkpoint"] == "base" and "faster than greedy" in best["reason"]
    report = _report({"frozen-k4": (10.0, 1.2)})
    report["checkpoints"] = report["checkpoints"][1:]
    assert choose_best(report)["path"] is None
