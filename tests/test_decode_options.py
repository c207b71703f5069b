"""decode.draft_top_tokens / decode.proposal_dtype = auto (the default of evaluate, translate and Translator): the cheapest
proposals that keep the output, resolved per tokenizer and machine."""

from __future__ import annotations

import pytest

from bpd_train.decode_settings import EVAL_DTYPE
from bpd_train.decoding.settings import DecodeError as EvalError
from bpd_train.decoding.settings import DecodeSettings, decode_options, draft_vocabulary, proposal_precision
from bpd_train.engine.fastlinear import int8_compute


class Ranked:
    """A sentencepiece-like processor: piece i scores -i (so ids rank in order), ids 0-2 are control pieces."""

    def __init__(self, size: int):
        self.size = size

    def get_piece_size(self):
        return self.size

    def get_score(self, i):
        return -float(i)

    def is_control(self, i):
        return i < 3

    def is_unknown(self, i):
        return False

    def is_unused(self, i):
        return False


def test_auto_draft_vocabulary_is_a_quarter_of_a_large_vocabulary():
    ids = draft_vocabulary(Ranked(4000), "auto", eos_id=2)
    # the 1000 best-ranked pieces (ids 3..1002), plus the stop id
    assert ids == tuple([2] + list(range(3, 1003)))
    assert draft_vocabulary(Ranked(4000), "auto", eos_id=2) == draft_vocabulary(Ranked(4000), 1000, eos_id=2)
    # a small vocabulary: proposals over all of it
    assert draft_vocabulary(Ranked(1000), "auto", eos_id=2) is None
    for off in (None, "null", "none", 0):
        assert draft_vocabulary(Ranked(4000), off, eos_id=2) is None
    with pytest.raises(EvalError, match="draft_top_tokens='many': expected a number of tokens"):
        draft_vocabulary(Ranked(4000), "many", eos_id=2)


def test_auto_draft_vocabulary_without_a_token_ranking_is_the_full_vocabulary():
    class Unranked:
        vocab_size = 5000

    assert draft_vocabulary(Unranked(), "auto", eos_id=2) is None
    with pytest.raises(EvalError, match="no token ranking"):
        draft_vocabulary(Unranked(), 100, eos_id=2)


def test_auto_proposal_precision_is_int8_on_a_cpu_with_int8_kernels_only():
    assert proposal_precision("auto", "fp32", "cpu") == ("int8" if int8_compute() else None)
    assert proposal_precision("auto", "bf16", "cpu") == ("int8" if int8_compute() else None)
    assert proposal_precision("auto", "int8", "cpu") is None  # already int8
    assert proposal_precision("auto", "fp32", "cuda") is None  # no native kernels there
    assert proposal_precision("bf16", "fp32", "cuda") == "bf16"  # an explicit choice is kept
    assert proposal_precision(None, "fp32", "cpu") is None
    opts = decode_options(DecodeSettings(), Ranked(4000), 2, "cpu")  # every entry point's default
    assert len(opts.draft_vocab) == 1001 and opts.proposal_dtype == proposal_precision("auto", "fp32", "cpu")
    with pytest.raises(EvalError, match="dtype"):
        DecodeSettings(proposal_dtype="int4")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"method": "beam"}, "method='beam': expected one of blockwise, greedy"),
        ({"accept": "sometimes"}, "accept='sometimes': unknown acceptance rule 'sometimes': use exact, top<N>"),
        ({"dtype": "fp16"}, "dtype='fp16': expected one of fp32, bf16, int8"),
        ({"proposal_dtype": "fp8"}, "proposal_dtype='fp8': expected one of fp32, bf16, int8, q4, auto or none"),
        ({"draft_top_tokens": -3}, "draft_top_tokens=-3: expected a number of tokens >= 1, auto, or null"),
        ({"draft_top_tokens": "many"}, "draft_top_tokens='many': expected a number of tokens >= 1, auto, or null"),
        ({"adaptive": 2}, "adaptive=2: expected true, false, auto (None) or a threshold in (0, 1)"),
        ({"block_size": 0}, "block_size=0: expected an int >= 1"),
        ({"batch_size": 0}, "batch_size=0: expected an int >= 1"),
        ({"max_len": [1, float("inf")]}, "max_len=[1, inf]: expected finite numbers [a, b]"),
        ({"max_len": "long"}, "max_len='long': expected an int, or [a, b]"),
        ({"tree": "x"}, "tree='x': expected rank paths such as '0 1 0,0'"),
        ({"lookup": 9}, "lookup=9: expected an int in 0..8 (0: off)"),
        ({"narrow": -1}, "narrow=-1: expected 0 (off) or an int >= 1"),
    ],
)
def test_bad_settings_are_one_error_naming_the_field_value_and_choices(kwargs, message):
    from bpd_train.decoding.settings import DecodeError, DecodeSettings

    with pytest.raises(DecodeError) as e:
        DecodeSettings(**kwargs)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    assert isinstance(e.value, EvalError) and isinstance(e.value, ValueError)  # what callers catch


