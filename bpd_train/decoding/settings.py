"""A DecodeSettings (declared and checked in bpd_train/decode_settings.py) resolved against a loaded model: the
"auto" draft vocabulary and proposal precision for this tokenizer and device, and the engine's DecodeOptions built
from them -- derived data, never checked again. Translator, the translate command line and the evaluator all go
through decoding/serving.py `prepare`, which calls `decode_options` here."""

from __future__ import annotations

from bpd_train.decode_settings import (  # noqa: F401 - re-exported: the settings' public home for the decoders' callers
    AUTO,
    DEFAULT_MAX_LEN,
    METHODS,
    DecodeError,
    DecodeSettings,
    check_block_sizes,
    check_draft_top_tokens,
    check_proposal_dtype,
    default_block_sizes,
    is_auto,
)
from bpd_train.decoding.acceptance import AcceptanceRule, make_acceptance
from bpd_train.engine.fastlinear import int8_compute
from bpd_train.engine.packed import DecodeOptions
from bpd_train.engine.weights import PackedWeights

AUTO_DRAFT_MIN_VOCAB = 2048  # below this a draft vocabulary saves too little of the projection to matter


def parse_rule(name) -> AcceptanceRule:
    """A rule name from config or the command line (grammar: decode_settings.rule_spec) -> AcceptanceRule; a bad
    name is a DecodeError. Its report label is `.label`."""
    try:
        return make_acceptance(name)
    except ValueError as e:
        raise DecodeError(str(e)) from None


def _draft_size(n) -> int | None:
    """A draft_top_tokens value that is not "auto" -> a number of tokens, or None for the full vocabulary."""
    try:
        return check_draft_top_tokens(n)
    except ValueError as e:
        raise DecodeError(f"draft_top_tokens={n!r}: {e}") from None


def draft_vocabulary(sp, n, eos_id) -> tuple[int, ...] | None:
    """The ids heads 2..k may propose: the n most frequent tokens as the tokenizer ranks them, plus the stop id(s)
    `eos_id` (an int or several). n = "auto": a quarter of the vocabulary where it has at least
    AUTO_DRAFT_MIN_VOCAB tokens and the tokenizer ranks its tokens, else the full vocabulary.
    A sentencepiece model (ours, or a decoder-only model's trained from scratch): the n highest-scoring pieces (a
    unigram piece's score is its log-probability). A Hugging Face tokenizer (tokenizer.json, decoder-only models):
    the n lowest ids that are not special tokens, since a BPE vocabulary numbers its tokens in merge order, most
    frequent pairs first. None or 0: the full vocabulary."""
    if is_auto(n):
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
        raise DecodeError(
            f"draft_top_tokens: no token ranking for a {type(sp).__name__}; use decode.draft_top_tokens=null"
        )
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
    try:
        p = check_proposal_dtype(proposal_dtype)
    except ValueError as e:
        raise DecodeError(f"proposal_dtype={proposal_dtype!r}: {e}") from None
    if p == AUTO:
        if str(device).startswith("cpu") and str(dtype).lower() != "int8":
            return "int8" if int8_compute() else None
        return None
    return p


# dtype "auto" on a CPU with the int8 kernels, by the model's weight type (a GGUF file's: the type most of its
# matrices have): (dtype, why). Q4_0 / Q4_1 and Q8_0 follow the greedy speeds measured on a Q4_1 file
# (docs/results-real-amx.md), Q4_K the kernels' and the other sub-8-bit types a Q5_0 file's (docs/experiments.md
# 8.15); 16/32-bit files keep fp32, which holds them exactly. A type not listed, an hf: folder
# and a model of ours decode in AUTO_DTYPE_OTHER. docs/gguf.md shows this table to users.
AUTO_DTYPE: dict[str, tuple[str, str]] = {
    "Q4_0": ("q4", "the file's own Q4_0 blocks with 8-bit activations, as llama.cpp's CPU backend runs them: the "
                   "fastest greedy measured"),
    "Q4_1": ("q4", "the file's own Q4_1 blocks with 8-bit activations, as llama.cpp's CPU backend runs them: the "
                   "fastest greedy measured"),
    "Q4_K": ("q4", "the file's own Q4_K blocks (4-bit codes, 6-bit scales and offsets per 32) with 8-bit "
                   "activations, its other tensors in int8: over twice the fp32 kernels' speed on the same codes"),
    "Q8_0": ("int8", "the file's 8-bit weights re-scaled per row (a rounding beyond the file's), 8-bit "
                     "activations: int8's speed, well ahead of fp32's greedy"),
    **{t: ("int8", f"the file's {t} weights re-scaled per row to 8 bits (a rounding beyond the file's), 8-bit "
                   "activations: a quarter of fp32's bytes, about twice its greedy speed")
       for t in ("Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")},
    "F32": ("fp32", "the file's F32 weights exactly; no faster precision keeps them"),
    "F16": ("fp32", "the file's F16 weights exactly; no faster precision keeps them (bf16 rounds them)"),
    "BF16": ("fp32", "the file's BF16 weights exactly (the native kernels read them as bf16); bf16 would round the "
                     "activations too"),
}  # fmt: skip
AUTO_DTYPE_OTHER = ("fp32", "{what} exactly; no faster precision keeps them")


