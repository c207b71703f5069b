"""Tokenizers of imported translation models, read from the files those models ship (no transformers needed).

  marian     Helsinki-NLP opus-mt: source.spm / target.spm + vocab.json. The model's ids come from vocab.json
             (piece -> id), not from the sentencepiece ids; a leading ">>xx<<" target-language code is one token.
  m2m100     facebook/m2m100_*: sentencepiece.bpe.model + vocab.json; language tokens "__xx__" follow the
             vocabulary (id = len(vocab.json) + index in the language list). Source: [src lang] pieces [eos].
  spm        this project's own models (exported as Pegasus): tokenizer.model, ids = sentencepiece ids.
  tokenizers NLLB-200 (and anything shipping tokenizer.json): the HF `tokenizers` file; language tokens are
             its tokens (e.g. "eng_Latn"). Source: [src lang] pieces [eos].
The target language of m2m100/tokenizers models is forced as the decoder's first token (bpd_train/sources/convert/hf/mt.py
makes it the model's bos_id, after the decoder-start prefix).

`HFTokenizer` gives what the evaluation/translate code needs: source_ids(text) (with the model's special
tokens), detok(ids) (special tokens dropped), and the sentencepiece-processor methods they call, so it can
stand in for one: encode(text or texts, out_type=int) = source ids without the final EOS (callers append
it), decode, get_piece_size, pad_id()/eos_id()/unk_id()/bos_id(), is_control/is_unknown/is_unused/get_score
(draft vocabularies rank tokens by their sentencepiece score). Model ids, not sentencepiece ids, throughout.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from bpd_train.io import outside, sha256_file

# transformers' M2M100Tokenizer FAIRSEQ_LANGUAGE_CODES (the order fixes the language token ids)
M2M100_LANGUAGE_CODES = {
    "m2m100": [
        "af", "am", "ar", "ast", "az", "ba", "be", "bg", "bn", "br", "bs", "ca", "ceb", "cs", "cy", "da", "de",
        "el", "en", "es", "et", "fa", "ff", "fi", "fr", "fy", "ga", "gd", "gl", "gu", "ha", "he", "hi", "hr",
        "ht", "hu", "hy", "id", "ig", "ilo", "is", "it", "ja", "jv", "ka", "kk", "km", "kn", "ko", "lb", "lg",
        "ln", "lo", "lt", "lv", "mg", "mk", "ml", "mn", "mr", "ms", "my", "ne", "nl", "no", "ns", "oc", "or",
        "pa", "pl", "ps", "pt", "ro", "ru", "sd", "si", "sk", "sl", "so", "sq", "sr", "ss", "su", "sv", "sw",
        "ta", "th", "tl", "tn", "tr", "uk", "ur", "uz", "vi", "wo", "xh", "yi", "yo", "zh", "zu"
    ],
    "wmt21": ["en", "ha", "is", "ja", "cs", "ru", "zh", "de"],
}
KINDS = ("marian", "m2m100", "tokenizers", "spm")


class TokenizerError(ValueError):
    """Missing or inconsistent tokenizer files of an imported model (one line, for the user)."""


def inside(folder: Path, name: str) -> Path:
    """folder/name, refused when a link (or the name) leads outside the folder: a model's tokenizer files are
    read, hashed and copied into bundles, so nothing outside what the user pointed at may be among them."""
    why = outside(folder, name)
    if why is not None:
        raise TokenizerError(f"refusing to read outside the model folder: {why}")
    return Path(folder) / name


def read_tokenizer_json(path: Path) -> dict:
    path = inside(path.parent, path.name)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"cannot read {path}: {e}") from None


def _need(folder: Path, *names: str) -> list[Path]:
    missing = [n for n in names if not (folder / n).is_file()]
    if missing:
        raise TokenizerError(f"{folder} lacks the tokenizer file(s) {', '.join(missing)}")
    return [inside(folder, n) for n in names]


def _vocab(path: Path) -> dict[str, int]:
    """vocab.json: piece -> model id, every id a non-negative integer (a string, float or negative id would
    surface as an IndexError mid-translation)."""
    vocab = read_tokenizer_json(path)
    if not isinstance(vocab, dict) or not vocab:
        raise TokenizerError(f"{path} is not a piece -> id mapping")
    bad = next(((k, v) for k, v in vocab.items() if type(v) is not int or v < 0), None)
    if bad is not None:
        raise TokenizerError(f"{path}: {bad[0]!r} maps to {bad[1]!r}, not a token id (a non-negative integer)")
    return vocab


def _spm(path: Path):
    import sentencepiece as spm
    try:
        return spm.SentencePieceProcessor(model_file=str(path))
    except Exception as e:  # sentencepiece raises RuntimeError/OSError with multi-line text
        raise TokenizerError(f"{path} is not a sentencepiece model ({str(e).strip().splitlines()[-1]})") from None


def detect_kind(folder: str | Path) -> str:
    """Which tokenizer files a model folder ships (see the module docstring)."""
    folder = Path(folder)
    cfg = read_tokenizer_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").is_file() else {}
    cls = str(cfg.get("tokenizer_class", ""))
    if cls.startswith("Marian") or (folder / "source.spm").is_file():
        return "marian"
    if cls.startswith("M2M100") or ((folder / "sentencepiece.bpe.model").is_file() and (folder / "vocab.json").is_file()
                                    and not (folder / "tokenizer.json").is_file()):
        return "m2m100"
    if (folder / "tokenizer.json").is_file():
        return "tokenizers"
    if (folder / "tokenizer.model").is_file():
        return "spm"
    raise TokenizerError(f"{folder} has no tokenizer files this project reads: Marian (source.spm, target.spm, "
                         "vocab.json), M2M100 (sentencepiece.bpe.model, vocab.json), NLLB (tokenizer.json) or "
                         "bpd-train's own (tokenizer.model)")


def tokenizer_files(folder: str | Path, kind: str | None = None) -> list[str]:
    """Names of the files a model folder's tokenizer consists of (what bundles and run folders copy, and what
    its hash covers: never the weights beside them)."""
    folder = Path(folder)
    kind = kind or detect_kind(folder)
    cfg = folder / "tokenizer_config.json"
    separate = kind == "marian" and cfg.is_file() and bool(read_tokenizer_json(cfg).get("separate_vocabs", False))
    names = {"marian": ["source.spm", "target.spm", "vocab.json"] + (["target_vocab.json"] if separate else []),
             "m2m100": ["sentencepiece.bpe.model", "vocab.json"],
             "tokenizers": ["tokenizer.json"], "spm": ["tokenizer.model"]}[kind]
    if cfg.is_file():
        names.append("tokenizer_config.json")
    if kind == "tokenizers" and (folder / "chat_template.jinja").is_file():  # a decoder-only model's chat template
        names.append("chat_template.jinja")
    for name in names:
        inside(folder, name)
    return names


def tokenizer_folder_hash(folder: str | Path) -> str:
    """sha256 over the tokenizer files' names and hashes: the same for the model's folder, a run folder's or a
    bundle's copy."""
    import hashlib

    folder = Path(folder)
    h = hashlib.sha256()
    for name in sorted(tokenizer_files(folder)):
        if not (folder / name).is_file():
            raise TokenizerError(f"{folder} lacks the tokenizer file {name}")
        h.update(f"{name}\0{sha256_file(folder / name)}\n".encode())
    return h.hexdigest()