def test_settings_are_normalised_once():
    from bpd_train.decoding.settings import DEFAULT_MAX_LEN, DecodeSettings

    s = DecodeSettings(dtype="INT8", draft_top_tokens="none", proposal_dtype="null", adaptive="false", max_len=[2, 3])
    assert (s.dtype, s.draft_top_tokens, s.proposal_dtype, s.adaptive, s.max_len) == ("int8", None, None, False, (2, 3))
    d = DecodeSettings()
    assert (d.draft_top_tokens, d.proposal_dtype, d.adaptive, d.max_len) == ("auto", "auto", None, DEFAULT_MAX_LEN)
    assert d.adaptive_on("cpu") is True and d.adaptive_on("cuda") is False
    assert (
        DecodeSettings(accept="top2").adaptive_on("cpu") is False and d.replace(adaptive=0.5).adaptive_on("cpu") == 0.5
    )
    opts = decode_options(DecodeSettings(draft_top_tokens=None, proposal_dtype=None), Ranked(4000), 2, "cpu")
    assert opts.draft_vocab is None and opts.proposal_dtype is None
    opts = decode_options(DecodeSettings(lookup=3, narrow=2), Ranked(4000), 2, "cpu")  # the options carry both
    assert (opts.lookup, opts.narrow) == (3, 2)


# --------------------------------------------------------------- one declaration, everything derived from it
def test_the_translate_flags_are_the_declared_settings():
    """One flag per declared setting, `--<name>`, not given unless given; what a flag sets is the setting."""
    import dataclasses

    from bpd_train.app.translate import decode_settings, parser
    from bpd_train.decode_settings import DecodeSettings as Declared

    p = parser()
    dests = {a.dest: a for a in p._actions}
    for f in dataclasses.fields(Declared):
        flag = "--" + f.name.replace("_", "-")
        assert flag in dests[f.name].option_strings, f.name
        assert f.metadata["help"] in dests[f.name].help  # the declared help text, with the declared default
    assert decode_settings(p.parse_args(["--bundle", "x"])) == Declared()
    given = p.parse_args(
        ["--bundle", "x", "--batch-size", "4", "--block-size", "2", "--tree", "0;1", "--draft-vocab", "64"]
        + ["--max-len", "1", "5", "--no-adaptive", "--accept", "top2", "--dtype", "INT8"]
    )
    assert decode_settings(given) == Declared(
        batch_size=4,
        block_size=2,
        tree="0;1",
        draft_top_tokens=64,
        max_len=(1, 5),
        adaptive=False,
        accept="top2",
        dtype="int8",
    )
    assert decode_settings(p.parse_args(["--bundle", "x", "--greedy", "--max-new-tokens", "8"])).max_len == 8
    assert decode_settings(p.parse_args(["--bundle", "x", "--adaptive=0.5"])).adaptive == 0.5


