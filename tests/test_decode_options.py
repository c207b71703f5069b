"""decode.draft_vocab / decode.proposal_dtype = auto (the default of evaluate, translate and Translator): the cheapest
proposals that keep the output, resolved per tokenizer and machine."""

from __future__ import annotations

import pytest

from bpd_train.decoding.settings import DecodeError as EvalError
from bpd_train.decoding.settings import decode_options, draft_vocabulary, proposal_precision
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
    with pytest.raises(EvalError, match="draft_vocab must be a number"):
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
    opts = decode_options(Ranked(4000), 2)  # every entry point's default
    assert len(opts.draft_vocab) == 1001 and opts.proposal_dtype == proposal_precision("auto", "fp32", "cpu")
    with pytest.raises(EvalError, match="dtype"):
        decode_options(Ranked(4000), 2, proposal_dtype="int4")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"method": "beam"}, "method='beam': expected one of blockwise, greedy"),
        ({"accept": "sometimes"}, "accept='sometimes': unknown acceptance rule 'sometimes': use exact, top<N>"),
        ({"dtype": "fp16"}, "dtype='fp16': expected one of fp32, bf16, int8"),
        ({"proposal_dtype": "fp8"}, "proposal_dtype='fp8': expected one of fp32, bf16, int8, q4, auto or none"),
        ({"draft_vocab": -3}, "draft_vocab must be a positive number of tokens (or null for all), got -3"),
        ({"draft_vocab": "many"}, "draft_vocab must be a number of tokens, auto or null, got 'many'"),
        ({"adaptive": 2}, "adaptive=2: expected true, false, None (auto) or a threshold in (0, 1)"),
        ({"block_size": 0}, "block_size=0: expected an int >= 1"),
        ({"batch_size": 0}, "batch_size must be an int >= 1, got 0"),
        ({"max_len": [1, float("inf")]}, "max_len [a, b] takes finite numbers"),
        ({"max_len": "long"}, "max_len must be an int or [a, b]"),
        ({"lookup": 9}, "lookup=9: expected an int in 0..8 (0: off)"),
        ({"narrow": 1}, "narrow=1: expected 0 (off) or an int >= 2"),
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

    s = DecodeSettings(dtype="INT8", draft_vocab="none", proposal_dtype="null", adaptive="false", max_len=[2, 3])
    assert (s.dtype, s.draft_vocab, s.proposal_dtype, s.adaptive, s.max_len) == ("int8", None, None, False, (2, 3))
    d = DecodeSettings()
    assert (d.draft_vocab, d.proposal_dtype, d.adaptive, d.max_len) == ("auto", "auto", None, DEFAULT_MAX_LEN)
    assert d.adaptive_on("cpu") is True and d.adaptive_on("cuda") is False
    assert (
        DecodeSettings(accept="top2").adaptive_on("cpu") is False and d.replace(adaptive=0.5).adaptive_on("cpu") == 0.5
    )
    opts = DecodeSettings(draft_vocab=None, proposal_dtype=None).options(Ranked(4000), 2, "cpu")
    assert opts.draft_vocab is None and opts.proposal_dtype is None
    opts = DecodeSettings(lookup=3, narrow=2).options(Ranked(4000), 2, "cpu")  # the options carry both
    assert (opts.lookup, opts.narrow) == (3, 2)
