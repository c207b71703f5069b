"""The Python API that takes strings (bpd_train.Translator): the same text as the command line, batch size and
method independent where they must be, k̂ and calls reported, bad options named; the LM's generate; docs/api.md
runs as a doctest."""

import doctest
import io
import json

import pytest

from _eval_tiny import build_tiny, read_pairs
from conftest import REPO_ROOT

from bpd_train import Translator
from bpd_train.app.export import export_checkpoint
from bpd_train.decode_settings import DecodeSettings
from bpd_train.scoring import one_line


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    tiny = build_tiny(tmp_path_factory)
    return export_checkpoint(tiny["run"], tmp_path_factory.mktemp("api") / "bundle")


def _cli(bundle, lines, *args):
    from bpd_train.app.translate import main

    out = io.StringIO()
    assert (
        main(
            ["--bundle", str(bundle), "--quiet", *args],
            stdin=io.StringIO("\n".join(lines) + "\n"),
            stdout=out,
            stderr=io.StringIO(),
        )
        == 0
    )
    return out.getvalue().split("\n")[:-1]


def test_translate_matches_the_command_line(bundle):
    lines = [s for s, _ in read_pairs("validation", 9)]
    lines.insert(4, "   ")
    tr = Translator.from_pretrained(bundle, device="cpu")
    out = tr.translate(lines, batch_size=3, max_len=(1, 5), adaptive=False)
    assert out.method == "blockwise k=4 exact"
    # the texts as decoded; the line-per-input command line flattens each to one line, --jsonl keeps it as it is
    assert [one_line(t) for t in out.texts] == _cli(bundle, lines, "--max-len", "1", "5", "--batch-size", "3")
    jsonl = _cli(bundle, lines, "--max-len", "1", "5", "--batch-size", "3", "--jsonl")
    assert [json.loads(j)["text"] for j in jsonl] == out.texts
    assert out.texts[4] == "" and all(out.texts[i] for i in range(len(lines)) if i != 4)
    greedy = tr.translate(lines, batch_size=1, method="greedy", max_len=(1, 5))
    assert greedy.texts == out.texts and greedy.mean_accepted == 1.0  # exact blockwise == greedy
    assert 1.0 < out.mean_accepted <= tr.block_size and out.calls < greedy.calls
    top2 = tr.translate(lines, accept="top2", block_size=2, max_len=(1, 5))
    assert top2.texts == _cli(bundle, lines, "--max-len", "1", "5", "--accept", "top2", "--block-size", "2")
    assert top2.method == "blockwise k=2 top2"
    assert len(tr.translate(lines[:2], dtype="bf16").texts) == 2


def test_adaptive_feeding_by_default_where_it_cannot_change_the_output(bundle, monkeypatch):
    # the exact rule on the CPU: heads that do not pay fall back to greedy steps (never slower than greedy at any
    # batch); an approximate rule keeps every proposal (fewer would change what it accepts) unless asked
    import bpd_train.decoding as decoding

    lines = [s for s, _ in read_pairs("validation", 6)]
    tr = Translator.from_pretrained(bundle, device="cpu")
    plain = tr.translate(lines, batch_size=4, max_len=(1, 5), adaptive=False)
    seen = []
    real = decoding.blockwise
    monkeypatch.setattr(decoding, "blockwise", lambda *a, **kw: seen.append(kw.get("adaptive")) or real(*a, **kw))
    out = tr.translate(lines, batch_size=4, max_len=(1, 5))
    assert out.texts == plain.texts and out.method == "blockwise k=4 exact adaptive" and set(seen) == {True}
    seen.clear()
    assert tr.translate(lines, accept="top2", max_len=(1, 5)).method == "blockwise k=4 top2" and set(seen) == {False}
    seen.clear()
    tr.translate(lines, accept="top2", max_len=(1, 5), adaptive=True)
    assert set(seen) == {True}
    monkeypatch.setattr(decoding, "blockwise", real)
    assert _cli(bundle, lines, "--max-len", "1", "5", "--batch-size", "4") == plain.texts
    assert _cli(bundle, lines, "--max-len", "1", "5", "--no-adaptive") == plain.texts


