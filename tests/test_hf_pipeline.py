"""`hf:` sources through the pipeline's entry points: a transformers checkpoint as init_from of a head
regime, as distillation teacher, as evaluation input and as export source; bundles of imported models carry their
tokenizer and translate on their own; export.format=hf of a native model imports back bit for bit; bad input is
one line and exit status 2. Tiny random models (transformers save_pretrained) and a sentencepiece model trained
here (tests/test_hf_convert.py's fixtures); a few training steps, never a download."""

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses:UserWarning")

from _eval_tiny import build_tiny  # noqa: E402
from conftest import REPO_ROOT, offline_env, run_train  # noqa: E402
from test_hf_convert import TEXTS, _pieces, _randomize, _spm, folders  # noqa: E402,F401 (folders: a fixture)

from bpd_train.decoding import greedy  # noqa: E402
from bpd_train.sources.loading import load  # noqa: E402

DE = [
    "der schnelle braune fuchs springt",
    "guten tag wie geht es dir",
    "der faule hund",
    "wie geht es",
    "machine translation is fun",
    "hallo welt",
]
SOURCES = ["the quick fox", "hello world how are you", "nine", "a stitch in time"]


@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    """A Marian folder as opus-mt ships it (source.spm, target.spm, vocab.json, tokenizer_config.json)."""
    tmp = tmp_path_factory.mktemp("hfpipe")
    sp = _spm(tmp)
    mar = tmp / "marian"
    mar.mkdir()
    vocab = _pieces(sp, {"</s>": 0, "<unk>": 1})
    vocab["<pad>"] = len(vocab)
    (mar / "vocab.json").write_text(json.dumps(vocab))
    shutil.copy(tmp / "sp.model", mar / "source.spm")
    shutil.copy(tmp / "sp.model", mar / "target.spm")
    transformers.MarianTokenizer(
        str(mar / "source.spm"), str(mar / "target.spm"), str(mar / "vocab.json")
    ).save_pretrained(mar)
    pad = vocab["<pad>"]
    cfg = transformers.MarianConfig(
        vocab_size=len(vocab),
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
        activation_function="swish",
        scale_embedding=True,
        pad_token_id=pad,
        eos_token_id=0,
        decoder_start_token_id=pad,
        forced_eos_token_id=None,
        dropout=0.1,
    )
    torch.manual_seed(0)
    m = _randomize(transformers.MarianMTModel(cfg).eval())
    with torch.no_grad():
        m.final_logits_bias.normal_(0, 0.5)
        m.final_logits_bias[0, 0] += 1.5
    m.generation_config.bad_words_ids = [[pad]]
    m.save_pretrained(mar)
    # a tiny en-de corpus in the jsonl format of conf/data/local.yaml
    data = tmp / "data"
    data.mkdir()
    pairs = list(zip(TEXTS, DE))
    for split, n in (("train", 48), ("validation", 6), ("test", 6)):
        rows = [
            {"id": str(i), "translation": {"en": pairs[i % len(pairs)][0], "de": pairs[i % len(pairs)][1]}}
            for i in range(n)
        ]
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {"folder": mar, "data": data, "tmp": tmp}


def _data(m):
    return [
        "data=local",
        "data.name=local",
        f"data.path={m['data']}",
        "data.src_lang=en",
        "data.tgt_lang=de",
        "data.num_proc=1",
        "data.splits={train:train.jsonl,validation:validation.jsonl,test:test.jsonl}",
    ]


def _compose(name, overrides):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(REPO_ROOT / "conf"), version_base="1.3", job_name=name):
        return compose(name, overrides=list(overrides))


def _ids(tok, texts):
    return torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(tok.source_ids(t)) for t in texts], batch_first=True, padding_value=tok.pad_id()
    )


