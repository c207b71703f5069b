"""The one BLEU/chrF scorer (sacrebleu) and the one-sentence-per-line form it scores: below every layer, so the
evaluator, the distilled-corpus manifest (the teacher's BLEU) and the decoders' output files share them."""

from __future__ import annotations

from typing import Sequence


def one_line(text: str) -> str:
    """Hypothesis/reference files hold one sentence per line: no line breaks inside, no surrounding spaces
    (the sacrebleu CLI strips them too), so the files score exactly like the in-memory lists."""
    return " ".join(str(text).splitlines()).strip()


def corpus_scores(hyps: Sequence[str], refs: Sequence[str]) -> dict:
    """BLEU and chrF on detokenized text (sacrebleu defaults: 13a tokenization, mixed case) + their signatures."""
    from sacrebleu.metrics import BLEU, CHRF

    if len(hyps) != len(refs):
        raise ValueError(f"{len(hyps)} hypotheses but {len(refs)} references")
    hyps = [one_line(h) for h in hyps]
    refs = [one_line(r) for r in refs]
    bleu, chrf = BLEU(), CHRF()
    b = bleu.corpus_score(hyps, [refs])
    c = chrf.corpus_score(hyps, [refs])
    return {
        "bleu": float(b.score),
        "chrf": float(c.score),
        "bleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "bleu_detail": str(b),
    }