def test_from_a_run_folder_too(bundle, tmp_path_factory):
    tiny = build_tiny(tmp_path_factory)
    a = Translator.from_pretrained(tiny["run"], device="cpu").translate(["And God said."])
    b = Translator.from_pretrained(bundle, device="cpu").translate(["And God said."])
    assert a.texts == b.texts


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        ({"method": "beam"}, r"method='beam'"),
        ({"accept": "sometimes"}, r"unknown acceptance rule"),
        ({"block_size": 9}, r"block size 9 is above the k = 4"),
        ({"batch_size": 0}, r"batch_size=0: expected an int >= 1"),
        ({"sentences": "one string"}, r"sentences must be a list of str"),
        ({"sentences": ["ok", 3]}, r"sentences\[1\] is int"),
    ],
)
def test_bad_options_are_named(bundle, kwargs, pattern):
    tr = Translator.from_pretrained(bundle, device="cpu")
    sentences = kwargs.pop("sentences", ["hello"])
    with pytest.raises(ValueError, match=pattern):
        tr.translate(sentences, **kwargs)
    with pytest.raises(ValueError, match=r"generate\(\) is for decoder-only models"):
        tr.generate(["hello"])


def test_docs_page_runs(bundle):
    res = doctest.testfile(
        str(REPO_ROOT / "docs" / "api.md"),
        module_relative=False,
        globs={"bundle": str(bundle)},
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE,
    )
    assert res.attempted >= 10 and res.failed == 0, res


def test_lm_generate(tmp_path_factory):
    pytest.importorskip("transformers")
    from test_lm_generate import PROMPTS, _bundle, _greedy_reference

    lm_bundle = _bundle(tmp_path_factory.mktemp("api-lm"), chat_template=True)
    lm = Translator.from_pretrained(lm_bundle, device="cpu")
    out = lm.generate(PROMPTS, batch_size=3, max_new_tokens=8)
    assert out.texts == _greedy_reference(lm_bundle, lambda tok: tok.encode(PROMPTS), 8)
    assert out.texts == lm.generate(PROMPTS, method="greedy", max_new_tokens=8).texts and out.mean_accepted >= 1
    chat = lm.generate(PROMPTS[:2], chat=True, max_new_tokens=8)
    assert chat.texts == _greedy_reference(
        lm_bundle, lambda tok: [tok.chat_ids([{"role": "user", "content": p}]) for p in PROMPTS[:2]], 8
    )
    tr = lm.translate(["hello world"], src_lang="en", tgt_lang="fr", max_len=8)
    assert tr.texts == _greedy_reference(lm_bundle, lambda tok: [tok.encode("English: hello world\nFrench:")], 8)
    with pytest.raises(ValueError, match="src_lang and tgt_lang"):
        lm.translate(["hello world"])


def test_draft_vocabulary_and_int8_proposals_can_be_turned_off(bundle):
    # the options reach the decoder (each call sets its own), and proposals never change the exact output
    lines = [s for s, _ in read_pairs("validation", 6)]
    tr = Translator.from_pretrained(bundle, device="cpu")
    plain = tr.translate(lines, max_len=(1, 5), draft_top_tokens=None, proposal_dtype=None)
    opts = tr.decoder.options
    assert opts.draft_vocab is None and opts.proposal_dtype is None and opts.dtype == "fp32"
    draft = tr.translate(lines, max_len=(1, 5), draft_top_tokens=50, proposal_dtype="int8")
    opts = tr.decoder.options
    assert len(opts.draft_vocab) in (50, 51) and opts.proposal_dtype == "int8"
    assert draft.tokens == plain.tokens == tr.translate(lines, method="greedy", max_len=(1, 5)).tokens
    assert (
        _cli(bundle, lines, "--max-len", "1", "5", "--draft-top-tokens", "none", "--proposal-dtype", "none")
        == plain.texts
    )
    tr.translate(lines[:1], max_len=(1, 5), draft_top_tokens=None, proposal_dtype=None)
    assert tr.decoder.options.draft_vocab is None  # not reset to "auto" by the next call


def test_the_command_line_and_translator_take_the_same_options():
    """Every decode flag of `python -m bpd_train.translate` is a declared setting (bpd_train/decode_settings.py), which
    Translator takes as a keyword override; the other flags are where text comes from and goes, or a Translator
    argument of the same meaning."""
    import inspect

    from bpd_train.app.translate import parser
    from bpd_train.decoding.settings import DEFAULT_MAX_LEN, DecodeSettings

    translate = inspect.signature(Translator.translate).parameters
    generate = inspect.signature(Translator.generate).parameters
    from_pretrained = inspect.signature(Translator.from_pretrained).parameters
    io_only = {"help", "errors", "input", "quiet", "jsonl"}  # how lines are read and written: a stream's concern only
    where = {
        "bundle": (from_pretrained, "spec"),
        "device": (from_pretrained, "device"),
        "greedy": (None, "method"),
        "langs": (translate, "src_lang"),
        "chat": (generate, "chat"),
        "max_new_tokens": (generate, "max_new_tokens"),
        "context_policy": (generate, "context_policy"),
    }
    dests = set()
    for action in parser()._actions:
        dests.add(action.dest)
        if action.dest in io_only or action.dest in DecodeSettings.names():
            continue
        params, name = where[action.dest]
        assert params is None and name in DecodeSettings.names() or name in params, action.dest
    assert set(DecodeSettings.names()) <= dests
    for fn in (translate, generate, from_pretrained):
        assert "settings" in fn and any(p.kind is p.VAR_KEYWORD for p in fn.values())
    # one max_len default: the settings', the evaluator's and the decoders'
    from bpd_train.decoding import blockwise, greedy
    from bpd_train.evaluation.runner import EvalSettings

    assert DecodeSettings().max_len == DEFAULT_MAX_LEN == EvalSettings().decode.max_len
    for fn in (greedy, blockwise):
        assert inspect.signature(fn).parameters["max_len"].default == DEFAULT_MAX_LEN


