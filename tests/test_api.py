"""The Python API that takes strings (bpd_train.Translator): the same text as the command line, batch size and
method independent where they must be, k̂ and calls reported, bad options named; the LM's generate; docs/api.md
runs as a doctest."""
import doctest
import io

import pytest

from _eval_tiny import build_tiny, read_pairs
from conftest import REPO_ROOT

from bpd_train import Translator
from bpd_train.export import export_checkpoint


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    tiny = build_tiny(tmp_path_factory)
    return export_checkpoint(tiny["run"], tmp_path_factory.mktemp("api") / "bundle")


def _cli(bundle, lines, *args):
    from bpd_train.translate import main

    out = io.StringIO()
    assert main(["--bundle", str(bundle), "--quiet", *args], stdin=io.StringIO("\n".join(lines) + "\n"),
                stdout=out, stderr=io.StringIO()) == 0
    return out.getvalue().split("\n")[:-1]


def test_translate_matches_the_command_line(bundle):
    lines = [s for s, _ in read_pairs("validation", 9)]
    lines.insert(4, "   ")
    tr = Translator.from_pretrained(bundle, device="cpu")
    out = tr.translate(lines, batch_size=3, max_len=(1, 5), adaptive=False)
    assert out.method == "blockwise k=4 exact"
    assert out.texts == _cli(bundle, lines, "--max-len", "1", "5", "--batch-size", "3")
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


@pytest.mark.parametrize("kwargs, pattern", [
    ({"method": "beam"}, r"method='beam'"),
    ({"accept": "sometimes"}, r"unknown acceptance rule"),
    ({"block_size": 9}, r"block size 9 is above the k = 4"),
    ({"batch_size": 0}, r"batch_size must be an int >= 1"),
    ({"sentences": "one string"}, r"sentences must be a list of str"),
    ({"sentences": ["ok", 3]}, r"sentences\[1\] is int"),
])
def test_bad_options_are_named(bundle, kwargs, pattern):
    tr = Translator.from_pretrained(bundle, device="cpu")
    sentences = kwargs.pop("sentences", ["hello"])
    with pytest.raises(ValueError, match=pattern):
        tr.translate(sentences, **kwargs)
    with pytest.raises(ValueError, match=r"generate\(\) is for decoder-only models"):
        tr.generate(["hello"])


def test_docs_page_runs(bundle):
    res = doctest.testfile(str(REPO_ROOT / "docs" / "api.md"), module_relative=False, globs={"bundle": str(bundle)},
                           optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
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
    assert chat.texts == _greedy_reference(lm_bundle, lambda tok: [tok.chat_ids([{"role": "user", "content": p}])
                                                                   for p in PROMPTS[:2]], 8)
    tr = lm.translate(["hello world"], src_lang="en", tgt_lang="fr", max_len=8)
    assert tr.texts == _greedy_reference(lm_bundle, lambda tok: [tok.encode("English: hello world\nFrench:")], 8)
    with pytest.raises(ValueError, match="src_lang and tgt_lang"):
        lm.translate(["hello world"])
