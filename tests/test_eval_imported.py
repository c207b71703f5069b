"""An imported model (hf:<folder>, or a bundle exported from one) is the base model of its evaluation report: the
comparison is held to its BLEU and the best-run choice has a base to fall back on."""

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from test_hf_pipeline import _compose, _data, marian  # noqa: E402,F401 (marian: a fixture)

from bpd_train.evaluation.runner import imported_regime  # noqa: E402


def test_imported_plain_model_is_the_base():
    plain, heads = SimpleNamespace(block_size=1), SimpleNamespace(block_size=4)
    assert imported_regime({"source": "hf", "heads_loaded": False}, plain) == "base"
    assert imported_regime({"training": {"source": "hf:/models/opus-mt-en-de"}}, plain) == "base"  # its bundle
    assert imported_regime({"source": "hf", "heads_loaded": True}, heads) is None  # heads: not the base
    assert imported_regime({"training": {"source": "/art/c/base/checkpoints/best.ckpt"}}, plain) is None


def test_report_of_an_imported_model_has_a_base(marian, tmp_path):
    from bpd_train.evaluation.cli import run_evaluate

    folder = marian["folder"]
    common = ["experiment=smoke", f"paths.artifacts={tmp_path / 'art'}", *_data(marian)]
    out = run_evaluate(
        _compose(
            "evaluate",
            [
                *common,
                f"evaluate.inputs=[hf:{folder}]",
                "evaluate.batch_sizes=[2]",
                "evaluate.plots=false",
                "evaluate.wandb=false",
                "evaluate.progress=false",
                "evaluate.max_sentences=4",
            ],
        )
    )
    report = json.loads((out / "report.json").read_text())
    assert report["checkpoints"][0]["regime"] == "base"
    assert report["comparison"]["base"] == "marian" and report["best"]["checkpoint"] == "marian"
    assert "Choice: **marian**" in (out / "report.md").read_text()