def test_lm_generate_in_int8(tmp_path_factory):
    """generate() takes the decode precision (and the proposal options) like translate(): int8 blockwise answers
    what int8 greedy does."""
    pytest.importorskip("transformers")
    from test_lm_generate import PROMPTS, _bundle

    from bpd_train.decoding import greedy
    from bpd_train.engine.fastlinear import native_kernels
    from bpd_train.engine.packed import DecodeOptions
    from bpd_train.engine.weights import PackedWeights
    from bpd_train.sources.loading import load

    if not native_kernels():
        pytest.skip("the torch path decodes decoder-only models in fp32 only")
    lm_bundle = _bundle(tmp_path_factory.mktemp("api-lm-int8"), chat_template=False)
    lm = Translator.from_pretrained(lm_bundle, device="cpu")
    out = lm.generate(PROMPTS, max_new_tokens=8, dtype="int8", draft_top_tokens=30, proposal_dtype="bf16")
    assert lm.decoder.options.dtype == "int8" and len(lm.decoder.options.draft_vocab) == 31
    loaded = load(lm_bundle)
    tok = loaded.lm_tokenizer()
    pw = PackedWeights(DecodeOptions(dtype="int8"))
    want = [tok.decode(t).strip() for t in greedy(loaded.model, tok.encode(PROMPTS), max_len=8, weights=pw).tokens]
    assert out.texts == want and any(want)
    assert out.texts == lm.generate(PROMPTS, max_new_tokens=8, dtype="int8", method="greedy").texts


class _Lines:
    """A text adapter whose answers hold line breaks (a chat model's list): ids 1..n decode to numbered lines."""

    def source_ids(self, s):
        return [1, 2, 3][: len(s.split())]

    def detok(self, ids):
        return "".join(f"- item {i}\n" for i in ids) + "```\ncode\n```\n"

    def batch(self, ids, device=None):
        return ids


def test_decoded_texts_keep_their_line_breaks_and_only_the_line_per_input_writer_flattens():
    import torch

    from bpd_train.app.translate import _line
    from bpd_train.decoding.result import DecodeResult
    from bpd_train.decoding.serving import decode_texts

    class Decoder:
        device = torch.device("cpu")
        settings = DecodeSettings(batch_size=2)

        def __call__(self, src):
            return DecodeResult(tokens=[list(s) for s in src], calls=1)

    out = decode_texts(Decoder(), _Lines(), ["a b", "", "a b c"])
    assert out.texts[0] == "- item 1\n- item 2\n```\ncode\n```" and out.texts[1] == ""  # as decoded (ends trimmed)
    assert _line(out.texts[2], jsonl=False) == "- item 1 - item 2 - item 3 ``` code ```\n"  # one line per input
    assert json.loads(_line(out.texts[2], jsonl=True))["text"] == out.texts[2]  # --jsonl: the text as it is


