"""evaluate: report numbers agree with the sacrebleu CLI on the written files; exact mode agrees 100% with greedy;
reports, plots and bad-input errors."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _eval_tiny import build_tiny, read_pairs

from bpd_train.decoding.settings import DecodeError as EvalError
from bpd_train.decoding.settings import default_block_sizes, parse_rule
from bpd_train.evaluation.runner import EvalSettings, evaluate_inputs, expand_inputs
from bpd_train.sources.checkpoint import CheckpointError

SACREBLEU = str(Path(sys.executable).parent / "sacrebleu")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory)


@pytest.fixture(scope="session")
def evaluated(tiny, tmp_path_factory):
    """One evaluation of a k=4 run and a plain (k=1) model on 8 validation sentences, batch sizes 1 and 5.
    Half of the references are replaced by the model's own greedy output, so BLEU is a real number in (0, 100)
    even though the tiny model is untrained."""
    from bpd_train.decoding import greedy
    from bpd_train.decoding.text import SpmText
    from bpd_train.sources.loading import load as load_model

    pairs = read_pairs("validation", 8)
    sources = [s for s, _ in pairs]
    loaded = load_model(tiny["run"])
    text = SpmText(loaded.tokenizer(), 2, 0, loaded.config.max_positions)
    own = greedy(loaded.model, [text.source_ids(s) for s in sources], max_len=(0.5, 4)).tokens
    refs = [text.detok(own[i]) if i % 2 else t for i, (_, t) in enumerate(pairs)]
    out = tmp_path_factory.mktemp("eval") / "report"
    settings = EvalSettings(rules=["exact", "top2"], batch_sizes=[1, 5], max_len=[0.5, 4], progress=False)
    inputs = expand_inputs([str(tiny["run"]), str(tiny["base"])])
    report = evaluate_inputs(inputs, sources, refs, settings, out, data_info={"name": "tiny", "split": "validation"})
    return out, report


def _cli(out: Path, hyp: str) -> dict:
    res = subprocess.run(
        [SACREBLEU, str(out / "ref.txt"), "-i", str(out / hyp), "-m", "bleu", "chrf", "-w", "6", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return {m["name"]: m for m in json.loads(res.stdout)}


def test_report_bleu_equals_sacrebleu_cli(evaluated):
    out, _ = evaluated
    report = json.loads((out / "report.json").read_text())  # what is on disk, not the in-memory dict
    checked = 0
    for row in report["rows"][:3] + [c["greedy"] for c in report["checkpoints"]]:
        cli = _cli(out, row["hyp_file"])
        assert row["bleu"] == pytest.approx(cli["BLEU"]["score"], abs=1e-6)
        assert row["chrf"] == pytest.approx(cli["chrF2"]["score"], abs=1e-6)
        checked += 1
    assert 0 < report["rows"][0]["bleu"] < 100 and 0 < report["rows"][0]["chrf"] < 100
    assert report["signatures"]["bleu"] == cli["BLEU"]["signature"]
    assert checked == 5


def test_exact_agrees_with_greedy_and_rows_are_complete(evaluated):
    _, report = evaluated
    rows = report["rows"]
    # k=4 model: block sizes 4 and 2, rules exact/top2, batch sizes 1/5; the k=1 model only has its greedy entry
    assert sorted({(r["k"], r["rule"], r["batch_size"]) for r in rows}) == sorted(
        (k, r, b) for k in (4, 2) for r in ("exact", "top2") for b in (1, 5)
    )
    assert {r["checkpoint"] for r in rows} == {"frozen-k4"}
    for r in rows:
        assert 1.0 <= r["mean_accepted"] <= r["k"]
        assert r["calls"] <= r["greedy_calls"] and r["speedup"] > 0
        if r["rule"] == "exact":
            assert r["agreement"] == 100.0 and r["bleu"] == r["greedy_bleu"]
            # the serving paths' adaptive feeding, timed alongside on the CPU: the same output, its own speed
            assert r["adaptive_agreement"] == 100.0 and r["adaptive_speedup"] > 0
            assert 1.0 <= r["adaptive_mean_accepted"] <= r["k"]
        else:  # adaptive feeding is the serving default for the exact rule only
            assert "adaptive_speedup" not in r
    # results do not depend on the batch size
    by = {(r["k"], r["rule"], r["batch_size"]): r for r in rows}
    assert by[(4, "exact", 1)]["bleu"] == by[(4, "exact", 5)]["bleu"]
    assert by[(4, "exact", 1)]["mean_accepted"] == pytest.approx(by[(4, "exact", 5)]["mean_accepted"])
    for c in report["checkpoints"]:
        assert all(v["same_output_as_first_batch_size"] for v in c["greedy"]["by_batch_size"].values())
        assert c["source_id"].startswith("sha256:")


def test_report_files(evaluated):
    out, report = evaluated
    md = (out / "report.md").read_text()
    assert "## Exact acceptance, batch size 1" in md and "## TopK(2) acceptance, batch size 5" in md
    assert "| k | frozen-k4 | base |" in md
    rows4 = [line for line in md.splitlines() if line.startswith("| 4 |")]
    # tables exact / top2 at batch 1, then at batch 5: exact cells hold the adaptive speedup too
    assert len(rows4) == 4 and all(r.endswith("| – |") for r in rows4)  # the k=1 model has no k=4 cell
    assert [r.count("×") for r in rows4] == [2, 1, 2, 1] and "(adaptive " in rows4[0]
    for png in ("speedup_vs_k.png", "bleu_vs_khat.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert png in report["files"]["plots"]
    n = len((out / "src.txt").read_text().splitlines())
    assert n == 8 == len((out / "ref.txt").read_text().splitlines())
    assert all(len((out / r["hyp_file"]).read_text().splitlines()) == n for r in report["rows"])


def test_card_section_and_find_report(evaluated, tiny, tmp_path):
    from bpd_train.app.export import export_checkpoint
    from bpd_train.evaluation.report import card_section, find_report
    from bpd_train.sources.loading import source_id

    out, _ = evaluated
    sid = source_id(tiny["run"])
    assert find_report(out.parent, sid) == out / "report.json"
    bundle = export_checkpoint(tiny["run"], tmp_path / "b", report=out)
    from bpd_train.evaluation.report import recommended_settings

    carried = json.loads((bundle / "config.json").read_text())["decode"]  # the settings users of the bundle get
    assert carried == recommended_settings(out, sid) and carried["settings"]["method"] in ("blockwise", "greedy")
    card = (bundle / "README.md").read_text()
    assert (
        "### Exact acceptance, batch size 1" in card
        and "| k | frozen-k4 |" in card
        and "base" not in card.split("## Evaluation")[1]
    )
    assert card_section(out, "sha256:0000") is None


def test_default_block_sizes_and_rules():
    assert default_block_sizes(8) == [8, 6, 4, 2]
    assert default_block_sizes(5) == [5, 4, 2]
    assert default_block_sizes(1) == []
    assert parse_rule("top2").n == 2 and parse_rule("topk:3").n == 3 and type(parse_rule("Exact")).__name__ == "Exact"
    with pytest.raises(EvalError, match="unknown acceptance rule"):
        parse_rule("top")


def test_bad_inputs(tiny, tmp_path):
    pairs = read_pairs("validation", 2)
    src, ref = [p[0] for p in pairs], [p[1] for p in pairs]
    ok = EvalSettings(batch_sizes=[2], rules=["exact"], progress=False)
    with pytest.raises(EvalError, match="block size 8 is above the k = 4 heads"):
        evaluate_inputs(expand_inputs([str(tiny["run"])]), src, ref, EvalSettings(block_sizes=[8]), tmp_path / "a")
    with pytest.raises(EvalError, match="unknown acceptance rule 'fuzzy'"):
        EvalSettings(rules=["fuzzy"])
    with pytest.raises(EvalError, match="batch_sizes"):
        EvalSettings(batch_sizes=[0])
    with pytest.raises(CheckpointError, match="does not exist"):
        expand_inputs([str(tmp_path / "nope.ckpt")])
    with pytest.raises(CheckpointError, match="no checkpoint matches"):
        expand_inputs([str(tmp_path / "runs" / "*")])
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        evaluate_inputs(expand_inputs([str(bad)]), src, ref, ok, tmp_path / "b")
    with pytest.raises(EvalError, match="no sentences"):
        evaluate_inputs(expand_inputs([str(tiny["run"])]), [], [], ok, tmp_path / "c")
    assert not any((tmp_path / d).exists() for d in "abc")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "fp16"}, "dtype='fp16': expected one of fp32, bf16, int8"),
        ({"proposal_dtype": "fp8"}, "proposal_dtype='fp8': expected"),
        ({"draft_top_tokens": "many"}, "draft_top_tokens='many': expected a number of tokens"),
        ({"adaptive": 1.5}, "adaptive=1.5: expected"),
        ({"max_len": [1, float("nan")]}, "max_len=[1, nan]: expected finite numbers"),
    ],
)
def test_decode_settings_are_checked_as_translate_checks_them(kwargs, message):
    # the evaluator's decode fields are a DecodeSettings (bpd_train/decode_settings.py), checked before any model loads
    with pytest.raises(EvalError) as e:
        EvalSettings(**kwargs)
    assert str(e.value).startswith(message)


def test_the_evaluator_decodes_with_the_serving_settings():
    from bpd_train.decoding.settings import DecodeSettings

    s = EvalSettings(dtype="INT8", draft_top_tokens=30, proposal_dtype=None, max_len=[1, 4], adaptive="false")
    assert s.decode.dtype == "int8" and s.adaptive is False and s.as_dict()["max_len"] == [1, 4]  # as the report has it
    assert s.decode_settings(accept="top2") == DecodeSettings(
        accept="top2", dtype="int8", draft_top_tokens=30, proposal_dtype=None, max_len=(1, 4), adaptive=False
    )
    # adaptive auto (the declared default, as everywhere): the columns feed every proposal, auto is timed beside them
    assert EvalSettings().decode.adaptive is None and EvalSettings().adaptive is False


def test_expand_inputs_names(tiny):
    got = expand_inputs([str(Path(tiny["run"]).parent / "*"), str(tiny["base"]), str(tiny["ckpt"])])
    assert [n for n, _ in got] == ["frozen-k4", "base", "frozen-k4/last"]


def test_wandb_logging_to_the_training_run(evaluated, tmp_path, monkeypatch):
    import copy

    from bpd_train.evaluation.runner import _wandb_ids
    from bpd_train.evaluation.wandb_log import log_report

    out, report = evaluated
    run = tmp_path / "run"
    (run / "wandb" / "offline-run-20260101_000000-abc123").mkdir(parents=True)
    (run / "checkpoints").mkdir()
    ids = _wandb_ids(run / "checkpoints" / "last.ckpt", {})
    assert ids == {"id": "abc123", "project": None, "dir": str(run)}
    assert _wandb_ids(run / "checkpoints" / "last.ckpt", {"wandb_run_id": "x1", "wandb_project": "p"})["id"] == "x1"
    monkeypatch.setenv("WANDB_MODE", "disabled")  # exercises the calls without a W&B service
    rep = copy.deepcopy(report)
    assert log_report(rep, out) == 0  # no training run known: nothing logged
    rep["checkpoints"][0]["wandb"] = ids
    assert log_report(rep, out) == 1


@pytest.mark.parametrize("name", ["evaluate", "export"])
def test_configs_compose_with_every_experiment(name, tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import bpd_train

    conf = bpd_train.REPO_ROOT / "conf"
    assert (conf / f"{name}.yaml").read_text().startswith(f"# Run: python {name}.py")
    assert all(p.read_text().startswith("# python evaluate.py") for p in (conf / "decode").glob("*.yaml"))
    for exp in [None, *sorted(p.stem for p in (conf / "experiment").glob("*.yaml"))]:
        with initialize_config_dir(str(conf), version_base="1.3", job_name=name):
            cfg = compose(name, overrides=[f"paths.artifacts={tmp_path}"] + ([f"experiment={exp}"] if exp else []))
        section = OmegaConf.to_container(cfg[name], resolve=True)
        if name == "evaluate":
            s = EvalSettings(
                **{k: v for k, v in OmegaConf.to_container(cfg.decode, resolve=True).items()},
                batch_sizes=section["batch_sizes"],
            )
            assert s.rules and s.batch_sizes
        if exp == "smoke" and name == "evaluate":
            assert section["max_sentences"] and cfg.paths.artifacts == str(tmp_path)


def test_greedy_only(tiny, tmp_path):
    """decode=greedy: no blockwise rows, one greedy table per batch size."""
    pairs = read_pairs("validation", 4)
    s = EvalSettings(block_sizes=[], rules=[], batch_sizes=[4], max_len=[0.5, 2], progress=False)
    report = evaluate_inputs(
        expand_inputs([str(tiny["run"])]), [p[0] for p in pairs], [p[1] for p in pairs], s, tmp_path / "g", plots=False
    )
    assert report["rows"] == [] and report["checkpoints"][0]["greedy"]["hyp_file"] == "hyp/frozen-k4/greedy.txt"
    assert "## Greedy decoding, batch size 4" in (tmp_path / "g" / "report.md").read_text()


def test_timing_repeats_passes_until_min_seconds_and_keeps_the_first_passs_results():
    import time as _time

    from bpd_train.evaluation.metrics import time_interleaved

    calls = []

    def slow(batch):
        _time.sleep(0.005)
        calls.append(batch)
        return batch * 10

    fns = {"a": slow, "b": lambda batch: batch}
    out = time_interleaved(fns, [1, 2, 3], warmup=1, min_seconds=0.05)
    assert out["a"].passes == out["b"].passes >= 4  # 3 x 5 ms a pass: 4 passes reach 50 ms
    assert out["a"].seconds >= 0.05 and out["a"].results == [10, 20, 30] and out["b"].results == [1, 2, 3]
    assert len(calls) == 1 + 3 * out["a"].passes  # the warm-up batch, then whole passes
    one = time_interleaved(fns, [1, 2, 3], warmup=0)  # default: one pass
    assert one["a"].passes == 1 and one["a"].results == [10, 20, 30]
    capped = time_interleaved(fns, [1], warmup=0, min_seconds=10.0, max_passes=3)
    assert capped["a"].passes == 3