def auto_dtype(weight_type: str | None, device, int8_kernels: bool | None = None) -> tuple[str, str]:
    """dtype "auto" resolved: (dtype, why in a line) for a model whose weights are `weight_type` (a GGUF file's,
    e.g. "Q4_1"; None: an hf: folder or a model of ours) on `device`. AUTO_DTYPE on a CPU; fp32 on CUDA (as
    before auto) and where the CPU lacks the int8 kernels (int8 and q4 would not run as measured there).
    int8_kernels: None asks this CPU (engine/fastlinear.py int8_compute)."""
    if not str(device).startswith("cpu"):
        return "fp32", f"auto is fp32 on {device} (the 8- and 4-bit kernels are the CPU's)"
    dtype, why = AUTO_DTYPE.get(str(weight_type), AUTO_DTYPE_OTHER)
    what = f"the file's {weight_type} weights" if weight_type else "the weights of an hf: folder or a model of ours"
    if dtype in ("int8", "q4") and not (int8_compute() if int8_kernels is None else int8_kernels):
        return "fp32", (
            f"no int8 kernels here (the native AVX2 / AVX512-VNNI ones; BPD_INT8_COMPUTE=0 turns them off), so "
            f"{dtype} is not the fast path measured; fp32 keeps {what} exactly"
        )
    return dtype, why.format(what=what)


def resolve_dtype(settings: DecodeSettings, weight_type: str | None, device) -> tuple[DecodeSettings, str | None]:
    """`settings` with dtype "auto" resolved (auto_dtype) and the line that says which precision and why, e.g.
    "precision q4 (dtype auto): the file's own Q4_1 blocks ..."; (settings, None) where they give a dtype."""
    if settings.dtype != AUTO:
        return settings, None
    dtype, why = auto_dtype(weight_type, device)
    return settings.replace(dtype=dtype), f"precision {dtype} (dtype auto): {why}"


def decode_options(settings: DecodeSettings, tokenizer, stop, device) -> DecodeOptions:
    """The engine's DecodeOptions for these (checked) settings: "auto" draft vocabulary and proposal precision
    resolved for this tokenizer (its ranking of tokens), stop ids and device; dtype "auto" as for a model of ours
    where the caller has not resolved it for the model's file (resolve_dtype)."""
    settings = resolve_dtype(settings, None, device)[0]
    return DecodeOptions(
        dtype=settings.dtype,
        draft_vocab=draft_vocabulary(tokenizer, settings.draft_top_tokens, stop),
        proposal_dtype=proposal_precision(settings.proposal_dtype, settings.dtype, device),
        lookup=settings.lookup,
        narrow=settings.narrow,
        tree=settings.tree,
    )


def packed_weights(model, options: DecodeOptions) -> PackedWeights:
    """A decoder's packed-weight cache for `options`, its step weights built for `model` now, so that an option this
    model or machine cannot run (e.g. bf16 for a decoder-only model on the torch path) is one DecodeError here
    rather than a traceback inside the first decoder call."""
    weights = PackedWeights(options)
    try:
        weights.get(model)
    except ValueError as e:
        raise DecodeError(str(e)) from None
    return weights


def max_len_arg(max_len):
    """A max_len as configs write it -> the decoders' MaxLen (finite), checked as the max_len setting is."""
    return DecodeSettings(max_len=max_len).max_len
