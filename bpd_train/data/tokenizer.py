"""One joint sentencepiece model per corpus, trained on the training split and cached by content hash.

Cache: `<artifacts_dir>/<data.name>/spm/<key>/spm.model` (+ `spm.vocab`, `settings.json`), where `<key>` hashes
the training texts (both sides) and every setting that changes the model. The folder appears in one rename
(`atomic_dir`), so a crash never leaves a half-written model and concurrent ranks agree on one file.
Special ids are fixed: pad=0, bos=1, eos=2, unk=3.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any, Iterator

import sentencepiece as spm

from bpd_train.io import atomic_dir, atomic_write_json, sha256_file

from .corpus import cfg_get

log = logging.getLogger(__name__)

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
_SPM_VERSION = "1"  # bump when the training recipe below changes
DEFAULTS = {"vocab_size": 8000, "model_type": "unigram", "character_coverage": 1.0,
            "input_sentence_size": 2_000_000, "byte_fallback": False, "seed": 0, "num_threads": 1}


class Tokenizer:
    """A loaded sentencepiece model plus where it came from (`path`, `hash` = sha256 of the file)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.hash = sha256_file(self.path)
        self.sp = spm.SentencePieceProcessor(model_file=str(self.path))
        got = (self.sp.pad_id(), self.sp.bos_id(), self.sp.eos_id(), self.sp.unk_id())
        if got != (PAD_ID, BOS_ID, EOS_ID, UNK_ID):
            raise ValueError(f"{self.path}: special ids pad/bos/eos/unk are {got}, expected (0, 1, 2, 3)")

    pad_id, bos_id, eos_id, unk_id = PAD_ID, BOS_ID, EOS_ID, UNK_ID
    meta = None  # the corpus's own tokenizer; an imported model's (data/hf_tokenizer.ModelTokenizer) describes itself

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str) -> list[int]:
        return self.sp.encode(text, out_type=int)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, out_type=int)

    def encode_target_batch(self, texts: list[str]) -> list[list[int]]:
        return self.sp.encode(texts, out_type=int)  # one joint model: targets are encoded like sources

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        return self.sp.decode([i for i in ids if i not in (PAD_ID, BOS_ID, EOS_ID)])

    # Pickled into datasets.map workers and hashed for its cache: the path and file hash say everything.
    def __getstate__(self) -> dict:
        return {"path": str(self.path), "hash": self.hash}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"])
        if self.hash != state["hash"]:
            raise ValueError(f"{self.path} changed since it was loaded (sha256 {self.hash} != {state['hash']})")

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, sha256={self.hash[:12]})"


def encode_source(tok: Tokenizer, text: str) -> list[int]:
    """Pieces + [eos]: what the encoder and all decoders take as a source row."""
    return tok.encode(text) + [tok.eos_id]


def spm_settings(data_cfg: Any) -> dict:
    spm_cfg = cfg_get(data_cfg, "spm") or {}
    out = {k: cfg_get(spm_cfg, k, v) for k, v in DEFAULTS.items()}
    out["vocab_size"] = int(out["vocab_size"])
    out["character_coverage"] = float(out["character_coverage"])
    if out["model_type"] not in ("unigram", "bpe", "char", "word"):
        raise ValueError(f"data.spm.model_type={out['model_type']!r}; expected unigram, bpe, char or word")
    return out


def _texts(train_split, src: str, tgt: str) -> Iterator[str]:
    for batch in train_split.select_columns(["translation"]).iter(batch_size=10_000):
        for tr in batch["translation"]:
            # one sentence per line for the trainer; a stray newline inside a text would split it
            yield tr[src].replace("\n", " ")
            yield tr[tgt].replace("\n", " ")