@pytest.mark.parametrize("name", ["blockwise", "greedy"])
def test_the_decode_configs_list_every_declared_setting_at_its_default(name):
    """conf/decode/*.yaml (composed: each takes _settings.yaml): every setting a decode config shows, at the declared
    default (auto adaptive included), and nothing else besides the evaluator's grid."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from bpd_train.configs import config_dir
    from bpd_train.decode_settings import DecodeSettings as Declared

    with initialize_config_dir(version_base="1.3", config_dir=str(config_dir())):
        cfg = OmegaConf.to_container(compose("evaluate", overrides=[f"decode={name}"]).decode, resolve=True)
    assert set(cfg) - {"block_sizes", "rules"} == set(Declared.yaml_names())
    assert Declared.from_config(cfg) == Declared(dtype=EVAL_DTYPE)  # evaluation keeps fp32; serving's is auto
    assert Declared().dtype == "auto" and EVAL_DTYPE == "fp32"


def test_translator_and_the_evaluator_take_the_declared_names_as_overrides():
    from bpd_train.app.api import Translator
    from bpd_train.evaluation.runner import EvalSettings

    class Loaded:
        model = None

        def tokenizer(self):
            return None

    tr = Translator(Loaded(), "cpu", lookup=3, tree="0;1")
    assert tr.settings == DecodeSettings(lookup=3, tree="0;1")
    assert tr.settings.replace(narrow=2).narrow == 2
    ev = EvalSettings(rules=["exact"], dtype="int8", lookup=2)
    assert ev.decode == DecodeSettings(dtype="int8", lookup=2)
    assert EvalSettings().decode == DecodeSettings(dtype=EVAL_DTYPE)  # the declaration's, dtype fp32 (its tables')
    with pytest.warns(DeprecationWarning, match="draft_vocab is now draft_top_tokens"):
        assert Translator(Loaded(), "cpu", draft_vocab=8).settings.draft_top_tokens == 8  # the old name, with a line
    with pytest.raises(EvalError, match="unknown decode setting 'beam'"):
        Translator(Loaded(), "cpu", beam=4)


@pytest.mark.parametrize(
    "name, value, flag",
    [("narrow", -1, ["--narrow", "-1"]), ("lookup", 9, ["--lookup", "9"]), ("batch_size", 0, ["--batch-size", "0"])],
)
def test_a_bad_value_is_the_same_line_from_the_api_the_evaluator_the_configs_and_the_command_line(name, value, flag):
    import io

    from bpd_train.app.api import Translator
    from bpd_train.app.translate import main
    from bpd_train.evaluation.runner import EvalSettings

    with pytest.raises(EvalError) as api:
        Translator.from_pretrained("/nonexistent", device="cpu", **{name: value})
    with pytest.raises(EvalError) as ev:
        EvalSettings(**{name: value})
    with pytest.raises(EvalError) as cfg:
        DecodeSettings.from_config({name: value})
    err = io.StringIO()
    assert main(["--bundle", "/nonexistent", *flag], stdin=io.StringIO("x\n"), stdout=io.StringIO(), stderr=err) == 2
    line = str(api.value)
    assert line.startswith(f"{name}={value!r}: expected") and "\n" not in line
    assert str(ev.value) == str(cfg.value) == line
    assert err.getvalue() == f"error: {name}={str(value)!r}: expected{line.split(': expected', 1)[1]}\n"


def test_decode_options_are_derived_data_checked_once():
    """The engine's DecodeOptions take what a DecodeSettings resolved: no second check with its own messages."""
    from bpd_train.engine.packed import DecodeOptions

    assert DecodeOptions(lookup=-1).lookup == -1  # not checked here: DecodeSettings(lookup=-1) is the check
    opts = decode_options(DecodeSettings(tree="0;1", lookup=3), None, 2, "cpu")
    assert opts.tree == ((0,), (1,)) and opts.lookup == 3
