"""The entry points as users run them, on the real smoke base model (session fixture `smoke_base`) plus a heads
run made from it: evaluate.py -> report numbers equal the sacrebleu CLI; export.py -> bundle with the eval table;
python -m bpd_train.translate on the bundle reproduces the evaluated hypotheses. Bad input: one line, exit 2."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO_ROOT, offline_env

SACREBLEU = str(Path(sys.executable).parent / "sacrebleu")


def _run(script, *overrides, tmp):
    cmd = [sys.executable, str(REPO_ROOT / script), "experiment=smoke", f"hydra.run.dir={tmp}/hydra", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp, env=offline_env())


@pytest.fixture(scope="module")
def artifacts(smoke_base, tmp_path_factory):
    """A copy of the smoke artifacts with base/ (trained) and heads/frozen-k4/: the base backbone plus k = 4
    random heads, written the way training writes checkpoints (so exact blockwise == greedy must hold)."""
    from bpd_train.model import BPDConfig, BPDModel
    from bpd_train.sources.checkpoint import write_checkpoint
    from bpd_train.sources.loading import load as load_model

    src_art, base_run = smoke_base
    art = tmp_path_factory.mktemp("eval_cli") / "artifacts"
    corpus = art / base_run.parent.name
    shutil.copytree(base_run, corpus / "base")
    base = load_model(corpus / "base")
    cfg = BPDConfig.from_dict({**base.config.to_dict(), "block_size": 4})
    torch.manual_seed(0)
    heads = BPDModel(cfg)
    missing, unexpected = heads.load_state_dict(base.model.state_dict(), strict=False)
    assert not unexpected and all(m.startswith("heads.") for m in missing)
    torch.nn.init.normal_(heads.heads.fc2.weight, std=0.02)
    write_checkpoint(
        corpus / "heads" / "frozen-k4" / "checkpoints" / "last.ckpt", heads, base.tokenizer_path, regime="frozen"
    )
    return art


def _sacrebleu(out: Path, hyp: str) -> dict:
    res = subprocess.run(
        [SACREBLEU, str(out / "ref.txt"), "-i", str(out / hyp), "-m", "bleu", "chrf", "-w", "6", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return {m["name"]: m["score"] for m in json.loads(res.stdout)}


def test_evaluate_export_translate(artifacts, tmp_path):
    res = _run(
        "evaluate.py",
        f"paths.artifacts={artifacts}",
        "evaluate.max_sentences=6",
        "evaluate.batch_sizes=[3]",
        "decode.rules=[exact]",
        "evaluate.progress=false",
        "num_threads=2",
        "evaluate.bleu_sentences=12",
        tmp=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = artifacts / "bible_en_fr" / "eval" / "all"  # two runs found: base and heads/frozen-k4
    report = json.loads((out / "report.json").read_text())
    assert report["environment"]["threads"] == 2  # num_threads is applied (tests run with OMP_NUM_THREADS=1)
    assert [c["name"] for c in report["checkpoints"]] == ["base", "frozen-k4"]
    assert report["data"]["sentences"] == 6 and report["data"]["src_lang"] == "en"
    assert {(r["k"], r["rule"]) for r in report["rows"]} == {(4, "exact"), (2, "exact")}
    assert "| k | base | frozen-k4 |" in res.stdout  # report.md is printed too
    # BLEU/chrF in report.json == the sacrebleu command line on the written hypothesis and reference files
    entries = [c["greedy"] for c in report["checkpoints"]] + report["rows"]
    for e in entries:
        cli = _sacrebleu(out, e["hyp_file"])
        assert e["bleu"] == pytest.approx(cli["BLEU"], abs=1e-6) and e["chrf"] == pytest.approx(cli["chrF2"], abs=1e-6)
    assert report["checkpoints"][0]["greedy"]["chrf"] > 0
    assert report["data"]["quality_sentences"] == 12  # evaluate.bleu_sentences: greedy BLEU over 12, 6 timed
    assert all(len((out / c["quality"]["hyp_file"]).read_text().splitlines()) == 12 for c in report["checkpoints"])
    for r in report["rows"]:  # the heads share the base backbone: exact blockwise output == greedy == base's
        assert r["agreement"] == 100.0 and r["bleu"] == report["checkpoints"][0]["greedy"]["bleu"]

    res = _run("export.py", f"paths.artifacts={artifacts}", tmp=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    bundle = artifacts / "bible_en_fr" / "export" / "frozen-k4"
    assert "### Exact acceptance, batch size 3" in (bundle / "README.md").read_text()  # this checkpoint's table

    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "bpd_train.translate",
            "--bundle",
            str(bundle),
            "--batch-size",
            "4",
            "--max-len",
            *map(str, report["settings"]["max_len"]),
            "--method",
            "blockwise",  # over the bundle's own setting (its evaluation found greedy fastest for this tiny model)
        ],
        input=(out / "src.txt").read_text(),
        capture_output=True,
        text=True,
        timeout=300,
        env=offline_env(),
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout == (out / "hyp" / "frozen-k4" / "k4.exact.bs3.txt").read_text()
    assert "k̂=" in res.stderr and "decode settings from the bundle:" in res.stderr


def test_bad_input_is_one_line(artifacts, tmp_path):
    res = _run("evaluate.py", f"paths.artifacts={artifacts}", "decode.block_sizes=[8]", tmp=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("error: block size 8 is above the k = 4 heads of frozen-k4")
    res = _run("evaluate.py", f"paths.artifacts={artifacts}", "evaluate.bleu_sentences=most", tmp=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert res.stderr.strip().splitlines()[-1].startswith("error: evaluate.bleu_sentences must be `all`")


def test_nothing_trained_says_what_to_run(tmp_path):
    res = _run("export.py", f"paths.artifacts={tmp_path}/empty", tmp=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "nothing to export" in res.stderr and "python train.py +regime=base experiment=smoke" in res.stderr


def test_export_real_lightning_checkpoint(smoke_base, tmp_path):
    """A checkpoint as Lightning writes it (optimizer states, loops, hparams) -> bundle with identical logits."""
    from bpd_train.app.export import export_checkpoint, load_bundle
    from bpd_train.sources.loading import load as load_model

    _, base_run = smoke_base
    src = load_model(base_run)
    bundle = export_checkpoint(base_run, tmp_path / "base", dtype="float32")
    model, _, meta = load_bundle(bundle)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randint(4, 1000, (3, 12), generator=g), torch.randint(4, 1000, (3, 8), generator=g)
    with torch.no_grad():
        assert torch.equal(model(x, y), src.model(x, y))
    assert meta["training"]["regime"] == "base" and meta["training"]["global_step"] > 0