def test_stop_strings_end_the_answers_from_the_api_the_command_line_and_the_evaluator(bundle, tmp_path):
    """decode setting `stop` (declared once in bpd_train/decode_settings.py): each answer ends before the first stop
    string, its ids at the token that completes it; Translator, translate --stop and evaluate.py agree."""
    from bpd_train.evaluation.runner import EvalSettings, evaluate_inputs, expand_inputs

    lines = [s for s, _ in read_pairs("validation", 6)]
    tr = Translator.from_pretrained(bundle, device="cpu", max_len=(1, 5))
    full = tr.translate(lines)
    t = max(full.texts, key=len)
    stop = t[len(t) // 2 : len(t) // 2 + 3]
    want = [x[: x.find(stop)].strip() if stop in x else x for x in full.texts]
    assert any(w != x for w, x in zip(want, full.texts))
    out = tr.translate(lines, stop=[stop])
    assert out.texts == want
    detok = tr.family.text_adapter(tr.loaded, None, None, tokenizer=tr._tokenizer).detok
    for ids, cut, x in zip(full.tokens, out.tokens, full.texts):
        assert ids[: len(cut)] == cut
        if stop in x:  # the ids end at the token that completes the stop string
            assert stop in detok(cut) and stop not in detok(cut[:-1])
        else:
            assert cut == ids
    assert _cli(bundle, lines, "--max-len", "1", "5", "--stop", stop) == [one_line(w) for w in want]
    settings = EvalSettings(rules=["exact"], batch_sizes=[2], max_len=[1, 5], stop=[stop], progress=False)
    evaluate_inputs(expand_inputs([str(bundle)]), lines, lines, settings, tmp_path / "eval", plots=False)
    hyps = sorted((tmp_path / "eval" / "hyp").rglob("*.txt"))
    assert hyps and all(h.read_text(encoding="utf-8").splitlines() == [one_line(w) for w in want] for h in hyps)


def _report(path, source_id: str, rows: list[dict], **settings) -> str:
    """A minimal evaluation report over one checkpoint (what export.py reads)."""
    s = {"batch_sizes": [1, 8], "dtype": "fp32", "draft_top_tokens": "auto", "proposal_dtype": "auto", "lookup": 0,
         "narrow": 0, "tree": "", **settings}  # fmt: skip
    rep = {"format": "bpd-train-eval-report", "settings": s, "data": {}, "signatures": {"bleu": "x"},
           "checkpoints": [{"name": "heads", "source_id": source_id}],
           "rows": [{"checkpoint": "heads", "rule": "exact", "agreement": 100.0, **r} for r in rows]}  # fmt: skip
    path.write_text(json.dumps(rep))
    return str(path)


def test_a_bundle_carries_the_settings_its_evaluation_found_fastest(tmp_path_factory, tmp_path, monkeypatch):
    from bpd_train.app.translate import main
    from bpd_train.decode_settings import DecodeError
    from bpd_train.evaluation.report import recommended_settings
    from bpd_train.sources.loading import resolve

    tiny = build_tiny(tmp_path_factory)
    sid = resolve(tiny["run"]).id
    rows = [
        {"k": 2, "batch_size": 1, "speedup": 1.10, "mean_accepted": 1.5},
        {"k": 4, "batch_size": 1, "speedup": 1.30, "mean_accepted": 1.9},
        {"k": 4, "batch_size": 8, "speedup": 2.00, "mean_accepted": 1.9},  # another batch size: not the choice
    ]
    report = _report(tmp_path / "report.json", sid, rows, lookup=0, dtype="fp32")
    got = recommended_settings(report, sid)
    assert got["settings"] == {"method": "blockwise", "block_size": 4, "dtype": "fp32", "draft_top_tokens": "auto",
                               "proposal_dtype": "auto", "lookup": 0, "narrow": 0, "tree": ""}  # fmt: skip
    assert "1.30x" in got["why"]
    slow = _report(tmp_path / "slow.json", sid, [{"k": 4, "batch_size": 1, "speedup": 0.8, "mean_accepted": 1.1}])
    assert recommended_settings(slow, sid)["settings"] == {"method": "greedy", "dtype": "fp32"}
    slow8 = _report(tmp_path / "slow8.json", sid, [{"k": 4, "batch_size": 1, "speedup": 0.8, "mean_accepted": 1.1}],
                    dtype="int8")  # fmt: skip
    assert recommended_settings(slow8, sid)["settings"] == {"method": "greedy", "dtype": "int8"}  # its precision kept
    assert recommended_settings(report, "another-model") is None

    monkeypatch.setattr("bpd_train.evaluation.report.card_section", lambda *a: None)  # (the card needs a full report)
    b = export_checkpoint(tiny["run"], tmp_path / "bundle", report=report)
    assert json.loads((b / "config.json").read_text())["decode"] == got
    tr = Translator.from_pretrained(b, device="cpu")
    assert tr.settings.block_size == 4 and tr.settings.method == "blockwise" and "1.30x" in tr.carried_why
    assert Translator.from_pretrained(b, device="cpu", block_size=2).settings.block_size == 2  # the caller's wins
    assert Translator.from_pretrained(b, device="cpu", settings=DecodeSettings()).settings.block_size is None
    err = io.StringIO()
    assert (
        main(["--bundle", str(b), "--quiet"], stdin=io.StringIO("Jesus wept.\n"), stdout=io.StringIO(), stderr=err) == 0
    )
    # its precision too: the evaluation's fp32, over translate's default (auto)
    assert "decode settings from the bundle: block_size=4 dtype=fp32 method=blockwise (" in err.getvalue()

    g = export_checkpoint(tiny["run"], tmp_path / "greedy", report=slow)
    assert Translator.from_pretrained(g, device="cpu").settings.method == "greedy"
    assert Translator.from_pretrained(g, device="cpu", method="blockwise").settings.method == "blockwise"

    cfg = json.loads((b / "config.json").read_text())  # a bundle from elsewhere with a bad value: one line
    cfg["decode"]["settings"]["lookup"] = 99
    bad = tmp_path / "bad"
    import shutil

    shutil.copytree(b, bad)
    (bad / "config.json").write_text(json.dumps(cfg))
    from bpd_train.decode_settings import carried

    with pytest.raises(DecodeError, match=r"bundle x: its decode settings: lookup=99"):
        carried(cfg, "bundle x")


def test_sampling_from_the_api_the_command_line_and_the_evaluator(bundle, tmp_path):
    """temperature / top_k / top_p / seed (declared once): blockwise sampling through Translator, translate flags
    and evaluate.py's decode settings; input i is seeded seed + i, so the batch size changes no text; temperature 0
    is greedy's output; an acceptance rule other than exact is refused with a temperature."""
    from bpd_train.decoding.settings import DecodeError
    from bpd_train.evaluation.runner import EvalSettings, evaluate_inputs, expand_inputs

    lines = [s for s, _ in read_pairs("validation", 7)]
    tr = Translator.from_pretrained(bundle, device="cpu", max_len=(1, 5))
    hot = dict(temperature=0.9, top_p=0.95, seed=7)
    out = tr.translate(lines, batch_size=3, **hot)
    assert out.method.startswith("blockwise sampling k=4 T=0.9 top_p=0.95 seed=7")
    assert tr.translate(lines, batch_size=2, **hot).texts == out.texts  # row seeds follow the inputs, not batches
    cli = _cli(bundle, lines, "--max-len", "1", "5", "--temperature", "0.9", "--top-p", "0.95", "--seed", "7")
    assert cli == [one_line(t) for t in out.texts]
    assert (
        _cli(bundle, lines[3:], "--max-len", "1", "5", "--temperature", "0.9", "--top-p", "0.95", "--seed", "10")[:2]
        == cli[3:5]
    )  # line i of the input is seeded seed + i
    other = tr.translate(lines, temperature=0.9, top_p=0.95, seed=8)
    greedy = tr.translate(lines, method="greedy")
    assert other.texts != out.texts and greedy.texts != out.texts
    assert tr.translate(lines, temperature=0).texts == greedy.texts
    plain = tr.translate(lines, method="greedy", **hot)
    assert plain.method == "sampling T=0.9 top_p=0.95 seed=7" and plain.mean_accepted == 1.0
    # verify=match (the default): the heads change no token of plain sampling, one input at a time or in batches
    assert plain.texts == out.texts
    batched = tr.translate(lines, batch_size=len(lines), **hot)
    assert batched.texts == out.texts and batched.mean_accepted == 1.0  # a batch of several samples plainly
    alone = tr.translate(lines, batch_size=1, **hot)
    assert alone.texts == out.texts and alone.mean_accepted > 1.0
    spec = tr.translate(lines, batch_size=1, verify="speculative", **hot)
    assert spec.method.startswith("blockwise sampling k=4 T=0.9 top_p=0.95 seed=7 verify=speculative")
    assert spec.texts != out.texts  # the same distribution, other draws
    with pytest.raises(DecodeError, match="accept='top2' with temperature=0.9"):
        tr.translate(lines, accept="top2", temperature=0.9)
    settings = EvalSettings(
        block_sizes=[4], rules=["exact", "top2"], batch_sizes=[3], max_len=[1, 5], progress=False, **hot
    )
    evaluate_inputs(expand_inputs([str(bundle)]), lines, lines, settings, tmp_path / "eval", plots=False)
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    rows = report["rows"]
    assert [(r["k"], r["rule"]) for r in rows] == [(4, "sampling")] and rows[0]["mean_accepted"] > 1.0
    assert rows[0]["agreement"] == 100.0  # match verification: blockwise sampling's texts are plain sampling's
    hyp = (tmp_path / "eval" / rows[0]["hyp_file"]).read_text(encoding="utf-8").splitlines()
    assert hyp == [one_line(t) for t in out.texts]
    assert report["checkpoints"][0]["decode"]["sampling"] == {
        "temperature": 0.9,
        "top_k": 0,
        "top_p": 0.95,
        "seed": 7,
        "verify": "match",
    }
