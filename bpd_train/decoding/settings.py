"""How a model is decoded, written once: `DecodeSettings` (validated when built) and what it resolves to on a
loaded model (block size, DecodeOptions, adaptive feeding). Translator, the translate command line and the
evaluator all build one; decoding/serving.py runs it over texts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Sequence

from bpd_train.decoding.acceptance import AcceptanceRule, Exact, make_acceptance
from bpd_train.decoding.common import DEFAULT_MAX_LEN, MaxLen, parse_max_len
from bpd_train.engine.fastlinear import DTYPES, check_dtype, int8_compute
from bpd_train.engine.packed import DecodeOptions, parse_tree

METHODS = ("blockwise", "greedy")
AUTO = "auto"
AUTO_DRAFT_MIN_VOCAB = 2048  # below this a draft vocabulary saves too little of the projection to matter


class DecodeError(ValueError):
    """Decode settings or inputs that cannot work (an unknown rule, a block size above the model's k, a prompt
    that does not fit, ...): one line that names what to change."""


def _bad(name: str, value: Any, expected: str) -> DecodeError:
    return DecodeError(f"{name}={value!r}: expected {expected}")


def _is_auto(v) -> bool:
    return isinstance(v, str) and v.strip().lower() == AUTO


def _is_none(v) -> bool:
    return v is None or (isinstance(v, str) and v.strip().lower() in ("", "null", "none", "full", "0")) or v == 0


def parse_rule(name) -> AcceptanceRule:
    """A rule name from config or the command line (grammar: decoding/acceptance.py) -> AcceptanceRule; a bad
    name is a DecodeError. Its report label is `.label`."""
    if isinstance(name, AcceptanceRule):
        return name
    try:
        return make_acceptance(str(name))
    except ValueError as e:
        raise DecodeError(str(e)) from None


def max_len_arg(max_len) -> MaxLen:
    """Config -> decoder MaxLen (decoding.parse_max_len), finite; a bad value is a DecodeError."""
    try:
        m = parse_max_len(max_len)
    except ValueError as e:
        raise DecodeError(str(e)) from None
    if not isinstance(m, int) and not all(math.isfinite(v) for v in m):
        raise DecodeError(f"max_len [a, b] takes finite numbers (at most a * source_len + b tokens), got {max_len!r}")
    return m


def default_block_sizes(k: int) -> list[int]:
    """The model's k and every smaller even k (k = 8 -> [8, 6, 4, 2]); [] for a plain model (k = 1)."""
    if k <= 1:
        return []
    return sorted({k, *range(2, k, 2)}, reverse=True)


def check_block_sizes(sizes: Sequence[int] | None, k: int, where: str) -> list[int]:
    """Block sizes to evaluate for a model with k heads. A plain model (k = 1) only has greedy decoding, whatever
    is asked (it is the reference column when base and heads runs are evaluated together)."""
    if sizes is None or k <= 1:
        return default_block_sizes(k)
    out = []
    for s in sizes:
        s = int(s)
        if s < 1:
            raise DecodeError(f"block size must be >= 1, got {s}")
        if s > k:
            raise DecodeError(f"block size {s} is above the k = {k} heads of {where}: use block sizes <= {k}")
        if s > 1 and s not in out:
            out.append(s)
    return out


def _draft_size(n) -> int | None:
    """A draft_vocab value that is not "auto" -> a number of tokens, or None for the full vocabulary."""
    if _is_none(n):
        return None
    try:
        n = int(n)
    except (TypeError, ValueError):
        raise DecodeError(f"draft_vocab must be a number of tokens, auto or null, got {n!r}") from None
    if n < 1:
        raise DecodeError(f"draft_vocab must be a positive number of tokens (or null for all), got {n}")
    return n


def _proposal_dtype(value) -> str | None:
    """A proposal_dtype value as written (auto, none or a decode dtype) -> "auto", None or the dtype."""
    if _is_auto(value):
        return AUTO
    if _is_none(value):
        return None
    try:
        return check_dtype(value)
    except ValueError:
        raise _bad("proposal_dtype", value, f"one of {', '.join(DTYPES)}, auto or none") from None