def test_native_model_exported_as_hf_imports_back_and_trains_heads(marian, tmp_path_factory, tmp_path):
    """Offline: a model of ours -> export.format=hf -> regime.init_from=hf: gives the same greedy
    output and a frozen run trains heads on it, keeping that output bit for bit."""
    from bpd_train.app.export import run_export
    from bpd_train.training.run import train

    tiny = build_tiny(tmp_path_factory)
    native = load(tiny["base"])
    out = tmp_path / "native-hf"
    run_export(
        _compose(
            "export",
            [
                "experiment=smoke",
                f"export.checkpoint={tiny['base']}",
                "export.format=hf",
                f"export.output_dir={out}",
                f"paths.artifacts={tmp_path}/art",
            ],
        )
    )
    assert {p.name for p in out.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "bpd_heads.safetensors",
        "custom_generate",
        "tokenizer.model",
    }
    assert json.loads((out / "config.json").read_text())["architectures"] == ["PegasusForConditionalGeneration"]
    imported = load(f"hf:{out}")
    assert imported.own_tokenizer and imported.config == native.config
    src = _ids(imported.tokenizer(), [s for s, _ in _bible(4)])
    want = greedy(native.model, src, max_len=12).tokens
    assert greedy(imported.model, src, max_len=12).tokens == want
    # again: an existing export is replaced only with overwrite (experiment=smoke sets it), a foreign folder never
    again = ["experiment=smoke", f"export.checkpoint=hf:{out}", "export.format=hf", f"paths.artifacts={tmp_path}/art"]
    with pytest.raises(FileExistsError, match="overwrite"):
        run_export(_compose("export", [*again, f"export.output_dir={out}", "export.overwrite=false"]))
    run_export(_compose("export", [*again, f"export.output_dir={out}"]))
    (out / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a folder export.format=hf wrote"):
        run_export(_compose("export", [*again, f"export.output_dir={out}"]))
    (out / "notes.txt").unlink()

    run = train(
        _compose(
            "train",
            [
                "+regime=frozen",
                "experiment=smoke",
                f"regime.init_from=hf:{out}",
                *_data(marian),
                f"paths.artifacts={tmp_path}/art",
                "logger=none",
                "trainer.max_steps=3",
                "progress_bar=none",
                "callbacks.blockwise_eval.enabled=false",
            ],
        )
    )
    trained = load(run)
    assert trained.tokenizer_hash == imported.tokenizer_hash and (run / "tokenizer" / "tokenizer.model").is_file()
    assert trained.config.block_size == 4
    assert trained.model.heads.fc2.weight.abs().sum() > 0  # the heads trained (they start at fc2 = 0)
    assert greedy(trained.model, src, max_len=12).tokens == want


def _bible(n):
    from _eval_tiny import read_pairs

    return read_pairs("validation", n)


def test_marian_frozen_train_bundle_translate(marian, tmp_path):
    """train.py's real entry (+regime=frozen regime.init_from=hf:...), then export.py's bundle, then the translate
    CLI: the same translations as greedy decoding of the imported model."""
    folder = marian["folder"]
    imported = load(f"hf:{folder}")
    tok = imported.tokenizer()
    src = _ids(tok, SOURCES)
    want = greedy(imported.model, src, max_len=20).tokens
    # what the data pipeline trains on: transformers' own ids for sources and targets (text_target)
    data_tok, ttok = imported.data_tokenizer(), transformers.MarianTokenizer.from_pretrained(folder)
    assert (data_tok.bos_id, data_tok.pad_id) == (imported.config.bos_id, imported.config.pad_id)
    for en, de in zip(TEXTS, DE):
        assert data_tok.encode_batch([en])[0] + [data_tok.eos_id] == ttok(en)["input_ids"]
        assert data_tok.encode_target_batch([de])[0] + [data_tok.eos_id] == ttok(text_target=de)["input_ids"]
    art = tmp_path / "art"
    run_train(
        "+regime=frozen",
        "experiment=smoke",
        f"regime.init_from=hf:{folder}",
        "model.block_size=3",
        *_data(marian),
        "trainer.max_steps=4",
        "progress_bar=none",
        artifacts=art,
    )
    run = art / "local" / "heads" / "frozen-k3"
    trained = load(run)
    assert trained.own_tokenizer and trained.config.block_size == 3
    assert trained.tokenizer_meta["kind"] == "marian"
    assert greedy(trained.model, src, max_len=20).tokens == want  # frozen: head 1 is the model, bit for bit
    assert trained.model.heads.fc2.weight.abs().sum() > 0

    from bpd_train.app.export import run_export
    from bpd_train.app.translate import main
    from bpd_train.sources.bundle import load_bundle

    bundle = tmp_path / "bundle"
    run_export(
        _compose(
            "export",
            ["experiment=smoke", f"export.checkpoint={run}", f"export.output_dir={bundle}", f"paths.artifacts={art}"],
        )
    )
    manifest = json.loads((bundle / "manifest.json").read_text())["files"]
    assert {f"tokenizer/{n}" for n in ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json")} <= set(
        manifest
    )
    model, btok, meta = load_bundle(bundle)
    assert meta["format_version"] == 3 and greedy(model, src, max_len=20).tokens == want
    out, err = io.StringIO(), io.StringIO()
    rc = main(
        ["--bundle", str(bundle), "--max-len", "0", "20", "--quiet"],
        stdin=io.StringIO("\n".join(SOURCES) + "\n"),
        stdout=out,
        stderr=err,
    )
    assert rc == 0, err.getvalue()
    assert out.getvalue().splitlines() == [tok.detok(t) for t in want]
    # an edited tokenizer file is refused (the manifest and config.json hash the tokenizer folder)
    with open(bundle / "tokenizer" / "vocab.json", "a") as f:
        f.write(" ")
    rc = main(["--bundle", str(bundle)], stdin=io.StringIO("x\n"), stdout=io.StringIO(), stderr=err)
    assert rc == 2 and "not the tokenizer this bundle was exported with" in err.getvalue()


def test_marian_evaluate_and_distill(marian, tmp_path):
    """evaluate.py evaluate.inputs=[hf:...] and distill.py teacher=hf:... (its tokenizer, its special ids)."""
    from bpd_train.data.distilled import load_distilled_corpus
    from bpd_train.distillation.job import run as distill
    from bpd_train.evaluation.cli import run_evaluate

    folder = marian["folder"]
    art = tmp_path / "art"
    common = ["experiment=smoke", f"paths.artifacts={art}", *_data(marian)]
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
            ],
        )
    )
    report = json.loads((out / "report.json").read_text())
    assert report["checkpoints"][0]["name"] == "marian" and report["checkpoints"][0]["k"] == 1

    summary = distill(
        _compose(
            "distill",
            [
                *common,
                f"teacher=hf:{folder}",
                "distill.limit=6",
                "distill.shard_size=3",
                "distill.beam_size=2",
                "distill.progress=false",
            ],
        )
    )
    assert summary["complete"] and summary["num_examples"] == 6
    ds = load_distilled_corpus(summary["out_dir"])
    imported = load(f"hf:{folder}")
    tok = imported.tokenizer()
    for row in ds:
        assert row["translation"]["de"] == tok.detok(row["teacher_ids"])
    manifest = json.loads((Path(summary["out_dir"]) / "manifest.json").read_text())
    assert manifest["tokenizer_hash"] == imported.tokenizer_hash and manifest["teacher_path"] == f"hf:{folder}"

    # the students of an imported teacher start from it, with its tokenizer (checked against the corpus manifest)
    from bpd_train.training.run import train

    run = train(
        _compose(
            "train",
            [
                "+regime=distill",
                f"regime.init_from=hf:{folder}",
                *common,
                "logger=none",
                "trainer.max_steps=2",
                "progress_bar=none",
                "callbacks.blockwise_eval.enabled=false",
            ],
        )
    )
    assert json.loads((run / "done.json").read_text())["global_step"] == 2
    student = load(run)
    src = _ids(tok, SOURCES)
    assert greedy(student.model, src, max_len=20).tokens == greedy(imported.model, src, max_len=20).tokens


