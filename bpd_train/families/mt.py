"""The encoder-decoder translation family (the paper's model): BPDConfig / BPDModel.

config, model     bpd_train/model/mt/config.py BPDConfig, model/mt/model.py BPDModel (no `arch` in its configs)
decode steps      bpd_train/engine/mt.py DecodeWeights
data              bpd_train/data/mt/: source/target pairs of a translation corpus (data/corpus.py) encoded and
                  filtered (processing.py), batches of src, tgt_in, tgt_out (datamodule.py BPDDataModule); the
                  corpus's sentencepiece model (data/tokenizer.py) or an imported model's (data/hf_tokenizer.py)
text adapter      decoding/text.py SpmText: sentence -> pieces + EOS, padded with pad_id
transformers      convert/hf/mt.py: Marian, M2M100 / NLLB, Pegasus (for export); its HFFormat in convert/__init__
bundles           tokenizer.model, or an imported model's tokenizer/ folder (HFTokenizer with its languages)
distillation      beam search over the corpus's source sentences (distillation/job.py)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bpd_train.data.distilled import DistillError
from bpd_train.data.hf_tokenizer import HFTokenizer, ModelTokenizer
from bpd_train.decoding.settings import DecodeError
from bpd_train.decoding.text import SpmText
from bpd_train.families.base import ModelFamily, register
from bpd_train.model.layers import DecoderLayer, EncoderLayer
from bpd_train.model.mt.config import BPDConfig
from bpd_train.model.mt.model import BPDModel


class MTFamily(ModelFamily):
    name = "mt"
    arch = None
    title = "an encoder-decoder model"
    verb = "translated"
    prompted = False
    distill_kind = "translation"
    head_fields = ModelFamily.head_fields + ("head_chain",)  # heads 2..k chained on the token before their own

    def bundle_heads(self, config) -> dict:
        return {**super().bundle_heads(config), "chained": bool(config.head_chain)}

    # ------------------------------------------------------------------------------------------------ model
    config_class = BPDConfig
    model_class = BPDModel
    layer_classes = (EncoderLayer, DecoderLayer)

    def config_from_train_cfg(self, model_cfg: dict[str, Any], tokenizer: Any):
        return self.config_class(
            vocab_size=tokenizer.vocab_size,
            pad_id=tokenizer.pad_id,
            bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id,
            unk_id=tokenizer.unk_id,
            **{**model_cfg, "block_size": int(model_cfg["block_size"])},
        )

    def position_table_bytes(self, config) -> int:
        return int(config.max_positions) * int(config.d_model) * 4  # the [max_positions, d_model] sinusoid table

    # ------------------------------------------------------------------------------------------------ data
    def datamodule(self, cfg: Any, regime: Any, tokenizer: Any = None, max_positions: int | None = None):
        from bpd_train.data import BPDDataModule

        data = cfg.data
        return BPDDataModule(
            data,
            artifacts_dir=str(cfg.paths.artifacts),
            seed=int(cfg.seed),
            source=regime.source,
            gold_share=float(regime.gold_share),
            distilled_dir=regime.distilled_dir,
            max_tokens=int(data.max_tokens),
            num_workers=int(data.get("num_workers", 0) or 0),
            tokenizer=tokenizer,
        )

    def features(self, model, batch: dict):
        return model.features(model.encode(batch["src"]), batch["tgt_in"])

    def targets(self, batch: dict):
        return batch["tgt_out"]

    def batch_size(self, batch: dict) -> int:
        return batch["src"].size(0)

    def reference_rows(self, batch: dict, config):
        specials = {config.pad_id, config.eos_id, config.bos_id}
        src, tgt, idx = batch["src"], batch["tgt_out"], batch.get("idx")
        for r in range(src.shape[0]):
            yield (
                int(idx[r]) if idx is not None else None,
                [int(x) for x in src[r].tolist() if int(x) != config.pad_id],
                [int(x) for x in tgt[r].tolist() if int(x) not in specials],
            )

    # ------------------------------------------------------------------------------------------------ tokenizers
    def tokenizer(self, loaded):
        """sentencepiece, or an imported model's HFTokenizer (the same methods, the model's ids)."""
        if loaded.own_tokenizer:
            m = loaded.tokenizer_meta or {}
            return HFTokenizer(loaded.tokenizer_path, src_lang=m.get("src_lang"), tgt_lang=m.get("tgt_lang"))
        import sentencepiece as spm

        return spm.SentencePieceProcessor(model_file=str(loaded.tokenizer_path))

    def data_tokenizer(self, loaded):
        return ModelTokenizer.for_model(loaded.tokenizer(), loaded.config, hash=loaded.tokenizer_hash)

    def text_adapter(
        self,
        loaded,
        src_lang: str | None = None,
        tgt_lang: str | None = None,
        context_policy: str = "truncate_left",
        tokenizer: Any = None,
    ):
        cfg = loaded.config
        return SpmText(
            tokenizer if tokenizer is not None else loaded.tokenizer(), cfg.eos_id, cfg.pad_id, cfg.max_positions
        )

    def check_text_options(
        self, *, chat: bool = False, langs: bool = False, context_policy: bool = False, what: str = "this model"
    ) -> None:
        given = [f for f, on in (("--chat", chat), ("--langs", langs), ("--context-policy", context_policy)) if on]
        if given:
            raise DecodeError(f"{', '.join(given)}: only for decoder-only (LM) bundles; {what} is a translation model")

    # ------------------------------------------------------------------------------------------------ bundles
    def folder_tokenizer(self, folder: Path, config, meta: dict | None):
        meta = dict(meta or {})
        tok = HFTokenizer(folder, src_lang=meta.get("src_lang"), tgt_lang=meta.get("tgt_lang"))
        tok.check_model(config.vocab_size, config.source_vocab_size)
        return tok, {
            "vocab_size": config.vocab_size,
            "pad_id": config.pad_id,
            "bos_id": config.bos_id,
            "eos_id": config.eos_id,
            "unk_id": config.unk_id,
            "meta": tok.meta(),
        }

    def tokenizer_ids(self, tok, config):
        # its BOS is the model's decoder start (or target language), not a tokenizer piece
        have = {
            "vocab_size": config.vocab_size,
            "pad_id": tok.pad_id(),
            "bos_id": config.bos_id,
            "eos_id": tok.eos_id(),
        }
        want = {
            "vocab_size": config.vocab_size,
            "pad_id": config.pad_id,
            "bos_id": config.bos_id,
            "eos_id": config.eos_id,
        }
        return have, want

    # ------------------------------------------------------------------------------------------------ distillation
    def check_distill(self, beam_size: int, temperature: float) -> None:
        if temperature != 0:
            raise DistillError(
                f"distill.temperature={temperature}: sampling (> 0) is for decoder-only teachers; 0 = greedy"
            )

    def distill_records(self, cfg):
        from bpd_train.data.corpus import load_corpus

        return load_corpus(cfg.data)

    def check_teacher_ids(self, loaded) -> None:
        mc = loaded.config
        sp = loaded.tokenizer()
        n = sp.get_piece_size()
        if n != mc.vocab_size:
            raise DistillError(
                f"teacher {loaded.source} has a {mc.vocab_size}-symbol vocabulary but its tokenizer "
                f"{loaded.tokenizer_path} has {n} pieces: they do not belong together"
            )
        specials = {"pad": (sp.pad_id(), mc.pad_id), "bos": (sp.bos_id(), mc.bos_id), "eos": (sp.eos_id(), mc.eos_id)}
        bad = {k: v for k, v in specials.items() if v[0] != v[1]}
        if bad:
            raise DistillError(
                f"teacher {loaded.source} and its tokenizer disagree on special ids: "
                + ", ".join(f"{k} is {a} in the tokenizer, {b} in the model" for k, (a, b) in bad.items())
            )


MT = register(MTFamily())
