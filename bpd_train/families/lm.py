"""The decoder-only family (the Llama / Qwen2 architecture): LMConfig / LMModel, `arch: lm` in its configs.

config, model     bpd_train/model/lm/config.py LMConfig, model/lm/model.py LMModel
decode steps      bpd_train/engine/lm.py LMDecodeWeights
data              bpd_train/data/lm/: prompt/response or chat records (processing.py), or the translation corpus as
                  prompts; batches of tokens/targets (datamodule.py LMDataModule); tokenizer.json folders
                  (tokenizer.py) or the corpus's sentencepiece model behind SpmLMTokenizer
text adapter      decoding/text.py LMText: a prompt, a prompt-format translation or a chat -> ids
transformers      convert/hf/lm.py: Llama, Qwen2, Mistral (no sliding window); its HFFormat in convert/__init__
bundles           tokenizer.model, or the model's tokenizer/ folder (RunLMTokenizer); the heads' type recorded
distillation      the model answers the prompts itself, greedily or sampled (distillation/self_lm.py)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bpd_train.data.distilled import DistillError
from bpd_train.data.lm.processing import load_lm_jsonl
from bpd_train.data.lm.tokenizer import RunLMTokenizer
from bpd_train.decoding.text import LMText
from bpd_train.families.base import ModelFamily, register
from bpd_train.model.lm.config import LMConfig
from bpd_train.model.lm.model import Layer, LMModel


class LMFamily(ModelFamily):
    name = "lm"
    arch = "lm"
    title = "a decoder-only model"
    verb = "answered"
    prompted = True
    distill_kind = "lm"
    pad_is_token = False  # pad_id is LMConfig's sentinel (-1): batches pad with it, no tokenizer has it
    head_fields = ModelFamily.head_fields + ("heads", "medusa_layers")  # the head type: bpd | medusa

    # ------------------------------------------------------------------------------------------------ model
    config_class = LMConfig
    model_class = LMModel
    layer_classes = (Layer,)

    def config_from_train_cfg(self, model_cfg: dict[str, Any], tokenizer: Any):
        # pad_id stays LMConfig's sentinel (-1): padding is never a vocabulary id in this family
        return self.config_class(
            vocab_size=tokenizer.vocab_size,
            bos_id=tokenizer.bos_id,
            eos_id=tokenizer.eos_id,
            **{**model_cfg, "block_size": int(model_cfg["block_size"])},
        )

    # ------------------------------------------------------------------------------------------------ data
    def datamodule(self, cfg: Any, regime: Any, tokenizer: Any = None, max_positions: int | None = None):
        from bpd_train.data import LMDataModule

        data = cfg.data
        if max_positions is None:
            max_positions = int(cfg.model.get("max_positions", 2048))
        return LMDataModule(
            data,
            artifacts_dir=str(cfg.paths.artifacts),
            seed=int(cfg.seed),
            source=regime.source,
            distilled_dir=regime.distilled_dir,
            max_tokens=int(data.max_tokens),
            num_workers=int(data.get("num_workers", 0) or 0),
            tokenizer=tokenizer,
            max_positions=int(max_positions),
        )

    # batches of data/lm/records.collate_lm; the targets' ignore id is the config's pad sentinel (-1), so the
    # losses take cfg.pad_id for either family
    def features(self, model, batch: dict):
        return model.features(batch["tokens"])

    row_features = True  # causal: a row's states depend on its own tokens only, never on its right padding

    def feature_rows(self, batch: dict):
        return batch["tokens"]

    def targets(self, batch: dict):
        return batch["targets"]

    def batch_size(self, batch: dict) -> int:
        return batch["tokens"].size(0)

    def reference_rows(self, batch: dict, config):
        specials = {config.pad_id, config.eos_id, config.bos_id}  # the prompt's ids come as collate_lm kept them
        for p, t in zip(batch["prompts"], batch["targets"].tolist()):
            yield None, list(p), [int(x) for x in t if int(x) not in specials and x >= 0]

    # ------------------------------------------------------------------------------------------------ tokenizers
    def tokenizer(self, loaded):
        """The LMTokenizer interface (data/lm/processing.py, distillation/self_lm, the decoders): the model's own tokenizer.json
        folder, or the corpus's sentencepiece model it was trained from scratch with."""
        if loaded.own_tokenizer:
            return RunLMTokenizer(loaded.tokenizer_path, hash=loaded.tokenizer_hash)
        from bpd_train.data.lm.datamodule import SpmLMTokenizer
        from bpd_train.data.tokenizer import Tokenizer

        return SpmLMTokenizer(Tokenizer(loaded.tokenizer_path))

    def data_tokenizer(self, loaded):
        return self.tokenizer(loaded)

    def text_adapter(
        self,
        loaded,
        src_lang: str | None = None,
        tgt_lang: str | None = None,
        context_policy: str = "truncate_left",
        tokenizer: Any = None,
    ):
        tok = tokenizer if tokenizer is not None else self.tokenizer(loaded)
        return LMText(tok, src_lang, tgt_lang, loaded.config.max_positions, context_policy=context_policy)

    # ------------------------------------------------------------------------------------------------ bundles
    def bundle_heads(self, config) -> dict[str, Any]:
        return {**super().bundle_heads(config), "type": config.heads}

    def folder_tokenizer(self, folder: Path, config, meta: dict | None):
        tok = RunLMTokenizer(folder)
        tok.check_model(config.vocab_size)
        return tok, {
            "vocab_size": config.vocab_size,
            "pad_id": config.pad_id,
            "bos_id": config.bos_id,
            "eos_id": config.eos_id,
            "meta": tok.meta,
        }

    def tokenizer_ids(self, tok, config):
        # an import's EOS may be its generation_config's: the model's; its pad is a sentinel (-1), never a token
        ids = {"vocab_size": config.vocab_size, "bos_id": config.bos_id, "eos_id": config.eos_id}
        return ids, dict(ids)

    # ------------------------------------------------------------------------------------------------ export
    def medusa_draft_problem(self, config) -> str | None:
        if getattr(config, "heads", None) != "medusa" or config.block_size < 2:
            return f"heads={config.heads}, k={config.block_size}"
        return None

    # ------------------------------------------------------------------------------------------------ distillation
    def check_distill(self, beam_size: int, temperature: float) -> None:
        if int(beam_size) != 1:
            raise DistillError(
                f"a decoder-only teacher answers greedily (or samples with distill.temperature > 0): "
                f"set distill.beam_size=1 (got {beam_size})"
            )
        if temperature < 0:
            raise DistillError(
                f"distill.temperature={temperature}: sampling (> 0) is for decoder-only teachers; 0 = greedy"
            )

    def distill_length_penalty(self, length_penalty: float) -> float:
        return 0.0

    def distill_records(self, cfg):
        """The prompts of data.lm.files (prompt/response or chat records) when given, else the translation corpus's
        sentences as prompt-format translations."""
        from bpd_train.data.corpus import cfg_get, load_corpus

        files = cfg_get(cfg_get(cfg.data, "lm") or {}, "files")
        if files is None:
            return load_corpus(cfg.data)
        return load_lm_jsonl({k: v for k, v in dict(files).items() if v})

    def check_teacher_ids(self, loaded) -> None:
        pass  # its tokenizer is checked against the corpus's by hash (distillation/job.py _check_teacher)


LM = register(LMFamily())