def _cli(bundle, tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "bpd_train.translate", "--bundle", bundle],
        input="hello\n",
        cwd=REPO_ROOT,
        env=offline_env(HF_HUB_OFFLINE="1"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(errors) == 1, r.stderr[-2000:]
    return errors[0]


def test_bad_hf_input_is_one_line(marian, tmp_path):
    folder = marian["folder"]
    t5 = tmp_path / "t5"
    t5.mkdir()
    (t5 / "config.json").write_text(json.dumps({"architectures": ["T5ForConditionalGeneration"], "model_type": "t5"}))
    line = _cli(f"hf:{t5}", tmp_path)
    assert "unsupported architecture T5ForConditionalGeneration" in line and "MarianMTModel" in line

    no_tok = tmp_path / "no_tok"
    shutil.copytree(folder, no_tok)
    (no_tok / "source.spm").unlink()
    assert "lacks the tokenizer file(s) source.spm" in _cli(f"hf:{no_tok}", tmp_path)

    line = _cli("hf:nobody-here/opus-mt-xx-yy", tmp_path)
    assert "HF_HUB_OFFLINE=1" in line and "nobody-here/opus-mt-xx-yy" in line

    from bpd_train.app.translate import main

    err = io.StringIO()  # a transformers folder given as a bundle, without hf:
    assert main(["--bundle", str(folder)], stdin=io.StringIO("x\n"), stdout=io.StringIO(), stderr=err) == 2
    assert f"pass it as hf:{folder}" in err.getvalue() and len(err.getvalue().splitlines()) == 1

    bigger = tmp_path / "bigger_vocab"
    shutil.copytree(folder, bigger)
    vocab = json.loads((bigger / "vocab.json").read_text())
    vocab["extra"] = len(vocab)
    (bigger / "vocab.json").write_text(json.dumps(vocab))
    assert "belong to different models" in _cli(f"hf:{bigger}", tmp_path)


def test_marian_finetune_then_export_hf_loads_in_transformers(marian, tmp_path):
    """finetune trains the imported backbone; export.format=hf of that run is a checkpoint transformers loads,
    whose generate() gives our greedy output, with the heads in bpd_heads.safetensors."""
    from safetensors import safe_open

    from bpd_train.app.export import run_export
    from bpd_train.training.run import train

    folder = marian["folder"]
    art = tmp_path / "art"
    run = train(
        _compose(
            "train",
            [
                "+regime=finetune",
                f"regime.init_from=hf:{folder}",
                "experiment=smoke",
                f"paths.artifacts={art}",
                *_data(marian),
                "logger=none",
                "trainer.max_steps=2",
                "progress_bar=none",
                "callbacks.blockwise_eval.enabled=false",
                "optim.optimizer.lr=0.05",
            ],
        )
    )
    tuned, imported = load(run), load(f"hf:{folder}")
    changed = [
        n
        for n, t in imported.model.state_dict().items()
        if n != "logits_bias" and not torch.equal(t, tuned.model.state_dict()[n])
    ]
    assert "encoder_layers.0.attn.qkv.weight" in changed and "embed.weight" in changed
    out = tmp_path / "tuned-hf"
    run_export(
        _compose(
            "export",
            [
                "experiment=smoke",
                f"export.checkpoint={run}",
                "export.format=hf",
                f"export.output_dir={out}",
                f"paths.artifacts={art}",
            ],
        )
    )
    with safe_open(str(out / "bpd_heads.safetensors"), framework="pt") as f:
        assert f.metadata()["format"] == "bpd-train-heads" and "heads.fc2.weight" in set(f.keys())
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    ttok = transformers.MarianTokenizer.from_pretrained(out)
    enc = ttok(SOURCES, return_tensors="pt", padding=True)
    with torch.no_grad():
        gen = hf.generate(**enc, num_beams=1, do_sample=False, max_new_tokens=20)
    eos, pad = tuned.config.eos_id, tuned.config.pad_id
    want = [[t for t in row.tolist()[1:]] for row in gen]
    want = [row[: row.index(eos)] if eos in row else [t for t in row if t != pad] for row in want]
    assert greedy(tuned.model, enc["input_ids"], max_len=20).tokens == want


def test_m2m100_languages_through_the_pipeline(folders, marian, tmp_path):
    """hf:<folder>@src:tgt (M2M100 / NLLB): the target language is the model's BOS after the decoder-start
    prefix, the source language the first source token; a frozen run keeps greedy bit for bit and its bundle
    remembers both languages."""
    from bpd_train.app.export import export_checkpoint
    from bpd_train.sources.bundle import load_bundle
    from bpd_train.training.run import train

    mm, ttok, de = folders["m2m100"]
    to_fr = load(f"hf:{mm}@en:fr")
    assert to_fr.config.bos_id == ttok.get_lang_id("fr") and to_fr.config.decoder_prefix == (2,)
    imported = load(f"hf:{mm}@en:de")
    tok = imported.tokenizer()
    assert imported.config.bos_id == de and tok.source_ids(SOURCES[0]) == ttok(SOURCES[0])["input_ids"]
    data_tok = imported.data_tokenizer()
    assert data_tok.bos_id == de and data_tok.encode_batch([SOURCES[0]])[0][0] == ttok.get_lang_id("en")
    src = _ids(tok, SOURCES)
    want = greedy(imported.model, src, max_len=16).tokens
    assert want != greedy(to_fr.model, src, max_len=16).tokens

    run = train(
        _compose(
            "train",
            [
                "+regime=frozen",
                f"regime.init_from=hf:{mm}@en:de",
                "experiment=smoke",
                f"paths.artifacts={tmp_path}/art",
                *_data(marian),
                "logger=none",
                "trainer.max_steps=2",
                "progress_bar=none",
                "callbacks.blockwise_eval.enabled=false",
            ],
        )
    )
    trained = load(run)
    assert trained.tokenizer_meta["src_lang"] == "en" and greedy(trained.model, src, max_len=16).tokens == want
    # resuming finds the run's tokenizer (tokenizer/, languages from the checkpoint) and continues
    train(
        _compose(
            "train",
            [
                "+regime=frozen",
                f"regime.init_from=hf:{mm}@en:de",
                "experiment=smoke",
                f"paths.artifacts={tmp_path}/art",
                *_data(marian),
                "logger=none",
                "trainer.max_steps=4",
                "progress_bar=none",
                "callbacks.blockwise_eval.enabled=false",
                "ckpt_path=last",
            ],
        )
    )
    assert json.loads((run / "done.json").read_text())["global_step"] == 4
    export_checkpoint(run, tmp_path / "bundle")
    model, btok, meta = load_bundle(tmp_path / "bundle")
    assert (btok.src_lang, btok.tgt_lang) == ("en", "de") and greedy(model, src, max_len=16).tokens == want
