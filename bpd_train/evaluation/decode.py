"""Glue between texts and the decoders: acceptance-rule names, default block sizes, tokenizing sources."""
from __future__ import annotations

from typing import Sequence

from bpd_train.evaluation.metrics import pad_batch


class EvalError(ValueError):
    """Evaluation settings that cannot work (block size above the model's k, unknown rule, no sentences, ...)."""


def parse_rule(name):
    """A rule name from config or the command line (grammar: decoding/acceptance.py) -> AcceptanceRule; a bad
    name is an EvalError. Its report label is `.label`."""
    from bpd_train.decoding import make_acceptance

    try:
        return make_acceptance(str(name))
    except ValueError as e:
        raise EvalError(str(e)) from None


def serving_adaptive(adaptive, rule, device) -> bool | float:
    """Adaptive feeding for the serving paths (translate.py, Translator): None (their default) turns it on where
    it cannot change the output and is measured -- the exact rule on the CPU -- so a batch whose heads do not pay
    decodes at greedy's speed (plain k = 4 blockwise ran 0.55-0.81x greedy at batch 32 on the demo's heads) and heads
    that pay keep most of their speedup; True / False / a threshold are the caller's choice."""
    from bpd_train.decoding import Exact

    if adaptive is None:
        return isinstance(rule, Exact) and str(device).startswith("cpu")
    return adaptive


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
            raise EvalError(f"block size must be >= 1, got {s}")
        if s > k:
            raise EvalError(f"block size {s} is above the k = {k} heads of {where}: use block sizes <= {k}")
        if s > 1 and s not in out:
            out.append(s)
    return out


AUTO = "auto"
AUTO_DRAFT_MIN_VOCAB = 2048   # below this a draft vocabulary saves too little of the projection to matter


def _is_auto(v) -> bool:
    return isinstance(v, str) and v.strip().lower() == AUTO


def _is_none(v) -> bool:
    return v is None or (isinstance(v, str) and v.strip().lower() in ("", "null", "none", "full", "0")) or v == 0


def draft_vocabulary(sp, n, eos_id) -> tuple[int, ...] | None:
    """The ids heads 2..k may propose: the n most frequent tokens as the tokenizer ranks them, plus the stop id(s)
    `eos_id` (an int or several). n = "auto": a quarter of the vocabulary where it has at least
    AUTO_DRAFT_MIN_VOCAB tokens and the tokenizer ranks its tokens (the demo's 4000: 1000 tokens; exact self-k4
    0.97x -> 1.18x at batch 1 on an AMD EPYC, k-hat 2.81 -> 2.70), else the full vocabulary.
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
        except EvalError:  # no token ranking (e.g. an imported tokenizer): proposals over the full vocabulary
            return None
    if _is_none(n):
        return None
    try:
        n = int(n)
    except (TypeError, ValueError):
        raise EvalError(f"draft_vocab must be a number of tokens, auto or null, got {n!r}") from None
    if n < 1:
        raise EvalError(f"draft_vocab must be a positive number of tokens (or null for all), got {n}")
    stops = {int(eos_id)} if isinstance(eos_id, int) else {int(i) for i in eos_id}
    proc = getattr(sp, "sp", sp)          # SpmLMTokenizer -> Tokenizer -> SentencePieceProcessor
    proc = getattr(proc, "sp", proc)
    if hasattr(proc, "get_score"):
        size = proc.get_piece_size()
        if n >= size:
            return None
        ids = [i for i in range(size) if not (proc.is_control(i) or proc.is_unknown(i) or proc.is_unused(i))]
        ids.sort(key=lambda i: -proc.get_score(i))
        return tuple(sorted(set(ids[:n]) | stops))
    tk = getattr(sp, "tk", None)          # data/lm/tokenizer.LMTokenizer: a tokenizers.Tokenizer
    if tk is None:
        raise EvalError(f"draft_vocab: no token ranking for a {type(sp).__name__}; use decode.draft_vocab=null")
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
    of the bytes (exact self-k4 with a draft vocabulary: 1.18x -> 1.29x at batch 1 on an AMD EPYC, README); the
    decode dtype elsewhere (CUDA, the torch fallback, where int8 weights are only dequantised)."""
    if _is_auto(proposal_dtype):
        if str(device).startswith("cpu") and str(dtype).lower() != "int8":
            from bpd_train.engine.fastlinear import int8_compute
            return "int8" if int8_compute() else None
        return None
    return None if _is_none(proposal_dtype) else str(proposal_dtype)


def set_decode_options(model, options) -> None:
    """model.decode_options = options, and build the decode-step weights now, so that an option this model or
    machine cannot run (e.g. bf16 for a decoder-only model on the torch path) is one EvalError here rather than
    a traceback inside the first decoder call."""
    model.decode_options = options
    try:
        model.decode_weights()
    except ValueError as e:
        raise EvalError(str(e)) from None


