"""The all-weights regimes keep the base model's BLEU on the corpora users bring, at a toy size.

Three corpora through training at a toy size (a d_model 128 model, 600 base steps, 150 head steps; greedy BLEU over
every validation sentence):
- GIMP's and VLC's user-interface strings (data/ui-en-de/gimp: 5,617 English->German pairs of ~4 words; vlc: 3,485)
  through the pipeline: `finetune` and `both` (on a stronger teacher's beam output, as in make demo) keep the base's
  BLEU; on GIMP `finetune` with head 1 at 1/k of the loss (the default before) falls far below, so the check fails
  if that loss comes back;
- the bundled Bible (28k verses of ~30 words): `finetune` keeps the base's BLEU.
docs/experiments.md, "What `finetune` and `both` cost on small corpora", has the numbers behind the bounds.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, offline_env


def ui(name: str) -> list[str]:
    return [
        "data=local",
        f"data.path={REPO_ROOT / 'data' / 'ui-en-de' / name}",
        "data.src_lang=en",
        "data.tgt_lang=de",
        f"data.name={name}",
    ]


TOY = [
    "data.spm.vocab_size=2000",
    "model.d_model=128",
    "model.n_heads=4",
    "model.d_ff=512",
    "steps.base=600",
    "warmup.base=50",
    "steps.heads=150",
    "trainer.val_check_interval=100",
    "callbacks.blockwise_eval.n_sentences=128",  # best.ckpt of base and finetune: greedy BLEU on 128 sentences
    "distill.limit=null",  # `both` learns the base's beam output on every training pair
    "num_threads=1",
]
EVAL = [
    "decode.block_sizes=[4]",
    "decode.rules=[exact]",
    "evaluate.batch_sizes=[32]",
    "evaluate.max_sentences=50",
    "evaluate.bleu_sentences=all",
    "evaluate.adaptive_speedup=false",
    "evaluate.plots=false",
    "decode.max_len=[1.5,10]",
]
# Within this of the base at the toy size (the goal at the demo's size is 1.5; the toy model is weaker and noisier),
# while the 1/k share loses far more (docs/experiments.md, section 9).
MAX_DROP = 2.5
# `both`'s goal: within 0.5 of the base, or above. As make demo does, it distils from a stronger teacher (the base
# trained on to twice its steps) and relearns the whole model for four times the heads' steps: from the base itself
# as teacher, or in 150 steps, it fell 4.0 / 1.9 below (docs/experiments.md, section 9)
BOTH_MAX_DROP = 0.5
PIPELINE = ["pipeline.teacher_steps=1200", "pipeline.regime_overrides={both:['steps.heads=600']}"]


def run(args: list[str], timeout: int = 1200) -> str:
    r = subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, env=offline_env(), capture_output=True, text=True, timeout=timeout
    )
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    return r.stdout


def scores(common: list[str], corpus, runs: list[str], name: str) -> dict[str, float]:
    """Greedy BLEU over every validation sentence of each run folder (base, heads/<run>) of `corpus`."""
    inputs = ",".join(str(corpus / r) for r in runs)
    run(["evaluate.py", *common, *EVAL, f"evaluate.inputs=[{inputs}]", f"evaluate.name={name}"])
    report = json.loads((corpus / "eval" / name / "report.json").read_text())
    out = {c["name"]: c["quality"]["bleu"] for c in report["checkpoints"]}
    print(name, out)
    return out


# a UI corpus -> the least BLEU of a base that translates at the toy size (GIMP's reads 15.09, VLC's 6.76)
UI_LEAST = {"gimp": 8.0, "vlc": 5.0}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(UI_LEAST))
def test_finetune_and_both_keep_the_base_bleu_on_short_ui_strings(name, tmp_path):
    art = tmp_path / "artifacts"
    common = ["experiment=smoke", *ui(name), *TOY, f"paths.artifacts={art}", f"paths.outputs={tmp_path / 'out'}"]
    pipeline = ["-m", "bpd_train.pipeline", "--experiment", "smoke", "--regimes", "finetune,both"]
    out = run([*pipeline, *common[1:], *PIPELINE], timeout=3600)  # six stages: ~7 min alone, 20+ on shared cores
    assert "BLEU against the base: finetune-k4" in out  # the recommendation says what the regime cost
    corpus = art / name
    bleu = scores(common, corpus, ["base", "heads/finetune-k4", "heads/both-k4"], "default")
    assert bleu["base"] > UI_LEAST[name], bleu  # a model that translates, or the comparison says nothing
    assert bleu["finetune-k4"] >= bleu["base"] - MAX_DROP, bleu
    assert bleu["both-k4"] >= bleu["base"] - BOTH_MAX_DROP, bleu
    if name != "gimp":
        return

    # the same `finetune` run with head 1 at 1/k of the loss: the check above would fail on it
    run(
        [
            "train.py",
            "+regime=finetune",
            *common,
            "model.block_size=4",
            "loss.p1_weight=null",
            "regime.run_subdir=heads/finetune-mean-k4",
        ]
    )
    old = scores(common, corpus, ["base", "heads/finetune-mean-k4"], "mean")
    assert old["base"] == pytest.approx(bleu["base"])
    assert old["finetune-mean-k4"] < bleu["base"] - MAX_DROP, (old, bleu)


@pytest.mark.slow
def test_finetune_keeps_the_base_bleu_on_long_sentences(tmp_path):
    """The bundled Bible (30-word verses): a toy model after 600 steps translates little (1.42 BLEU), so the bound is
    tighter than MAX_DROP, which would accept any score."""
    art = tmp_path / "artifacts"
    common = [
        "experiment=smoke",
        "data=bible_en_fr",
        *TOY,
        f"paths.artifacts={art}",
        f"paths.outputs={tmp_path / 'out'}",
    ]
    run(["train.py", "+regime=base", *common])
    run(["train.py", "+regime=finetune", *common, "model.block_size=4"])
    bleu = scores(common, art / "bible_en_fr", ["base", "heads/finetune-k4"], "default")
    assert bleu["base"] > 1.0, bleu
    assert bleu["finetune-k4"] >= bleu["base"] - 0.5, bleu