class HFTokenizer:
    """Source ids and detokenized target text of an imported model (see the module docstring)."""

    def __init__(self, folder: str | Path, src_lang: str | None = None, tgt_lang: str | None = None,
                 kind: str | None = None):
        self.folder = Path(folder)
        self.kind = kind or detect_kind(self.folder)
        if self.kind not in KINDS:
            raise TokenizerError(f"unknown tokenizer kind {self.kind!r}; known: {', '.join(KINDS)}")
        self.src_lang, self.tgt_lang = src_lang, tgt_lang
        cfg_path = self.folder / "tokenizer_config.json"
        self.tok_config = read_tokenizer_json(cfg_path) if cfg_path.is_file() else {}
        self.src_lang = src_lang or self.tok_config.get("src_lang")
        self.tgt_lang = tgt_lang or self.tok_config.get("tgt_lang")
        getattr(self, f"_init_{self.kind}")()
        langs = self.kind in ("m2m100", "tokenizers")
        self.src_prefix = [self.lang_id(self.src_lang)] if langs and self.src_lang else []
        self.tgt_lang_id = self.lang_id(self.tgt_lang) if langs and self.tgt_lang else None
        self.truncated = 0
        self._scores: dict[int, float] | None = None

    # ---- the three formats ----
    def _init_marian(self) -> None:
        f = self.folder
        _need(f, "source.spm", "target.spm", "vocab.json")
        self.sp_source, self.sp_target = _spm(inside(f, "source.spm")), _spm(inside(f, "target.spm"))
        self.encoder = _vocab(f / "vocab.json")
        self.separate_vocabs = bool(self.tok_config.get("separate_vocabs", False))
        if self.separate_vocabs:
            _need(f, "target_vocab.json")
            self.target_encoder = _vocab(f / "target_vocab.json")
        else:
            self.target_encoder = self.encoder
        self.decoder = {int(v): k for k, v in self.target_encoder.items()}
        tc = self.tok_config
        eos, unk, pad = (str(tc.get(n, d)) for n, d in (("eos_token", "</s>"), ("unk_token", "<unk>"),
                                                        ("pad_token", "<pad>")))
        for name in (eos, unk, pad):
            if name not in self.encoder:
                raise TokenizerError(f"{f / 'vocab.json'} has no {name!r} token")
        self._eos, self._unk, self._pad = self.encoder[eos], self.encoder[unk], self.encoder[pad]
        self.special_ids = {self._eos, self._unk, self._pad}
        self.vocab_size = len(self.target_encoder)
        self.src_vocab_size = len(self.encoder)
        # transformers decodes with the source model unless the vocabularies are separate
        self.sp_detok = self.sp_target if self.separate_vocabs else self.sp_source

    def _init_m2m100(self) -> None:
        f = self.folder
        _need(f, "sentencepiece.bpe.model", "vocab.json")
        self.sp = _spm(inside(f, "sentencepiece.bpe.model"))
        self.encoder = _vocab(f / "vocab.json")
        codes = str(self.tok_config.get("language_codes", "m2m100"))
        if codes not in M2M100_LANGUAGE_CODES:
            raise TokenizerError(f"unknown M2M100 language_codes {codes!r} in {f / 'tokenizer_config.json'}; "
                                 f"known: {', '.join(M2M100_LANGUAGE_CODES)}")
        n = len(self.encoder)
        self.langs = {c: n + i for i, c in enumerate(M2M100_LANGUAGE_CODES[codes])}
        self.decoder = {int(v): k for k, v in self.encoder.items()}
        ids = {}
        for name, default in (("eos_token", "</s>"), ("unk_token", "<unk>"), ("pad_token", "<pad>"), ("bos_token", "<s>")):
            tok = str(self.tok_config.get(name, default))
            if tok not in self.encoder:
                raise TokenizerError(f"{f / 'vocab.json'} has no {tok!r} token")
            ids[name] = self.encoder[tok]
        self._eos, self._unk, self._pad, self._bos = (ids["eos_token"], ids["unk_token"], ids["pad_token"],
                                                               ids["bos_token"])
        self.special_ids = set(ids.values()) | set(self.langs.values())
        self.vocab_size = self.src_vocab_size = n + len(self.langs) + int(self.tok_config.get("num_madeup_words", 8))

    def _init_spm(self) -> None:
        self.sp = _spm(_need(self.folder, "tokenizer.model")[0])
        sp = self.sp
        self._eos, self._unk, self._pad = sp.eos_id(), sp.unk_id(), sp.pad_id()
        self.special_ids = {i for i in (sp.pad_id(), sp.bos_id(), sp.eos_id()) if i >= 0}
        self.vocab_size = self.src_vocab_size = sp.get_piece_size()

    def _init_tokenizers(self) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError("this model ships tokenizer.json, which needs the 'tokenizers' package "
                                 "(pip install 'bpd-train[hf]')") from None
        path = _need(self.folder, "tokenizer.json")[0]
        try:
            self.tk = Tokenizer.from_file(str(path))
        except Exception as e:
            raise TokenizerError(f"{path} is not a tokenizers file ({str(e).strip().splitlines()[-1]})") from None
        tc = self.tok_config
        ids = {}
        for name, default in (("eos_token", "</s>"), ("unk_token", "<unk>"), ("pad_token", "<pad>")):
            tok = tc.get(name, default)
            tok = tok.get("content", default) if isinstance(tok, dict) else str(tok)
            i = self.tk.token_to_id(tok)
            if i is None:
                raise TokenizerError(f"{path} has no {tok!r} token")
            ids[name] = i
        self._eos, self._unk, self._pad = ids["eos_token"], ids["unk_token"], ids["pad_token"]
        self.special_ids = set(ids.values())
        self.vocab_size = self.src_vocab_size = self.tk.get_vocab_size(with_added_tokens=True)

    # ---- ids ----
    def lang_id(self, lang: str) -> int:
        """Id of a language code ("de" for M2M100, "deu_Latn" for NLLB)."""
        if self.kind == "m2m100":
            got = self.langs.get(lang[2:-2] if lang.startswith("__") and lang.endswith("__") else lang)
        elif self.kind == "tokenizers":
            got = self.tk.token_to_id(lang)
        else:
            got = None
        if got is None:
            known = sorted(self.langs)[:8] if self.kind == "m2m100" else []
            raise TokenizerError(f"language {lang!r} is not a language token of {self.folder}"
                                 + (f" (e.g. {', '.join(known)})" if known else ""))
        return int(got)

    def pieces_ids(self, text: str) -> list[int]:
        """The text's ids without the special tokens around it."""
        if self.kind == "marian":
            code = []
            if text.startswith(">>") and (end := text.find("<<")) != -1:  # target-language code of multi-target models
                code, text = [text[:end + 2]], text[end + 2:]
            unk = self._unk
            return [self.encoder.get(p, unk) for p in code + self.sp_source.encode(text, out_type=str)]
        if self.kind == "m2m100":
            unk = self._unk
            return [self.encoder.get(p, unk) for p in self.sp.encode(text, out_type=str)]
        if self.kind == "spm":
            return list(self.sp.encode(text, out_type=int))
        return list(self.tk.encode(text, add_special_tokens=False).ids)

    def source_ids(self, text: str, max_positions: int | None = None) -> list[int]:
        """Encoder input as the model was trained on it: [src lang] pieces [eos]."""
        ids = self.pieces_ids(text)
        room = None if max_positions is None else max_positions - 1 - len(self.src_prefix)
        if room is not None and len(ids) > room:
            ids = ids[:max(room, 0)]
            self.truncated += 1
        return self.src_prefix + ids + [self._eos]

    encode_source = source_ids

    def target_ids(self, text: str) -> list[int]:
        """A reference translation's ids as the decoder is trained on them, without specials (the model adds
        BOS / the target language and EOS): Marian encodes targets with target.spm (transformers' text_target)."""
        if self.kind == "marian":
            unk = self._unk
            return [self.target_encoder.get(p, unk) for p in self.sp_target.encode(text, out_type=str)]
        return self.pieces_ids(text)

    def detok(self, ids: Sequence[int]) -> str:
        """Target ids -> text, special tokens (eos, pad, unk, language codes) dropped."""
        ids = [int(i) for i in ids if int(i) not in self.special_ids]
        if self.kind == "tokenizers":
            return self.tk.decode(ids, skip_special_tokens=True)
        if self.kind == "marian":
            return self.sp_detok.decode_pieces([self.decoder.get(i, self.sp_detok.id_to_piece(i)) for i in ids])
        if self.kind == "spm":
            return self.sp.decode(ids)
        return self.sp.decode([self.decoder[i] for i in ids if i in self.decoder])

    decode_target = detok

    # ---- the sentencepiece-processor methods callers use ----
    def encode(self, text, out_type=int):
        """source_ids without the final EOS (callers that follow sentencepiece append it themselves); a list
        of texts gives a list of id lists."""
        if out_type is not int:
            raise TypeError("HFTokenizer.encode only returns ids (out_type=int)")
        if isinstance(text, (list, tuple)):
            return [self.source_ids(t)[:-1] for t in text]
        return self.source_ids(text)[:-1]

    def decode(self, ids: Sequence[int]) -> str:
        return self.detok(ids)

    def get_piece_size(self) -> int:
        return self.vocab_size

    def pad_id(self) -> int:
        return self._pad

    def eos_id(self) -> int:
        return self._eos

    def unk_id(self) -> int:
        return self._unk

    def bos_id(self) -> int:
        """The forced target-language token (M2M100/NLLB), else -1 like a sentencepiece model without BOS. The
        decoder's start token is the model's (config.bos_id / decoder_prefix), not the tokenizer's."""
        return self.tgt_lang_id if self.tgt_lang_id is not None else -1

    def is_control(self, i: int) -> bool:
        return int(i) in self.special_ids and int(i) != self._unk

    def is_unknown(self, i: int) -> bool:
        return int(i) == self._unk

    def is_unused(self, i: int) -> bool:
        return False

    def get_score(self, i: int) -> float:
        """The piece's sentencepiece score (a unigram model's log-probability; 0 where there is none)."""
        if self._scores is None:
            self._scores = self._piece_scores()
        return self._scores.get(int(i), float("-inf"))

    def _piece_scores(self) -> dict[int, float]:
        if self.kind == "spm":
            return {i: self.sp.get_score(i) for i in range(self.sp.get_piece_size())}
        if self.kind in ("marian", "m2m100"):
            sp = self.sp_target if self.kind == "marian" else self.sp
            out = {}
            for i, piece in self.decoder.items():
                j = sp.piece_to_id(piece)
                out[i] = sp.get_score(j) if j != sp.unk_id() or piece == sp.id_to_piece(j) else 0.0
            return out
        model = read_tokenizer_json(self.folder / "tokenizer.json").get("model", {})
        if model.get("type") == "Unigram":
            return {i: float(score) for i, (_, score) in enumerate(model.get("vocab", []))}
        return {i: 0.0 for i in range(self.vocab_size)}

    # ---- bundles ----
    def files(self) -> list[str]:
        """The files an exported bundle must carry for this tokenizer to load again."""
        return tokenizer_files(self.folder, self.kind)

    def meta(self) -> dict:
        return {"kind": self.kind, "src_lang": self.src_lang, "tgt_lang": self.tgt_lang,
                "files": self.files(), "vocab_size": self.vocab_size}

    def check_model(self, vocab_size: int, src_vocab_size: int | None = None) -> None:
        """One line when the tokenizer's ids cannot belong to a model with this vocabulary."""
        src_vocab_size = vocab_size if src_vocab_size is None else src_vocab_size
        if self.kind in ("marian", "spm"):
            if (self.vocab_size, self.src_vocab_size) != (vocab_size, src_vocab_size):
                raise TokenizerError(
                    f"tokenizer in {self.folder} has {self.src_vocab_size}/{self.vocab_size} source/target tokens "
                    f"but the checkpoint has {src_vocab_size}/{vocab_size}: the files belong to different models")
            if self.kind == "marian":  # as many entries as the model has rows is not enough: every id must be a row
                for name, enc, n in (("vocab.json", self.encoder, src_vocab_size),
                                     ("target_vocab.json" if self.separate_vocabs else "vocab.json",
                                      self.target_encoder, vocab_size)):
                    top = max(enc.values())
                    if top >= n:
                        raise TokenizerError(f"{self.folder / name} maps a piece to id {top}, but the checkpoint "
                                             f"has {n} tokens: the file was edited or belongs to another model")
            return
        if self.kind == "m2m100":
            top = max(max(self.langs.values()), max(self.encoder.values())) + 1
        else:  # added tokens may sit above the counted vocabulary
            top = max(self.vocab_size, max(self.tk.get_vocab(with_added_tokens=True).values(), default=-1) + 1)
        if top > min(vocab_size, src_vocab_size):
            raise TokenizerError(f"tokenizer in {self.folder} uses ids up to {top - 1} but the checkpoint's vocabulary "
                                 f"has {min(vocab_size, src_vocab_size)} tokens: the files belong to different models")