def decode_options(sp, eos_id: int, dtype: str = "fp32", draft_vocab=AUTO, proposal_dtype=AUTO, device="cpu"):
    """DecodeOptions from config values (decode.dtype, decode.draft_vocab, decode.proposal_dtype); "auto" (the
    default of every decoding entry point) is the cheapest proposals that keep the output: see draft_vocabulary and
    proposal_precision. Bad values are EvalErrors."""
    from bpd_train.engine.packed import DecodeOptions
    try:
        return DecodeOptions(dtype=str(dtype), draft_vocab=draft_vocabulary(sp, draft_vocab, eos_id),
                             proposal_dtype=proposal_precision(proposal_dtype, dtype, device))
    except ValueError as e:
        raise EvalError(str(e)) from e


def max_len_arg(max_len):
    """Config -> decoder MaxLen (decoding.parse_max_len); a bad value is an EvalError."""
    from bpd_train.decoding import parse_max_len

    try:
        return parse_max_len(max_len)
    except ValueError as e:
        raise EvalError(str(e)) from None


class SpmText:
    """Source ids and detokenized output from a sentencepiece processor (what every checkpoint and bundle carries).
    Sources are the pieces followed by EOS, as bpd_train.data.encode_source makes them."""

    def __init__(self, sp, eos_id: int, pad_id: int, max_positions: int | None = None):
        self.sp, self.eos_id, self.pad_id, self.max_positions = sp, eos_id, pad_id, max_positions
        self.truncated = 0

    def source_ids(self, text: str) -> list[int]:
        ids = list(self.sp.encode(text, out_type=int))
        if self.max_positions is not None and len(ids) + 1 > self.max_positions:
            ids = ids[: self.max_positions - 1]
            self.truncated += 1
        return ids + [self.eos_id]

    def detok(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids])

    def batch(self, ids: Sequence[Sequence[int]], device=None):
        return pad_batch(ids, self.pad_id, device)


class LMText:
    """SpmText's interface for a decoder-only model. A source is a text or a chat:
      a text      its prompt-format translation prompt ("English: ...\nFrench:", data/lm/records.py) when languages
                  are given, else the prompt itself (prompt/response records, the generate CLI)
      a chat      a list of {"role", "content"} messages (evaluation on `messages` records; the CLI's --chat),
                  rendered with the tokenizer's chat template (a trailing assistant message is the reference, not
                  prompted); no template: an EvalError
    A prompt longer than the context (room for one generated token) keeps its newest tokens (after BOS), counted
    in `truncated`, or with context_policy="refuse" is an EvalError."""

    def __init__(self, tok, src_lang: str | None, tgt_lang: str | None, max_positions: int,
                 context_policy: str = "truncate_left"):
        from bpd_train.data.lm.records import CONTEXT_POLICIES

        if context_policy not in CONTEXT_POLICIES:
            raise EvalError(f"context policy must be one of {', '.join(CONTEXT_POLICIES)}, got {context_policy!r}")
        self.sp, self.src_lang, self.tgt_lang, self.max_positions = tok, src_lang, tgt_lang, max_positions
        self.context_policy = context_policy
        self.pad_id = -1
        self.truncated = 0

    def source_ids(self, source: str | Sequence[dict]) -> list[int]:
        from bpd_train.data.lm.records import LMDataError, prompt_of, translation_prompt

        if isinstance(source, str):
            prompt = translation_prompt(source, self.src_lang, self.tgt_lang) if self.src_lang and self.tgt_lang \
                else source
            ids = list(self.sp.encode(prompt))
        else:
            try:
                prompt, _ = prompt_of({"messages": list(source)}, self.sp, where="chat")
            except LMDataError as e:
                raise EvalError(str(e)) from None
            ids = list(self.sp.encode(prompt, add_special_tokens=False))  # the template wrote the specials
        room = self.max_positions - 1
        if len(ids) > room:
            if self.context_policy == "refuse":
                raise EvalError(f"a prompt of {len(ids)} tokens does not fit the context of {self.max_positions} "
                                "(with room for one generated token); shorten it or truncate it from the left "
                                "(context policy truncate_left)")
            keep = 1 if self.sp.bos_id is not None and ids[0] == self.sp.bos_id else 0
            ids = ids[:keep] + ids[len(ids) - room + keep:]
            self.truncated += 1
        return ids

    def detok(self, ids: Sequence[int]) -> str:
        return self.sp.decode([int(i) for i in ids]).strip()

    def batch(self, ids: Sequence[Sequence[int]], device=None):
        return pad_batch(ids, self.pad_id, device)