def draft_vocabulary(sp, n, eos_id) -> tuple[int, ...] | None:
    """The ids heads 2..k may propose: the n most frequent tokens as the tokenizer ranks them, plus the stop id(s)
    `eos_id` (an int or several). n = "auto": a quarter of the vocabulary where it has at least
    AUTO_DRAFT_MIN_VOCAB tokens and the tokenizer ranks its tokens, else the full vocabulary.
    A sentencepiece model (ours, or a decoder-only model's trained from scratch): the n highest-scoring pieces (a
    unigram piece's score is its log-probability). A Hugging Face tokenizer (tokenizer.json, decoder-only models):
    the n lowest ids that are not special tokens, since a BPE vocabulary numbers its tokens in merge order, most
    frequent pairs first. None or 0: the full vocabulary."""
    if _is_auto(n):
        size = _vocab_size(sp)
        if size is None or size < AUTO_DRAFT_MIN_VOCAB:
            return None
        try:
            return draft_vocabulary(sp, size // 4, eos_id)
        except DecodeError:  # no token ranking (e.g. an imported tokenizer): proposals over the full vocabulary
            return None
    n = _draft_size(n)
    if n is None:
        return None
    stops = {int(eos_id)} if isinstance(eos_id, int) else {int(i) for i in eos_id}
    proc = getattr(sp, "sp", sp)  # SpmLMTokenizer -> Tokenizer -> SentencePieceProcessor
    proc = getattr(proc, "sp", proc)
    if hasattr(proc, "get_score"):
        size = proc.get_piece_size()
        if n >= size:
            return None
        ids = [i for i in range(size) if not (proc.is_control(i) or proc.is_unknown(i) or proc.is_unused(i))]
        ids.sort(key=lambda i: -proc.get_score(i))
        return tuple(sorted(set(ids[:n]) | stops))
    tk = getattr(sp, "tk", None)  # data/lm/tokenizer.LMTokenizer: a tokenizers.Tokenizer
    if tk is None:
        raise DecodeError(f"draft_vocab: no token ranking for a {type(sp).__name__}; use decode.draft_vocab=null")
    size = int(sp.vocab_size)
    if n >= size:
        return None
    special = {int(i) for i, t in tk.get_added_tokens_decoder().items() if t.special}
    ids = [i for i in range(size) if i not in special][:n]
    return tuple(sorted(set(ids) | stops))


def _vocab_size(sp) -> int | None:
    proc = getattr(sp, "sp", sp)
    proc = getattr(proc, "sp", proc)
    if hasattr(proc, "get_piece_size"):
        return int(proc.get_piece_size())
    size = getattr(sp, "vocab_size", None)
    return int(size) if size is not None else None


def proposal_precision(proposal_dtype, dtype: str = "fp32", device="cpu") -> str | None:
    """The precision of heads 2..k and their projection (DecodeOptions.proposal_dtype): None = the decode dtype.
    "auto": int8 where the CPU's native kernels compute in int8 (VNNI or AVX2) and the decode dtype is wider --
    proposals only choose what head 1 verifies, so the output is unchanged and the proposal pass reads a quarter
    of the bytes; the decode dtype elsewhere (CUDA, the torch fallback, where int8 weights are only dequantised)."""
    p = _proposal_dtype(proposal_dtype)
    if p == AUTO:
        if str(device).startswith("cpu") and str(dtype).lower() != "int8":
            return "int8" if int8_compute() else None
        return None
    return p


def decode_options(
    sp,
    eos_id,
    dtype: str = "fp32",
    draft_vocab=AUTO,
    proposal_dtype=AUTO,
    device="cpu",
    lookup: int = 0,
    narrow: int = 0,
    tree=(),
) -> DecodeOptions:
    """DecodeOptions from config values (decode.dtype, decode.draft_vocab, decode.proposal_dtype); "auto" (the
    default of every decoding entry point) is the cheapest proposals that keep the output: see draft_vocabulary and
    proposal_precision. Bad values are DecodeErrors."""
    try:
        return DecodeOptions(
            dtype=str(dtype),
            draft_vocab=draft_vocabulary(sp, draft_vocab, eos_id),
            proposal_dtype=proposal_precision(proposal_dtype, dtype, device),
            lookup=lookup,
            narrow=narrow,
            tree=tree,
        )
    except DecodeError:
        raise
    except ValueError as e:
        raise DecodeError(str(e)) from e


def set_decode_options(model, options: DecodeOptions) -> None:
    """model.decode_options = options, and build the decode-step weights now, so that an option this model or
    machine cannot run (e.g. bf16 for a decoder-only model on the torch path) is one DecodeError here rather than
    a traceback inside the first decoder call."""
    model.decode_options = options
    try:
        model.decode_weights()
    except ValueError as e:
        raise DecodeError(str(e)) from None


def _adaptive(value) -> bool | float | None:
    if isinstance(value, str):
        value = {"true": True, "false": False, "auto": None, "none": None, "null": None}.get(
            value.strip().lower(), value
        )
    if value is None or isinstance(value, bool):
        return value
    try:
        t = float(value)
    except (TypeError, ValueError):
        t = math.nan
    if not 0.0 < t < 1.0:
        raise _bad("adaptive", value, "true, false, None (auto) or a threshold in (0, 1)")
    return t


@dataclass(frozen=True)
class DecodeSettings:
    """Everything that decides how texts are decoded, checked when built (a bad value is one DecodeError naming the
    field, the value and what it may be). "auto" values resolve against the model, tokenizer and device."""

    method: str = "blockwise"  # blockwise | greedy
    accept: Any = "exact"  # acceptance rule: exact | top<N> | distance:<eps> (decoding/acceptance.py)
    block_size: int | None = None  # blockwise k, at most the model's (None: the model's k)
    max_len: Any = DEFAULT_MAX_LEN  # generated tokens: an int, or (a, b) = a * source_len + b
    dtype: str = "fp32"  # decode-step weights: fp32 | bf16 | int8
    draft_vocab: Any = AUTO  # heads 2..k propose among the N most frequent tokens; auto | N | None (all)
    proposal_dtype: Any = AUTO  # heads 2..k and their projection: auto | fp32 | bf16 | int8 | None (dtype)
    adaptive: Any = None  # feed only proposals whose heads pay: None (on with exact on the CPU) | bool
    #                                    | a threshold in (0, 1)
    batch_size: int = 32  # sentences per batch (grouped by length)
    lookup: int = 0  # decoder-only: also propose from the prompt and answer so far, matching the
    #                                    last N..1 tokens (prompt lookup; N in 1..8, 0: off); adaptive feeding off
    narrow: int = 0  # with lookup, one row: a step whose context repeats < 2 tokens feeds this many rows (0: all)
    tree: Any = ()  # decoder-only, one row: such a step feeds a candidate tree instead ("0;1": head 2's top two)
    rule: AcceptanceRule = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 - frozen dataclass
        if self.method not in METHODS:
            raise _bad("method", self.method, f"one of {', '.join(METHODS)}")
        try:
            set_("rule", parse_rule(self.accept))
        except DecodeError as e:
            raise DecodeError(f"accept={self.accept!r}: {e}") from None
        if isinstance(self.accept, AcceptanceRule):
            set_("accept", self.rule.label)
        b = self.block_size
        if b is not None:
            if isinstance(b, bool) or not isinstance(b, int) or b < 1:
                raise _bad("block_size", b, "an int >= 1 (at most the model's k), or None for the model's k")
        set_("max_len", max_len_arg(list(self.max_len) if isinstance(self.max_len, tuple) else self.max_len))
        try:
            set_("dtype", check_dtype(self.dtype))
        except ValueError:
            raise _bad("dtype", self.dtype, f"one of {', '.join(DTYPES)}") from None
        if not _is_auto(self.draft_vocab):
            set_("draft_vocab", _draft_size(self.draft_vocab))
        set_("proposal_dtype", _proposal_dtype(self.proposal_dtype))
        set_("adaptive", _adaptive(self.adaptive))
        n = self.batch_size
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise DecodeError(f"batch_size must be an int >= 1, got {n!r}")
        n = self.lookup
        if isinstance(n, bool) or not isinstance(n, int) or not 0 <= n <= 8:
            raise _bad("lookup", n, "an int in 0..8 (0: off)")
        n = self.narrow
        if isinstance(n, bool) or not isinstance(n, int) or n < 0 or n == 1:
            raise _bad("narrow", n, "0 (off) or an int >= 2 (rows of a step whose context repeats < 2 tokens)")
        try:
            set_("tree", parse_tree(self.tree))
        except ValueError as e:
            raise DecodeError(str(e)) from None

    @classmethod
    def names(cls) -> list[str]:
        """The settings' names: the keyword arguments Translator takes, and the translate command line's options."""
        return [f.name for f in fields(cls) if f.init]

    def replace(self, **changes) -> "DecodeSettings":
        return replace(self, **changes)

    # ---------------------------------------------------------------------- resolved against a model and device
    def k(self, model_k: int, where: str = "this model") -> int:
        """The blockwise block size for a model with `model_k` heads (checked: at most model_k)."""
        k = model_k if self.block_size is None else self.block_size
        if self.block_size is not None and self.method == "blockwise":
            check_block_sizes([k], model_k, where)
        return k

    def adaptive_on(self, device) -> bool | float:
        """Adaptive feeding: None (the default) turns it on where it cannot change the output and is measured --
        the exact rule on the CPU -- so a batch whose heads do not pay decodes at greedy's speed and heads that pay
        keep most of their speedup; True / False / a threshold are the caller's choice."""
        if self.adaptive is None:
            return isinstance(self.rule, Exact) and str(device).startswith("cpu")
        return self.adaptive

    def options(self, tokenizer, stop, device) -> DecodeOptions:
        """The model's DecodeOptions: "auto" draft vocabulary and proposal precision resolved for this tokenizer
        (its ranking of tokens), stop ids and device."""
        return decode_options(
            tokenizer,
            stop,
            self.dtype,
            self.draft_vocab,
            self.proposal_dtype,
            device,
            self.lookup,
            self.narrow,
            self.tree,
        )
