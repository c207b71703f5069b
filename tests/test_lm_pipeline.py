"""Decoder-only models through the pipeline's own entry points: hf:<Llama folder> loading, head regimes from it
(frozen keeps greedy bit-identical), self-distillation shards (seeded sampling, resume), export.format=hf round
trip, bad input as one line, and the whole smoke-lm chain (base from scratch -> distill -> heads -> evaluate ->
export)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from _lm_tiny import WORDS, make_tokenizer  # noqa: E402
from conftest import REPO_ROOT, offline_env, run_train  # noqa: E402

PROMPTS = [{"prompt": " ".join(WORDS[i : i + 4]), "response": " ".join(WORDS[i + 4 : i + 7])} for i in range(0, 24, 2)]


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    """A tiny random-weight LlamaForCausalLM folder (word-level tokenizer.json with BOS) as transformers saves it."""
    f = tmp_path_factory.mktemp("llama")
    v = make_tokenizer(f, bos=True)
    cfg = transformers.LlamaConfig(
        vocab_size=v,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # wider than transformers' init: peaked, prompt-dependent outputs
        for p in model.parameters():
            p.mul_(15.0) if p.dim() == 2 else None
    model.save_pretrained(f)
    return f


def _records(tmp_path: Path) -> Path:
    p = tmp_path / "records.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in PROMPTS))
    return p


def _greedy(loaded, n: int = 6):
    from bpd_train.decoding import greedy

    tok = loaded.lm_tokenizer()
    return greedy(loaded.model, [tok.encode(r["prompt"]) for r in PROMPTS[:n]], max_len=8).tokens


def test_hf_llama_loads_with_its_tokenizer_and_bad_hf_input_is_one_line(llama, tmp_path):
    from bpd_train.data.hf_tokenizer import tokenizer_folder_hash
    from bpd_train.model import LMModel
    from bpd_train.sources.convert.hf import ConvertError
    from bpd_train.sources.loading import load

    loaded = load(f"hf:{llama}")
    assert isinstance(loaded.model, LMModel) and loaded.is_lm and loaded.own_tokenizer
    tok = loaded.data_tokenizer()
    assert tok.path == llama and tok.hash == loaded.tokenizer_hash == tokenizer_folder_hash(llama)
    assert tok.encode("the fox")[0] == tok.bos_id == loaded.config.bos_id
    with pytest.raises(ConvertError, match="takes no @<src_lang>:<tgt_lang>"):
        load(f"hf:{llama}@en:fr")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    r = subprocess.run(
        [
            sys.executable,
            "train.py",
            "+regime=frozen",
            "experiment=smoke_lm",
            f"regime.init_from=hf:{gpt2}",
            f"paths.artifacts={tmp_path / 'art'}",
            f"hydra.run.dir={tmp_path / 'h'}",
        ],
        cwd=REPO_ROOT,
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert "Traceback" not in r.stderr and len(errors) == 1, r.stderr
    assert "unsupported decoder-only architecture GPT2LMHeadModel" in errors[0]


@pytest.mark.slow
def test_frozen_heads_on_hf_llama_keep_greedy_then_distill_and_export(llama, tmp_path):
    """train.py +regime=frozen from hf:<Llama> on prompt/response files: backbone and greedy output unchanged,
    heads trained; the run exports (export.format=hf) and hf: reads the heads back; distill.py with the model as
    its own sampling teacher writes shards that a rerun redoes identically."""
    from bpd_train.app.export import export_hf
    from bpd_train.sources.loading import load

    rec = _records(tmp_path)
    art = tmp_path / "art"
    files = f"data.lm.files={{train:{rec},validation:{rec}}}"
    run_train(
        "+regime=frozen",
        "experiment=smoke_lm",
        f"regime.init_from=hf:{llama}",
        files,
        "model.block_size=3",
        "data.max_tokens=256",
        "trainer.max_steps=6",
        "trainer.val_check_interval=3",
        "optim.optimizer.lr=0.03",
        artifacts=art,
    )
    run = next(art.glob("*/heads/frozen-k3"))
    assert (run / "tokenizer" / "tokenizer.json").is_file()
    base, trained = load(f"hf:{llama}"), load(run)
    assert trained.config.block_size == 3 and trained.tokenizer_hash == base.tokenizer_hash
    sb, st = base.model.state_dict(), trained.model.state_dict()
    assert all(torch.equal(sb[n], st[n]) for n in sb), "the frozen backbone moved"
    assert any(float(st[n].abs().sum()) > 0 for n in st if n.startswith("heads.")), "the heads did not train"
    assert _greedy(trained) == _greedy(base)

    out = export_hf(run, tmp_path / "hf-out")
    back = load(f"hf:{out}")
    assert back.config.block_size == 3 and _greedy(back) == _greedy(trained)
    bt = back.model.state_dict()
    assert all(torch.equal(bt[n], st[n]) for n in st)

    # self-distillation: the model answers the prompts itself (sampled, seeded per record), sharded
    out_dir = tmp_path / "distilled"
    cmd = [
        sys.executable,
        "distill.py",
        "experiment=smoke_lm",
        f"teacher=hf:{llama}",
        files,
        "distill.beam_size=1",
        "distill.temperature=0.9",
        "distill.seed=3",
        "distill.shard_size=5",
        "distill.limit=null",
        f"distill.output_dir={out_dir}",
        f"paths.artifacts={art}",
        f"hydra.run.dir={tmp_path / 'hd'}",
    ]
    r = subprocess.run(cmd, cwd=REPO_ROOT, env=offline_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((out_dir / "manifest.json").read_text())
    assert m["complete"] and m["kind"] == "lm" and m["num_shards"] == 3 and m["temperature"] == 0.9
    shards = sorted(out_dir.glob("shard-*.jsonl"))
    first = shards[1].read_bytes()
    recs = [json.loads(x) for x in first.decode().splitlines()]
    assert [r["id"] for r in recs] == ["5", "6", "7", "8", "9"]
    assert all(set(r) >= {"prompt", "response", "teacher_ids", "gold"} for r in recs)
    assert recs[0]["prompt"] == PROMPTS[5]["prompt"] and recs[0]["gold"] == PROMPTS[5]["response"]
    shards[1].unlink()  # as if killed before this shard was written: the rerun redoes only it, the same
    r = subprocess.run(cmd, cwd=REPO_ROOT, env=offline_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert shards[1].read_bytes() == first
    assert '"decoded_shards": 1' in r.stdout and '"skipped": 2' in r.stdout
    # beam search is not how a decoder-only teacher answers: one line
    r = subprocess.run(
        cmd[:-1] + ["distill.beam_size=4", f"hydra.run.dir={tmp_path / 'hd2'}"],
        cwd=REPO_ROOT,
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "set distill.beam_size=1" in r.stderr


@pytest.mark.slow
def test_smoke_lm_pipeline_end_to_end(tmp_path):
    """`python -m bpd_train.pipeline --experiment smoke-lm`: a Llama-architecture model from scratch, its own
    greedy answers, heads (frozen from gold, both from the self-distilled corpus), evaluation, export."""
    from bpd_train.model import LMModel
    from bpd_train.sources.loading import load

    art = tmp_path / "art"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "bpd_train.pipeline",
            "--experiment",
            "smoke-lm",
            "--regimes",
            "frozen,both",
            f"paths.artifacts={art}",
        ],
        cwd=REPO_ROOT,
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    corpus = art / "bible_en_fr"
    m = json.loads(next((corpus / "distill").glob("*/manifest.json")).read_text())
    assert m["complete"] and m["kind"] == "lm" and m["teacher_bleu"] is not None
    report = json.loads((corpus / "eval" / "demo-k4" / "report.json").read_text())
    assert report["teacher"]["self_distilled"]  # the report names the base model as its own teacher
    assert "the base model itself (self-distillation" in (corpus / "eval" / "demo-k4" / "report.md").read_text()
    assert {c["name"] for c in report["checkpoints"]} == {"base", "frozen-k4", "both-k4"}
    exact = [row for row in report["rows"] if row["rule"] == "exact"]
    assert exact and all(row["agreement"] == 100.0 for row in exact)  # exact blockwise = the model's greedy
    assert {row["batch_size"] for row in exact} == {1, 8} and all(row["mean_accepted"] >= 1 for row in exact)
    bundle = load(corpus / "export" / "best")
    assert isinstance(bundle.model, LMModel)
    base, frozen = load(corpus / "base"), load(corpus / "heads" / "frozen-k4")
    tok = base.lm_tokenizer()
    from bpd_train.decoding import greedy

    prompts = [tok.encode(f"English: {s}\nFrench:") for s in ("In the beginning", "God said", "Let there be light")]
    assert greedy(frozen.model, prompts, max_len=12).tokens == greedy(base.model, prompts, max_len=12).tokens


@pytest.mark.slow
def test_ddp_two_processes_train_lm_heads(llama, tmp_path):
    """finetune (backbone and heads) of an hf: Llama on 2 DDP ranks over gloo: both ranks join, the run ends
    at its step count with 2 replicas in its sampler state."""
    from bpd_train.sources.checkpoint import read_checkpoint

    rec = _records(tmp_path)
    art = tmp_path / "art"
    r = run_train(
        "+regime=finetune",
        "experiment=smoke_lm",
        f"regime.init_from=hf:{llama}",
        f"data.lm.files={{train:{rec},validation:{rec}}}",
        "model.block_size=3",
        "data.max_tokens=128",
        "strategy=ddp",
        "trainer.devices=2",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        artifacts=art,
        timeout=600,
    )
    assert "MEMBER: 2/2" in r.stdout + r.stderr
    ck = read_checkpoint(next(art.glob("*/heads/finetune-k3")) / "checkpoints" / "last.ckpt")
    assert ck["global_step"] == 4 and ck["bpd"]["model_config"]["arch"] == "lm"
    assert ck["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["num_replicas"] == 2
