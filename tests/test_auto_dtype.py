"""dtype "auto", the serving default of translate and Translator: the precision chosen by the model's weight type (a
GGUF file's: the type most of its matrices have) through one declared table (decoding/settings.py AUTO_DTYPE), fp32
on CUDA and on a CPU without the int8 kernels; a dtype given as a flag, a keyword or by a bundle wins; the choice
and its reason are one line (translate's stderr, Translator's log); evaluation keeps fp32."""

from __future__ import annotations

import io
import logging

import pytest
import torch

from bpd_train.decoding.settings import AUTO_DTYPE, DecodeSettings, auto_dtype, resolve_dtype

MAX_NEW = 8
PROMPTS = ["the quick brown fox", "hello world, how are"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BPD_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def kernels(monkeypatch):
    """The CPU's int8-kernel check, set by the test (the rule's answer must not depend on the machine)."""

    def set_to(on: bool):
        monkeypatch.setattr("bpd_train.decoding.settings.int8_compute", lambda: on)

    set_to(True)
    return set_to


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Tiny llama GGUF files, one per weight type: the layer matrices in that type (the output projection Q8_0 and
    the embedding F32 in the 4-bit file, as llama.cpp's Q4_1 files keep them wider)."""
    pytest.importorskip("gguf")
    from _gguf_files import bpe, hf_model, write_gguf

    d = tmp_path_factory.mktemp("auto-dtype")
    tokens, merges, types = bpe(320)
    eos = tokens.index("<|im_end|>")
    model = hf_model("llama", len(tokens), eos=eos, seed=0)
    out = {}
    for name, qtypes, default in [
        ("Q4_1", {"blk.": "Q4_1", "output": "Q8_0"}, "F32"),
        ("Q4_0", {"blk.": "Q4_0"}, "F32"),
        ("Q8_0", {"blk.": "Q8_0"}, "F32"),
        ("F16", {}, "F16"),
        ("BF16", {}, "BF16"),
        ("F32", {}, "F32"),
    ]:
        path = d / f"tiny.{name}.gguf"
        write_gguf(path, model, tokens, merges, types, arch="llama", eos=eos, qtypes=qtypes, default=default)
        out[name] = path
    return out


def test_the_rule_by_weight_type_device_and_kernels():
    assert auto_dtype("Q4_1", "cpu", int8_kernels=True)[0] == "q4"
    assert auto_dtype("Q4_0", "cpu", int8_kernels=True)[0] == "q4"
    assert auto_dtype("Q4_K", "cpu", int8_kernels=True)[0] == "q4"  # its codes, float32 scales per 32
    assert auto_dtype("Q8_0", "cpu", int8_kernels=True)[0] == "int8"
    for fewer in ("Q5_0", "Q5_K", "Q6_K", "Q3_K"):  # under 8 bits, no 4-bit blocks to keep: int8, a rounding more
        assert auto_dtype(fewer, "cpu", int8_kernels=True)[0] == "int8" and fewer in auto_dtype(fewer, "cpu")[1]
    for kept in ("F32", "F16", "BF16", "TQ1_0", None):  # the weights exactly: no faster precision keeps them
        dtype, why = auto_dtype(kept, "cpu", int8_kernels=True)
        assert dtype == "fp32" and "exactly" in why, kept
    assert "an hf: folder or a model of ours" in auto_dtype(None, "cpu", int8_kernels=True)[1]
    assert "TQ1_0" in auto_dtype("TQ1_0", "cpu", int8_kernels=True)[1]
    # CUDA keeps fp32 (as before auto); so does a CPU without the int8 kernels, where q4 / int8 are only dequantised
    for t in ("Q4_1", "Q8_0", None):
        assert auto_dtype(t, "cuda", int8_kernels=True)[0] == "fp32"
        assert auto_dtype(t, torch.device("cuda", 0), int8_kernels=True)[0] == "fp32"
    dtype, why = auto_dtype("Q4_1", "cpu", int8_kernels=False)
    assert dtype == "fp32" and why.startswith("no int8 kernels here") and "q4" in why
    # every entry is a precision with a one-line reason
    assert all(d in ("fp32", "bf16", "int8", "q4") and why and "\n" not in why for d, why in AUTO_DTYPE.values())


def test_resolve_keeps_a_given_dtype_and_says_why_for_auto(kernels):
    assert DecodeSettings().dtype == "auto"
    s, line = resolve_dtype(DecodeSettings(lookup=2), "Q4_1", "cpu")
    assert s == DecodeSettings(lookup=2, dtype="q4")
    assert line.startswith("precision q4 (dtype auto): the file's own Q4_1 blocks with 8-bit activations")
    for given in ("fp32", "bf16", "int8", "q4"):
        assert resolve_dtype(DecodeSettings(dtype=given), "Q4_1", "cpu") == (DecodeSettings(dtype=given), None)
    kernels(False)
    s, line = resolve_dtype(DecodeSettings(), "Q4_1", "cpu")
    assert s.dtype == "fp32" and "no int8 kernels" in line
    with pytest.raises(ValueError, match="dtype='q5': expected one of fp32, bf16, int8, q4 or auto"):
        DecodeSettings(dtype="q5")


def test_a_gguf_files_weight_type(files):
    from bpd_train.sources.loading import load

    for name, path in files.items():
        loaded = load(f"gguf:{path}")
        assert loaded.weight_type == name and loaded.meta["weight_type"] == name


def test_translator_picks_by_the_file_logs_why_and_takes_overrides(files, kernels, caplog):
    from bpd_train.app.api import Translator

    spec = f"gguf:{files['Q4_1']}"
    with caplog.at_level(logging.INFO, logger="bpd_train.app.api"):
        tr = Translator.from_pretrained(spec, device="cpu", method="greedy")
    lines = [r.getMessage() for r in caplog.records if r.name == "bpd_train.app.api"]
    assert lines == ["precision q4 (dtype auto): " + AUTO_DTYPE["Q4_1"][1] + "; the dtype keyword overrides"], lines
    assert tr.settings.dtype == "auto" and tr.dtype == "q4"
    auto = tr.generate(PROMPTS, max_new_tokens=MAX_NEW)
    assert tr.decoder.options.dtype == "q4" and tr.decoder.settings.dtype == "q4"
    assert auto.texts == tr.generate(PROMPTS, max_new_tokens=MAX_NEW, dtype="q4").texts  # auto decoded in q4
    fp32 = tr.generate(PROMPTS, max_new_tokens=MAX_NEW, dtype="fp32")  # a call's keyword wins
    assert tr.decoder.options.dtype == "fp32" and tr.decoder.precision is None
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="bpd_train.app.api"):
        given = Translator.from_pretrained(spec, device="cpu", method="greedy", dtype="fp32")  # the keyword wins
        assert given.dtype == "fp32" and given.generate(PROMPTS, max_new_tokens=MAX_NEW).texts == fp32.texts
    assert not [r for r in caplog.records if r.name == "bpd_train.app.api"]  # nothing chosen: no line

    # a bundle's carried precision (its evaluation's) wins over auto
    tr.loaded.meta["decode"] = {"settings": {"dtype": "fp32"}, "why": "its evaluation"}
    assert Translator(tr.loaded, torch.device("cpu")).dtype == "fp32"
    del tr.loaded.meta["decode"]
    # CUDA keeps fp32; a CPU without the int8 kernels falls back to fp32
    assert Translator(tr.loaded, torch.device("cuda")).dtype == "fp32"
    kernels(False)
    assert Translator(tr.loaded, torch.device("cpu")).dtype == "fp32"


@pytest.mark.parametrize("name, want", [("Q4_0", "q4"), ("Q8_0", "int8"), ("F16", "fp32"), ("BF16", "fp32")])
def test_each_file_type_gets_its_precision(files, kernels, name, want):
    from bpd_train.app.api import Translator

    tr = Translator.from_pretrained(f"gguf:{files[name]}", device="cpu", method="greedy")
    assert tr.dtype == want
    tr.generate(PROMPTS[:1], max_new_tokens=4)
    assert tr.decoder.options.dtype == want


def test_hf_folders_and_bundles_keep_fp32(files, kernels, tmp_path):
    """The same 4-bit weights as an hf: folder or a bundle of ours: fp32 (their files hold fp32 weights)."""
    from bpd_train.app.api import Translator
    from bpd_train.app.export import export_checkpoint, export_hf

    spec = f"gguf:{files['Q4_1']}"
    hf = export_hf(spec, tmp_path / "hf")
    bundle = export_checkpoint(spec, tmp_path / "bundle")
    for what in (f"hf:{hf}", str(bundle)):
        tr = Translator.from_pretrained(what, device="cpu")
        assert tr.weight_type is None and tr.dtype == "fp32", what


def _translate(argv):
    from bpd_train.app.translate import main

    out, err = io.StringIO(), io.StringIO()
    rc = main(argv, stdin=io.StringIO("\n".join(PROMPTS) + "\n"), stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def test_translate_prints_the_choice_in_one_line_and_the_flag_overrides(files, kernels):
    args = ["--bundle", f"gguf:{files['Q4_1']}", "--greedy", "--quiet", "--max-new-tokens", str(MAX_NEW)]
    args += ["--device", "cpu"]
    rc, auto, err = _translate(args)
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("precision")]
    assert lines == ["precision q4 (dtype auto): " + AUTO_DTYPE["Q4_1"][1] + "; --dtype overrides"], err
    rc, q4, err = _translate(args + ["--dtype", "q4"])
    assert rc == 0 and q4 == auto and "precision" not in err  # auto decoded in q4; a given dtype prints nothing
    kernels(False)
    rc, _, err = _translate(args)
    assert rc == 0 and "precision fp32 (dtype auto): no int8 kernels here" in err, err
    rc, _, err = _translate(args + ["--dtype", "q5"])
    assert rc == 2 and err.strip().splitlines() == ["error: dtype='q5': expected one of fp32, bf16, int8, q4 or auto"]


def test_evaluation_keeps_fp32_unless_asked(files, kernels, tmp_path):
    from bpd_train.evaluation.runner import EvalSettings, evaluate_loaded
    from bpd_train.sources.loading import load

    assert EvalSettings().decode.dtype == "fp32"
    assert EvalSettings(decode=DecodeSettings(dtype="int8")).decode.dtype == "int8"
    loaded = load(f"gguf:{files['Q4_1']}")
    for given, want in [({}, "fp32"), ({"dtype": "auto"}, "q4")]:  # decode.dtype=auto: translate's rule
        s = EvalSettings(block_sizes=[], rules=[], batch_sizes=[2], max_len=4, progress=False, **given)
        entry, _ = evaluate_loaded(loaded, "tiny", PROMPTS, PROMPTS, s, tmp_path / want)
        assert entry["decode"]["dtype"] == want


def test_a_bundle_carries_the_precision_auto_resolved_to_in_its_evaluation(tmp_path):
    """An evaluation run with decode.dtype=auto: its bundle carries the precision each checkpoint decoded in (a
    bundle of ours would resolve auto to fp32 again, not to the file's q4)."""
    import json

    from bpd_train.evaluation.report import recommended_settings

    s = {"batch_sizes": [1], "dtype": "auto", "draft_top_tokens": "auto", "proposal_dtype": "auto", "lookup": 0,
         "narrow": 0, "tree": ""}  # fmt: skip
    rep = {"format": "bpd-train-eval-report", "settings": s, "data": {}, "signatures": {"bleu": "x"},
           "checkpoints": [{"name": "heads", "source_id": "sha256:x", "decode": {"dtype": "q4"}}],
           "rows": [{"checkpoint": "heads", "rule": "exact", "agreement": 100.0, "k": 4, "batch_size": 1,
                     "speedup": 1.3, "mean_accepted": 1.9}]}  # fmt: skip
    path = tmp_path / "report.json"
    path.write_text(json.dumps(rep))
    got = recommended_settings(path, "sha256:x")
    assert got["settings"]["dtype"] == "q4" and ", q4:" in got["why"]
    rep["settings"]["dtype"] = "int8"  # a dtype given to the evaluation is carried as given
    path.write_text(json.dumps(rep))
    assert recommended_settings(path, "sha256:x")["settings"]["dtype"] == "int8"
