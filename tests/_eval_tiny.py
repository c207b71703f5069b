"""Shared tiny fixtures for the evaluation/export/translate tests (no training needed): a sentencepiece model
trained on a few hundred lines of the bundled corpus and a small random BPDModel saved as a checkpoint.
Session-cached: building everything takes about a second."""

from __future__ import annotations

import gzip
import json
from functools import lru_cache
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
CORPUS = REPO / "data" / "bible-en-fr"


def read_pairs(split: str, n: int) -> list[tuple[str, str]]:
    out = []
    with gzip.open(CORPUS / f"{split}.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            t = json.loads(line)["translation"]
            out.append((t["en"], t["fr"]))
            if len(out) == n:
                break
    return out


def train_spm(out_dir: Path, vocab_size: int = 256, n_lines: int = 400, seed_text: str = "") -> Path:
    import sentencepiece as spm

    out_dir.mkdir(parents=True, exist_ok=True)
    text = out_dir / "train.txt"
    lines = [x for pair in read_pairs("train", n_lines) for x in pair]
    text.write_text(seed_text + "\n".join(lines) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(out_dir / "spm"),
        vocab_size=vocab_size,
        model_type="unigram",
        character_coverage=1.0,
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=3,
        num_threads=1,
        minloglevel=2,
        seed_sentencepiece_size=100000,
    )
    return out_dir / "spm.model"


def tiny_model(vocab_size: int, block_size: int = 4, seed: int = 0, d_model: int = 32):
    from bpd_train.model import BPDConfig, BPDModel

    torch.manual_seed(seed)
    cfg = BPDConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        n_heads=2,
        n_encoder_layers=1,
        n_decoder_layers=1,
        d_ff=64,
        dropout=0.0,
        max_positions=128,
        block_size=block_size,
    )
    model = BPDModel(cfg)
    with torch.no_grad():
        # An untrained model mostly repeats one token or stops at once. Make it talk: never pick pad/bos/eos
        # (outputs run to max_len) and sharpen the decoder so that the output varies with position and source.
        model.embed.weight[:3].zero_()
        for layer in model.decoder_layers:
            for p in layer.parameters():
                if p.dim() == 2:
                    p.mul_(3.0)
        if model.heads is not None:  # zero-initialised output layer: give the heads something of their own
            torch.nn.init.normal_(model.heads.fc2.weight, std=0.05)
    return model.eval()


@lru_cache(maxsize=None)
def build(root: str) -> dict:
    """{'tok': spm path, 'run': run folder with checkpoints/last.ckpt (k=4), 'base': run folder (k=1),
    'tok2': a different sentencepiece model}."""
    from bpd_train.sources.checkpoint import write_checkpoint

    root_p = Path(root)
    tok = train_spm(root_p / "_tok")
    tok2 = train_spm(root_p / "_tok2", vocab_size=260, n_lines=300)
    import sentencepiece as spm

    v = spm.SentencePieceProcessor(model_file=str(tok)).get_piece_size()
    model = tiny_model(v, block_size=4)
    run = root_p / "heads" / "frozen-k4"
    write_checkpoint(run / "checkpoints" / "last.ckpt", model, tok, regime="frozen")
    (run / "tokenizer.model").write_bytes(tok.read_bytes())
    base_model = tiny_model(v, block_size=1, seed=1)
    base = root_p / "base"
    write_checkpoint(base / "checkpoints" / "last.ckpt", base_model, tok, regime="base")
    (base / "tokenizer.model").write_bytes(tok.read_bytes())
    return {"tok": tok, "tok2": tok2, "run": run, "base": base, "ckpt": run / "checkpoints" / "last.ckpt", "vocab": v}


def tiny_artifacts(tmp_path_factory) -> Path:
    """A `paths.artifacts` folder whose bible_en_fr/ holds base/ and heads/frozen-k4/ (what train.py would make)."""
    return tmp_path_factory.getbasetemp() / "eval_tiny"


def build_tiny(tmp_path_factory) -> dict:
    return build(str(tiny_artifacts(tmp_path_factory) / "bible_en_fr"))