def tokenizer_key(train_split, src: str, tgt: str, settings: dict) -> str:
    """sha256 over the settings and the exact training texts, read from the Arrow buffers (millions of pairs
    hash in seconds). Per language: all string lengths, then all bytes, so Arrow chunking doesn't matter."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    h = hashlib.sha256(json.dumps({"v": _SPM_VERSION, "src": src, "tgt": tgt, **settings},
                                  sort_keys=True).encode())
    ds = train_split if getattr(train_split, "_indices", None) is None else train_split.flatten_indices()
    column = ds.data.column("translation")
    for lang in (src, tgt):
        h_len, h_data = hashlib.sha256(), hashlib.sha256()
        for chunk in column.chunks:
            arr = pc.struct_field(chunk, lang)
            if arr.null_count:
                raise ValueError(f"the training split has missing {lang!r} texts")
            arr = arr.cast(pa.large_string())
            offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64)[arr.offset: arr.offset + len(arr) + 1]
            if len(arr):
                h_len.update(np.diff(offsets).astype("<i8").tobytes())
                h_data.update(memoryview(arr.buffers()[2])[int(offsets[0]): int(offsets[-1])])
        h.update(h_len.digest() + h_data.digest())
    return h.hexdigest()[:16]


def _train(train_split, src: str, tgt: str, settings: dict, out_dir: Path) -> None:
    kwargs = dict(
        sentence_iterator=_texts(train_split, src, tgt),
        model_prefix=str(out_dir / "spm"),
        vocab_size=settings["vocab_size"],
        model_type=settings["model_type"],
        character_coverage=settings["character_coverage"],
        input_sentence_size=settings["input_sentence_size"],
        shuffle_input_sentence=True,
        byte_fallback=bool(settings["byte_fallback"]),
        pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID, unk_id=UNK_ID,
        pad_piece="<pad>", bos_piece="<s>", eos_piece="</s>", unk_piece="<unk>",
        num_threads=int(settings["num_threads"]),
        # small corpora: allow fewer pieces than asked instead of failing ("Vocabulary size too high")
        hard_vocab_limit=False,
        minloglevel=2,
    )
    if settings["model_type"] in ("unigram", "bpe"):
        kwargs["max_sentence_length"] = 16384
    spm.set_random_generator_seed(int(settings["seed"]))  # sentence sampling is reproducible
    try:
        spm.SentencePieceTrainer.train(**kwargs)
    except RuntimeError as e:
        msg = str(e)
        if "Vocabulary size" in msg and settings["model_type"] == "bpe":
            raise ValueError(f"sentencepiece (bpe) could not reach vocab_size={settings['vocab_size']} on this "
                             f"corpus: {msg}. Lower data.spm.vocab_size or use model_type=unigram") from e
        raise ValueError(f"sentencepiece training failed: {msg}") from e


def get_tokenizer(data_cfg: Any, artifacts_dir: str | os.PathLike, train_split) -> Tokenizer:
    """The joint tokenizer for this corpus: reused from the cache when the corpus and settings match."""
    src, tgt = str(cfg_get(data_cfg, "src_lang")), str(cfg_get(data_cfg, "tgt_lang"))
    settings = spm_settings(data_cfg)
    key = tokenizer_key(train_split, src, tgt, settings)
    folder = Path(artifacts_dir) / str(cfg_get(data_cfg, "name")) / "spm" / key
    model = folder / "spm.model"
    if model.is_file():
        log.info("tokenizer: reusing %s", model)
        return Tokenizer(model)
    log.info("tokenizer: training %s (%s, vocab %d) on %d pairs", model, settings["model_type"],
             settings["vocab_size"], len(train_split))
    try:
        with atomic_dir(folder) as tmp:
            _train(train_split, src, tgt, settings, tmp)
            atomic_write_json(tmp / "settings.json", {"key": key, "src_lang": src, "tgt_lang": tgt,
                                                      "train_pairs": len(train_split), **settings})
    except FileExistsError:
        if not model.is_file():  # another process made the folder but not the model: not ours to fix silently
            raise
        log.info("tokenizer: another process finished %s first; using it", model)
    return Tokenizer(model)