class ModelTokenizer:
    """An imported model's tokenizer with the API the data pipeline uses for this project's sentencepiece
    `Tokenizer` (bpd_train/data/tokenizer.py): `path`, `hash`, `vocab_size`, the special ids as ints (the
    model's: the BOS that starts a training target is the model's decoder start / target language), `encode`,
    `encode_batch` (source ids without EOS), `encode_target_batch` (target ids without specials), `decode`.
    Picklable by what it was made from, so datasets' cache keys stay stable."""

    def __init__(self, folder: str | Path, *, vocab_size: int, pad_id: int, bos_id: int, eos_id: int, unk_id: int,
                 src_lang: str | None = None, tgt_lang: str | None = None, hash: str | None = None):
        self.path = Path(folder)
        self.tok = HFTokenizer(self.path, src_lang=src_lang, tgt_lang=tgt_lang)
        self.hash = hash or tokenizer_folder_hash(self.path)
        self.vocab_size = int(vocab_size)
        self.pad_id, self.bos_id, self.eos_id, self.unk_id = int(pad_id), int(bos_id), int(eos_id), int(unk_id)
        self.meta = self.tok.meta()

    @classmethod
    def for_model(cls, hf: HFTokenizer, config, hash: str | None = None) -> "ModelTokenizer":
        return cls(hf.folder, vocab_size=config.vocab_size, pad_id=config.pad_id, bos_id=config.bos_id,
                   eos_id=config.eos_id, unk_id=config.unk_id, src_lang=hf.src_lang, tgt_lang=hf.tgt_lang, hash=hash)

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tok.encode(t) for t in texts]

    def encode_target_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tok.target_ids(t) for t in texts]

    def decode(self, ids) -> str:
        return self.tok.detok(ids)

    def __getstate__(self) -> dict:
        return {"folder": str(self.path), "hash": self.hash, "vocab_size": self.vocab_size, "pad_id": self.pad_id,
                "bos_id": self.bos_id, "eos_id": self.eos_id, "unk_id": self.unk_id,
                "src_lang": self.tok.src_lang, "tgt_lang": self.tok.tgt_lang}

    def __setstate__(self, state: dict) -> None:
        folder, want = state.pop("folder"), state["hash"]
        self.__init__(folder, **{**state, "hash": None})
        if self.hash != want:
            raise TokenizerError(f"{self.path} changed since it was loaded (sha256 {self.hash} != {want})")

    def __repr__(self) -> str:
        return f"ModelTokenizer({str(self.path)!r}, {self.tok.kind}, vocab_size={self.vocab_size}, " \
               f"sha256={self.hash[:12]})"
