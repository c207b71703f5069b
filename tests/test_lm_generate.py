"""Decoder-only bundles at the command line: `python -m bpd_train.translate --bundle <LM bundle>` answers prompts
(stdin or --input; --chat through the chat template; --langs as prompt-format translation), blockwise exact ==
greedy, bad input as one line with exit status 2; and evaluate.py on chat `messages` records (the prompt
rendered by the template, the last assistant turn the reference)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bpd_train.engine.fastlinear import native_kernels

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from _lm_tiny import WORDS, make_tokenizer  # noqa: E402
from conftest import REPO_ROOT, offline_env  # noqa: E402

PROMPTS = ["the quick brown fox", "hello world", "a stitch in time saves nine and the lazy dog", "how are you"]


def _llama(folder: Path, chat_template: bool) -> Path:
    folder.mkdir(parents=True)
    v = make_tokenizer(folder, bos=True, chat_template=chat_template)
    cfg = transformers.LlamaConfig(
        vocab_size=v,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=24,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # wider than transformers' init: peaked, prompt-dependent outputs of several lengths
        for p in model.parameters():
            p.mul_(15.0) if p.dim() == 2 else None
    model.save_pretrained(folder)
    return folder


def _bundle(tmp: Path, chat_template: bool) -> Path:
    """hf folder -> our model with k = 3 random heads -> hf folder with bpd_heads -> a bundle (export.py's path)."""
    from bpd_train.app.export import export_checkpoint
    from bpd_train.sources.convert.hf.lm import load_hf_lm, to_hf_lm

    src = _llama(tmp / "hf", chat_template)
    model, _, _ = load_hf_lm(src, block_size=3)
    torch.manual_seed(1)
    with torch.no_grad():
        for p in model.head_parameters():
            p.normal_(0, 0.3)
    heads = to_hf_lm(model, tmp / "hf-heads", tokenizer_folder=src)
    return export_checkpoint(f"hf:{heads}", tmp / "bundle")


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return _bundle(tmp_path_factory.mktemp("lm-chat"), chat_template=True)


def _run(argv, text=""):
    from bpd_train.app.translate import main

    out, err = io.StringIO(), io.StringIO()
    rc = main(argv, stdin=io.StringIO(text), stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def _greedy_reference(bundle: Path, prompts, max_new: int) -> list[str]:
    from bpd_train.decoding import greedy
    from bpd_train.sources.loading import load

    loaded = load(bundle)
    tok = loaded.lm_tokenizer()
    r = greedy(loaded.model, prompts(tok), max_len=max_new)
    return [tok.decode(t).strip() for t in r.tokens]


def test_generate_cli_answers_prompts_blockwise_equals_greedy(bundle, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS[:2] + [""] + PROMPTS[2:]) + "\n")
    base = [
        sys.executable,
        "-m",
        "bpd_train.translate",
        "--bundle",
        str(bundle),
        "--max-new-tokens",
        "8",
        "--batch-size",
        "3",
    ]
    res = subprocess.run(
        base + ["--input", str(prompts)], cwd=REPO_ROOT, env=offline_env(), capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.split("\n")[:-1]
    assert len(lines) == 5 and lines[2] == "" and "answered 5 lines (blockwise k=3 exact" in res.stderr
    want = _greedy_reference(bundle, lambda tok: tok.encode(PROMPTS), 8)
    assert [ln for i, ln in enumerate(lines) if i != 2] == want
    assert len(set(want)) > 1 and any(want)
    # greedy, and stdin instead of --input: the same answers
    rc, out, err = _run(["--bundle", str(bundle), "--max-new-tokens", "8", "--greedy"], prompts.read_text())
    assert rc == 0 and out == res.stdout and "greedy" in err
    # --chat: each line is the user's message, rendered by the template (not the raw text)
    rc, chat_out, _ = _run(["--bundle", str(bundle), "--max-new-tokens", "8", "--chat"], "\n".join(PROMPTS) + "\n")
    chat_want = _greedy_reference(
        bundle, lambda tok: [tok.chat_ids([{"role": "user", "content": p}]) for p in PROMPTS], 8
    )
    assert rc == 0 and chat_out.split("\n")[:-1] == chat_want and chat_want != want
    # --langs: prompt-format translation prompts, as the LM demo trains on
    rc, tr_out, _ = _run(["--bundle", str(bundle), "--max-new-tokens", "8", "--langs", "en:fr"], "hello world\n")
    tr_want = _greedy_reference(bundle, lambda tok: [tok.encode("English: hello world\nFrench:")], 8)
    assert rc == 0 and tr_out == tr_want[0] + "\n"


@pytest.mark.skipif(not native_kernels(), reason="the native CPU kernels are not built on this machine")
def test_generate_cli_int8_draft_vocab_blockwise_equals_int8_greedy(bundle):
    """--dtype / --draft-vocab / --proposal-dtype on a decoder-only bundle: blockwise in int8 with proposals over the
    30 lowest non-special ids (a BPE vocabulary's most frequent) answers what int8 greedy does."""
    from bpd_train.decoding import greedy
    from bpd_train.decoding.settings import draft_vocabulary
    from bpd_train.engine.packed import DecodeOptions
    from bpd_train.engine.weights import PackedWeights
    from bpd_train.sources.loading import load

    text = "\n".join(PROMPTS) + "\n"
    rc, out, err = _run(
        [
            "--bundle",
            str(bundle),
            "--max-new-tokens",
            "8",
            "--dtype",
            "int8",
            "--draft-vocab",
            "30",
            "--proposal-dtype",
            "bf16",
        ],
        text,
    )
    assert rc == 0 and "blockwise k=3 exact" in err, err
    loaded = load(bundle)
    tok = loaded.lm_tokenizer()
    draft = draft_vocabulary(tok, 30, tok.eos_id)
    special = {i for i, t in tok.tk.get_added_tokens_decoder().items() if t.special}
    assert len(draft) == 31 and tok.eos_id in draft and not (set(draft) - {tok.eos_id}) & special
    pw = PackedWeights(DecodeOptions(dtype="int8"))
    want = [tok.decode(t).strip() for t in greedy(loaded.model, tok.encode(PROMPTS), max_len=8, weights=pw).tokens]
    assert out.split("\n")[:-1] == want and any(want)


def test_generate_cli_bad_input_is_one_line(bundle, tmp_path):
    def one_error(rc, out, err, text):
        assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith("error:") and text in err, err

    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    one_error(*_run(["--bundle", str(bundle), "--input", str(empty)]), "is empty: give one prompt per line")
    one_error(*_run(["--bundle", str(bundle), "--input", str(tmp_path / "nope.txt")]), "does not exist")
    long = " ".join(WORDS[:30])  # 31 tokens with BOS; the context is 24
    one_error(
        *_run(["--bundle", str(bundle), "--context-policy", "refuse"], f"{long}\n"),
        "line 1: a prompt of 31 tokens does not fit the context of 24",
    )
    rc, out, err = _run(["--bundle", str(bundle), "--max-new-tokens", "4"], f"hello\n{long}\n")
    assert rc == 0 and len(out.split("\n")) == 3 and "1 source(s) truncated to 24 positions" in err
    one_error(*_run(["--bundle", str(bundle), "--chat", "--langs", "en:fr"], "hi\n"), "exclude each other")
    # the torch path (no native kernels) decodes decoder-only models in fp32 only: one line, not a traceback
    torch_engine = subprocess.run(
        [sys.executable, "-m", "bpd_train.translate", "--bundle", str(bundle), "--dtype", "int8"],
        input="hi\n",
        cwd=REPO_ROOT,
        env=offline_env(BPD_DECODE_ENGINE="torch"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    one_error(torch_engine.returncode, torch_engine.stdout, torch_engine.stderr, "decode in fp32")
    one_error(
        *_run(["--bundle", str(bundle), "--draft-vocab", "-3"], "hi\n"),
        "draft_top_tokens='-3': expected a number of tokens >= 1",
    )
    plain = _bundle(tmp_path, chat_template=False)
    one_error(*_run(["--bundle", str(plain), "--chat"], "hi\n"), "has no chat template")


def test_evaluate_on_chat_records_applies_the_template(bundle, tmp_path):
    """evaluate.py with data.lm.files holding `messages` records: each prompt is the chat before the last
    assistant turn rendered by the model's template, that turn the reference; exact blockwise == greedy (here with
    int8 proposals over a 30-token draft vocabulary)."""
    from bpd_train.decoding import greedy
    from bpd_train.sources.loading import load

    chats = [
        [
            {"role": "system", "content": "good morning"},
            {"role": "user", "content": p},
            {"role": "assistant", "content": "the lazy dog"},
        ]
        for p in PROMPTS
    ]
    rec = tmp_path / "chat.jsonl"
    rec.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    out = tmp_path / "eval"
    cmd = [
        sys.executable,
        "evaluate.py",
        "experiment=smoke_lm",
        f"data.lm.files={{validation:{rec}}}",
        f"evaluate.inputs=[{bundle}]",
        f"evaluate.output_dir={out}",
        "evaluate.batch_sizes=[2]",
        "evaluate.distilled=null",
        "evaluate.wandb=false",
        "decode.max_len=8",
        "decode.draft_top_tokens=30",
        "decode.proposal_dtype=int8",
        f"paths.artifacts={tmp_path / 'a'}",
        f"hydra.run.dir={tmp_path / 'h'}",
    ]
    r = subprocess.run(cmd, cwd=REPO_ROOT, env=offline_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["data"]["chats"] == 4 and report["data"]["sentences"] == 4
    # proposals over a draft vocabulary in int8 (the decoder-only engine takes them): verification keeps greedy's output
    decode = report["checkpoints"][0]["decode"]
    # draft_vocab as resolved: the 30 most frequent tokens and the stop id
    assert decode["draft_vocab"] == 31 and decode["proposal_dtype"] == "int8" and decode["engine"].startswith("native")
    assert all(row["agreement"] == 100.0 for row in report["rows"] if row["rule"] == "exact") and report["rows"]
    loaded = load(bundle)
    tok = loaded.lm_tokenizer()
    want = [
        tok.decode(t).strip() for t in greedy(loaded.model, [tok.chat_ids(c[:-1]) for c in chats], max_len=8).tokens
    ]
    name = report["checkpoints"][0]["name"]
    assert (out / "hyp" / name / "greedy.txt").read_text().split("\n")[:-1] == want
    assert json.loads((out / "src.txt").read_text().splitlines()[0]) == chats[0][:-1]
    assert (out / "ref.txt").read_text().splitlines() == ["the lazy dog"] * 4
    # a chat that does not end with the assistant's reference: one line
    rec.write_text(json.dumps({"messages": chats[0][:-1]}) + "\n")
    r = subprocess.run(
        cmd[:-1] + [f"hydra.run.dir={tmp_path / 'h2'}"],
        cwd=REPO_ROOT,
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2 and "must end with a non-empty assistant message" in r.stderr
