"""make demo-real's chain (bpd_train/app/real_model.py): the prompts stage (kinds, a held-out kind, deterministic), the
int8 self-distillation setting, and the whole chain at toy size on a tiny GGUF file (make smoke-real)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO_ROOT, offline_env

from bpd_train.app.real_model import PromptsError, make_prompts, prompts_stage, stale_heads

CORPUS = REPO_ROOT / "data" / "bible-en-fr"
KINDS = ["Translate into French: {verse}", "Summarize: {verse}"]
SPEC = {"train": 7, "validation": 3, "kinds": KINDS, "held_out": "Explain to a child: {verse}"}


def test_prompts_cycle_the_training_kinds_hold_one_out_and_are_deterministic():
    recs = make_prompts(CORPUS, SPEC)
    train, val = recs["train"], recs["validation"]
    assert len(train) == 7 and len(val) == 3
    asks = [r["messages"][0]["content"] for r in train]
    assert [a.startswith("Translate into French: ") for a in asks] == [n % 2 == 0 for n in range(7)]
    assert all(len(r["messages"]) == 1 and r["messages"][0]["role"] == "user" for r in train)
    assert len({r["id"] for r in train}) == 7  # spread over the split, never the same verse twice
    for r in val:  # the held-out kind only, with the verse as the reference turn evaluate.py needs
        user, ref = r["messages"]
        assert user["content"] == f"Explain to a child: {ref['content']}" and ref["role"] == "assistant"
        assert not any(user["content"].startswith(k.split("{")[0]) for k in KINDS)
    assert not {r["id"] for r in val} & {r["id"] for r in train}
    assert make_prompts(CORPUS, SPEC) == recs
    assert make_prompts(CORPUS, {**SPEC, "train": 8})["train"][:1] == train[:1]
    # the held-out verses again, asked in the training kinds in turn (bench/real.py --prompts)
    seen = recs["seen"]
    assert [r["id"] for r in seen] == [r["id"] for r in val]
    for n, (r, v) in enumerate(zip(seen, val)):
        assert r["messages"][0]["content"] == KINDS[n % 2].replace("{verse}", v["messages"][1]["content"])
        assert r["kind"] == f"seen{n % 2}"


@pytest.mark.parametrize(
    "change, match",
    [
        ({"held_out": KINDS[1]}, "also a training kind"),
        ({"kinds": ["no verse here"]}, "exactly once"),
        ({"kinds": []}, "is empty"),
        ({"validation": 0}, ">= 1"),
    ],
)
def test_bad_prompt_settings_are_one_error(change, match):
    with pytest.raises(PromptsError, match=match):
        make_prompts(CORPUS, {**SPEC, **change})


def test_prompts_made_with_other_settings_are_refused_not_replaced(tmp_path):
    """A rerun with other kinds would otherwise find the old answers, heads and report complete (same verse ids)."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(data=SimpleNamespace(path=str(CORPUS), src_lang="en"))
    out = tmp_path / "prompts"
    prompts_stage(cfg, SPEC, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    prompts_stage(cfg, SPEC, out)  # the same settings: skipped
    with pytest.raises(PromptsError, match="other pipeline.real.prompts settings"):
        prompts_stage(cfg, {**SPEC, "kinds": [*KINDS, "Give it a title: {verse}"]}, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # prompts made before seen.jsonl existed get it on the next run, the other files untouched
    (out / "seen.jsonl").unlink()
    prompts_stage(cfg, SPEC, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_prompts_resume_from_another_checkout_and_a_changed_corpus_is_refused(tmp_path):
    """The settings key names the corpus by its files' contents, not its path: a moved or fresh checkout resumes."""
    import shutil
    from types import SimpleNamespace

    a, b = tmp_path / "a" / "bible-en-fr", tmp_path / "b" / "bible-en-fr"
    shutil.copytree(CORPUS, a)
    shutil.copytree(CORPUS, b)
    out = tmp_path / "prompts"
    prompts_stage(SimpleNamespace(data=SimpleNamespace(path=str(a), src_lang="en")), SPEC, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    prompts_stage(SimpleNamespace(data=SimpleNamespace(path=str(b), src_lang="en")), SPEC, out)  # skipped
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    (b / "train.jsonl.gz").write_bytes((a / "validation.jsonl.gz").read_bytes())  # another corpus, same path
    with pytest.raises(PromptsError, match="other pipeline.real.prompts settings"):
        prompts_stage(SimpleNamespace(data=SimpleNamespace(path=str(b), src_lang="en")), SPEC, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_a_decode_precision_is_part_of_an_lm_corpus_id_and_fp32_keeps_the_old_one():
    from bpd_train.data.distilled import TeacherSettings

    kw = dict(
        teacher_sha256="a" * 64,
        tokenizer_hash="b",
        beam_size=1,
        length_penalty=0.0,
        max_len=64,
        split="train",
        src_lang="en",
        tgt_lang="fr",
        kind="lm",
    )
    fp32, int8 = TeacherSettings(**kw), TeacherSettings(**kw, decode_dtype="int8")
    assert "decode_dtype" not in fp32.as_dict() and int8.as_dict()["decode_dtype"] == "int8"
    assert fp32.teacher_id != int8.teacher_id


@pytest.mark.slow
def test_smoke_real_chain_end_to_end_resumes_and_is_exact(tmp_path):
    """python -m bpd_train.real_model --run --experiment smoke-real on a tiny GGUF file: every stage's artifact,
    answers identical to fp32 greedy, exact evaluation, the exports; a rerun skips every stage, one with another
    decode setting only the evaluation and the exports."""
    pytest.importorskip("gguf")
    from bpd_train.decoding import greedy
    from bpd_train.decoding.settings import DecodeOptions, packed_weights
    from bpd_train.sources.loading import load

    gguf = tmp_path / "tiny.gguf"
    env = offline_env(BPD_CACHE=str(tmp_path / "cache"))
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "tests" / "_gguf_files.py"), str(gguf)],
        check=True,
        env=env,
        capture_output=True,
    )
    art = tmp_path / "art"
    cmd = [
        sys.executable,
        "-m",
        "bpd_train.real_model",
        "--run",
        "--experiment",
        "smoke-real",
        "--gguf",
        str(gguf),
        f"paths.artifacts={art}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
    ]
    r = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    for stage in (
        "prompts",
        "distill",
        "distill-medusa-k3",
        "distill-bpd-k4",
        "distill-chain-k3",
        "evaluate",
        "evaluate bf16",
        "evaluate q4",
        "export bundle",
        "export hf",
        "export vllm",
    ):
        assert f"=== {stage}: done in" in r.stdout, stage

    assert (art / "prompts" / "train.jsonl").is_file() and (art / "prompts" / "manifest.json").is_file()
    corpus = art / "general_chat"
    made = next((corpus / "distill").glob("*/manifest.json")).parent
    m = json.loads((made / "manifest.json").read_text())
    assert m["complete"] and m["kind"] == "lm" and "decode_dtype" not in m and m["num_examples"] == 24  # fp32
    # the corpus is the model's own fp32 greedy output
    model = load(f"gguf:{gguf}")
    pw = packed_weights(model.model, DecodeOptions(dtype="fp32"))
    tok = model.lm_tokenizer()
    recs = [json.loads(x) for x in sorted(made.glob("shard-*.jsonl"))[0].read_text().splitlines()][:4]
    prompts = [
        tok.encode(tok.render_chat(x["messages"][:1], add_generation_prompt=True), add_special_tokens=False)
        for x in recs
    ]
    room = model.config.max_positions - 1  # a longer prompt keeps its newest tokens, as distill.py cuts it
    prompts = [q[len(q) - room :] if len(q) > room else q for q in prompts]
    assert [list(t) for t in greedy(model.model, prompts, max_len=12, weights=pw).tokens] == [
        x["teacher_ids"] for x in recs
    ]

    for run in ("distill-medusa-k3", "distill-bpd-k4", "distill-chain-k3"):
        assert (corpus / "heads" / run / "done.json").is_file()
    report = json.loads((corpus / "eval" / "real" / "report.json").read_text())
    exact = [row for row in report["rows"] if row["rule"] == "exact"]
    assert {row["batch_size"] for row in exact} == {1, 8} and all(row["agreement"] == 100.0 for row in exact)
    assert {c["decode"]["dtype"] for c in report["checkpoints"]} == {"fp32"}
    # and in bf16, int8 and q4 (pipeline.real.also_*): exact against greedy of that precision, its own report; the
    # four side by side in tokens/s
    for dtype in ("bf16", "int8", "q4"):
        other = json.loads((corpus / "eval" / f"real-{dtype}" / "report.json").read_text())
        assert {c["decode"]["dtype"] for c in other["checkpoints"]} == {dtype}
        assert all(row["agreement"] == 100.0 for row in other["rows"] if row["rule"] == "exact")
    table = (corpus / "eval" / "precisions.md").read_text()
    assert [line.split(" | ")[0] for line in table.splitlines()[2:]] == ["| fp32", "| bf16", "| int8", "| q4"]
    assert (corpus / "export" / "best" / "model.safetensors").is_file()
    assert (corpus / "export" / "best-hf" / "custom_generate" / "generate.py").is_file()
    assert json.loads((corpus / "export" / "best-medusa-vllm" / "config.json").read_text())
    assert load(corpus / "export" / "best").config.block_size in (3, 4)
    assert load(f"hf:{corpus / 'export' / 'best-hf'}").config.heads in ("medusa", "bpd")  # chained: bundle only

    r2 = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "done in" not in r2.stdout.replace("pipeline finished", ""), r2.stdout[-3000:]
    assert r2.stdout.count("skipped") == 1 + 1 + 3 + 4 + 3
    # another decode setting makes the report stale: evaluation and the exports again, nothing before them
    r3 = subprocess.run([*cmd, "decode.narrow=0"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r3.returncode == 0, r3.stderr[-3000:]
    assert "=== evaluate: done in" in r3.stdout and "=== export bundle: done in" in r3.stdout, r3.stdout[-3000:]
    assert "=== evaluate bf16: done in" in r3.stdout and "=== evaluate int8: done in" in r3.stdout, r3.stdout[-3000:]
    assert "=== evaluate q4: done in" in r3.stdout, r3.stdout[-3000:]
    assert r3.stdout.count("skipped") == 1 + 1 + 3, r3.stdout[-3000:]


def test_the_exports_pick_the_fastest_exact_run_each_format_can_hold():
    from bpd_train.app.real_reports import chosen

    def row(ckpt, speedup, k_hat=1.5, bs=1, agreement=100.0):
        return dict(
            rule="exact", batch_size=bs, k=4, agreement=agreement, speedup=speedup, mean_accepted=k_hat, checkpoint=ckpt
        )

    runs = {n: Path(n) for n in ("distill-medusa-k8", "distill-bpd-k8", "distill-chain-k8")}
    report = {
        "settings": {"batch_sizes": [1, 8]},
        "rows": [
            row("distill-chain-k8", 1.3),
            row("distill-bpd-k8", 1.1),
            row("distill-medusa-k8", 1.0),
            row("distill-medusa-k8", 2.0, bs=8),  # not the smallest batch
            row("distill-bpd-k8", 5.0, agreement=99.0),  # not exact
        ],
    }
    assert chosen(report, runs) == ("distill-chain-k8", "distill-bpd-k8", "distill-medusa-k8")
    report["rows"] = report["rows"][:1]
    assert chosen(report, runs) == ("distill-chain-k8", None, None)


def test_the_exports_follow_the_precision_that_decodes_fastest(tmp_path):
    """The bundle's carried settings come from the report of the precision with the most tokens/s at batch 1 (its
    fastest exact setting, or its greedy where nothing beats it), not from decode.dtype's report alone."""
    from bpd_train.app.real_reports import fastest_precision, precisions

    def report(name, dtype, greedy_s, blockwise_s, agreement=100.0):
        row = dict(rule="exact", batch_size=1, k=8, agreement=agreement, checkpoint="distill-medusa-k8", tokens=100,
                   greedy_tokens=100, greedy_seconds=greedy_s, blockwise_seconds=blockwise_s, mean_accepted=1.6,
                   chrf=10.0)  # fmt: skip
        path = tmp_path / name / "report.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"settings": {"batch_sizes": [1, 8], "dtype": dtype}, "rows": [row]}))
        return path

    fp32 = report("real", "fp32", 1.0, 0.98)  # 102 tokens/s blockwise
    bf16 = report("real-bf16", "bf16", 2.2, 1.4)  # 71
    int8 = report("real-int8", "int8", 0.5, 0.4)  # 250
    got, why = fastest_precision([fp32, bf16, int8])
    assert got == int8 and why.startswith("int8 decodes fastest") and "fp32 102.0" in why
    assert "| int8 | 200.0 | distill-medusa-k8 k = 8 | 250.0 | 1.25× |" in precisions([fp32, bf16, int8])
    slow = report("real-q4", "q4", 0.3, 0.45)  # greedy 333 tokens/s beats everything, blockwise does not
    assert fastest_precision([fp32, int8, slow])[0] == slow
    inexact = report("real-x", "bf16", 0.1, 0.05, agreement=99.0)  # not exact: never chosen
    assert fastest_precision([fp32, inexact]) == (fp32, fastest_precision([fp32])[1])
    assert fastest_precision([inexact])[0] == inexact  # nothing timed: decode.dtype's report


def test_heads_trained_on_another_corpus_are_refused_not_kept(tmp_path):
    run = tmp_path / "heads" / "distill-medusa-k8"
    old, new = tmp_path / "distill" / "train-lm-greedy-aaa", tmp_path / "distill" / "train-lm-greedy-bbb"
    assert stale_heads(run, new) is None  # nothing there yet
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(f"regime:\n  name: distill\n  distilled_dir: {old}\n")
    assert stale_heads(run, new) is None  # a config but no training yet
    (run / "checkpoints").mkdir()  # begun: resuming it on another corpus would mix the two
    why = stale_heads(run, new)
    assert why is not None and str(old) in why and str(new) in why and "paths.artifacts" in why
    (run / "done.json").write_text("{}")
    assert stale_heads(run, old) is None  # the same corpus: resume or skip as before
    (run / "config.yaml").write_text("regime: [unclosed\n")
    assert "cannot be read" in stale_heads(run, old)


def test_the_extra_evaluations_follow_their_settings_and_the_cpu():
    from bpd_train.app.real_model import PromptsError, _also
    from bpd_train.engine.fastlinear import bf16_compute, int8_compute

    assert _also(True, "bf16", "fp32") and _also("true", "bf16", "int8") and _also("true", "int8", "bf16")
    assert not _also(False, "bf16", "fp32") and not _also("true", "bf16", "bf16")  # (the main evaluation is bf16)
    assert not _also("auto", "int8", "int8")
    assert _also("auto", "bf16", "fp32") == bool(bf16_compute())
    assert _also("auto", "int8", "fp32") == bool(int8_compute())
    # q4 where serving the file picks it: a 4-bit file on a CPU with the int8 kernels, never an F32 / Q8_0 one
    assert _also("auto", "q4", "fp32", "Q4_1") == bool(int8_compute()) == _also("auto", "q4", "int8", "Q4_K")
    assert not _also("auto", "q4", "fp32", "F32") and not _also("auto", "q4", "fp32", "Q8_0")
    assert not _also("auto", "q4", "fp32", None) and _also("true", "q4", "fp32", "F32")
    assert not _also("auto", "q4", "q4", "Q4_1")
    with pytest.raises(PromptsError, match="also_int8='sometimes': auto, true or false"):
        _also("sometimes", "int8", "fp32")


def test_the_precision_table_shows_each_reports_fastest_exact_cell_in_tokens_per_second(tmp_path):
    from bpd_train.app.real_model import precisions

    def row(k, blockwise_seconds, agreement=100.0, bs=1):
        return dict(
            rule="exact",
            batch_size=bs,
            k=k,
            agreement=agreement,
            checkpoint="distill-medusa-k8",
            greedy_tokens=1000,
            tokens=1000,
            greedy_seconds=10.0,
            blockwise_seconds=blockwise_seconds,
            mean_accepted=1.9,
            chrf=30.04,
        )

    paths = []
    for dtype, rows in (
        ("fp32", [row(8, 8.0), row(4, 5.0), row(4, 1.0, agreement=99.0), row(4, 1.0, bs=8)]),
        ("int8", [row(8, 4.0), row(1, 10.0)]),
        ("bf16", [row(4, None)]),  # nothing timed: no line
    ):
        paths.append(tmp_path / f"{dtype}.json")
        paths[-1].write_text(json.dumps({"settings": {"batch_sizes": [1, 8], "dtype": dtype}, "rows": rows}))
    lines = precisions(paths).splitlines()
    assert len(lines) == 4
    assert lines[2] == "| fp32 | 100.0 | distill-medusa-k8 k = 4 | 200.0 | 2.00× | 1.90 | 30.0 |"
    assert lines[3] == "| int8 | 100.0 | distill-medusa-k8 k = 8 | 250.0 | 2.50× | 1.90 | 30.0 |"


@pytest.mark.slow
def test_heads_for_a_users_own_requests_file_in_one_command(tmp_path):
    """--requests FILE: the file's requests (one a line) answered by the model, heads on them, the evaluation on the
    held-out part of the file, exact; the prompt files are the file's, split."""
    pytest.importorskip("gguf")
    gguf = tmp_path / "tiny.gguf"
    env = offline_env(BPD_CACHE=str(tmp_path / "cache"))
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "tests" / "_gguf_files.py"), str(gguf)],
        check=True,
        env=env,
        capture_output=True,
    )
    log = tmp_path / "my log.txt"
    asks = [f"Write a short note about topic number {i}." for i in range(14)]
    log.write_text("\n".join([*asks, asks[0]]) + "\n", encoding="utf-8")
    art = tmp_path / "art"
    cmd = [
        sys.executable,
        "-m",
        "bpd_train.real_model",
        "--run",
        "--experiment",
        "smoke-real",
        "--gguf",
        str(gguf),
        "--requests",
        str(log),
        f"paths.artifacts={art}",
        f"hydra.run.dir={tmp_path / 'hydra'}",
        "pipeline.real.runs=[medusa-k3]",
        "pipeline.real.also_bf16=false",
        "pipeline.real.also_int8=false",
        "pipeline.real.also_q4=false",
    ]
    r = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    train = [json.loads(x) for x in (art / "prompts" / "train.jsonl").read_text().splitlines()]
    held = [json.loads(x) for x in (art / "prompts" / "validation.jsonl").read_text().splitlines()]
    assert len(train) == 12 and len(held) == 2  # 14 different requests, a fifth at most held out
    assert sorted(r["messages"][0]["content"] for r in train + held) == sorted(asks)
    report = json.loads((art / "requests_chat" / "eval" / "real" / "report.json").read_text())
    exact = [row for row in report["rows"] if row["rule"] == "exact"]
    assert exact and all(row["agreement"] == 100.0 for row in exact)
    assert (art / "requests_chat" / "export" / "best" / "model.safetensors").is_file()
