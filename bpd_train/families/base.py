"""`ModelFamily`: everything the pipeline needs to know about one kind of model, in one object.

Training, distillation, evaluation, export, loading, bundles and translate ask a model's family instead of asking
which kind of model it is. Each family implements this class once, in its own module (`families/mt.py`: the
encoder-decoder translation model; `families/lm.py`: the decoder-only language model); docs/families.md says how to
add a third.

`family_of(x)` reads a config's `arch` key (with `bpd_train.model.config_arch`, the one reader): it takes a family
name, a saved config dict, a config dataclass, a Hydra node, a model or a LoadedModel and returns the family object.
A config without `arch` belongs to the encoder-decoder family (the configs and checkpoints written before there was
a second family).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Mapping

from bpd_train.model import config_arch


class ModelFamily(ABC):
    """One model family. Subclasses set the class attributes and implement the abstract methods; the methods with
    a body are what both families share. Imports of heavy modules (datasets, Lightning, tokenizers) stay inside the
    methods. A family reads model/ and data/; loading, convert and bundle read the families, never the reverse
    (each family's transformers adapter is its HFFormat in convert/__init__.py)."""

    name: str  # "mt" | "lm": how docs and messages name the family
    arch: str | None  # the `arch` its saved configs carry (None: they carry none)
    title: str  # what it is, for messages ("an encoder-decoder model")
    verb: str  # what decoding does to an input, for the CLI's summary line ("translated")
    prompted: bool  # decodes prompts (generate(), translate --chat/--langs) rather than sentences
    distill_kind: str  # the distilled-corpus manifest's `kind` its teachers write ("translation" | "lm")
    pad_is_token: bool = True  # its pad_id is a vocabulary id (not a sentinel that no tokenizer has)
    head_fields: tuple[str, ...] = ("block_size", "head_d_hidden", "identity_p1")  # what a head regime may set

    def __repr__(self) -> str:
        return f"<model family {self.name}>"

    # ------------------------------------------------------------------------------------------------ model
    @property
    @abstractmethod
    def config_class(self) -> type: ...

    @property
    @abstractmethod
    def model_class(self) -> type: ...

    def config_from_dict(self, d: Mapping[str, Any]):
        """A saved config dict -> this family's config dataclass."""
        return self.config_class.from_dict(dict(d))

    def build(self, config):
        """The (freshly initialised) model of a config of this family."""
        return self.model_class(config)

    @property
    @abstractmethod
    def layer_classes(self) -> tuple[type, ...]:
        """The model's transformer layers: one FSDP unit each (training/sharding.py)."""

    @abstractmethod
    def config_from_train_cfg(self, model_cfg: dict[str, Any], tokenizer: Any):
        """conf/model (plain dict, without vocab_size; its block_size is the model's k) + the run's tokenizer -> the
        config of a model trained from scratch (regime base)."""

    def position_table_bytes(self, config) -> int:
        """Memory a config allocates beyond its weights for positions (bundle.check_buildable bounds it)."""
        return 0

    # ------------------------------------------------------------------------------------------------ data
    @abstractmethod
    def datamodule(self, cfg: Any, regime: Any, tokenizer: Any = None, max_positions: int | None = None):
        """The LightningDataModule of a training run (cfg: the composed Hydra config)."""

    @abstractmethod
    def features(self, model, batch: dict) -> Any:
        """[B, T, d] the backbone's hidden states at every target position of a training batch."""

    # whether feature_rows names the ids that alone decide each row's hidden states (a frozen backbone's states
    # can then be cached per row: training/feature_cache.py)
    row_features = False

    def feature_rows(self, batch: dict) -> Any:
        """[B, T] those ids, right-padded with the config's pad_id (families with row_features)."""
        raise NotImplementedError(f"the {self.name} family has no per-row features")

    @abstractmethod
    def targets(self, batch: dict) -> Any:
        """[B, T] the next-token targets of a training batch (padding: the config's pad_id)."""

    @abstractmethod
    def batch_size(self, batch: dict) -> int:
        """Rows in a training batch."""

    @abstractmethod
    def reference_rows(self, batch: dict, config):
        """(key or None, source ids, reference ids) per row of a validation batch, specials and padding left out
        (in-training blockwise evaluation, evaluation/callback.py; None: keep the order rows come in)."""

    # ------------------------------------------------------------------------------------------------ tokenizers
    @abstractmethod
    def tokenizer(self, loaded):
        """A LoadedModel's tokenizer for decoding (encode / decode / the model's special ids)."""

    @abstractmethod
    def data_tokenizer(self, loaded):
        """The tokenizer a training run on a model that brings its own tokenizer (LoadedModel.own_tokenizer) must
        use, with the data pipeline's API."""

    @abstractmethod
    def text_adapter(
        self, loaded, src_lang: str | None = None, tgt_lang: str | None = None, context_policy: str = "truncate_left"
    ):
        """The text adapter the decoders' callers use (decoding/text.py SpmText or LMText): source text ->
        ids, a batch of ids -> the padded tensor, output ids -> text."""

    def check_text_options(
        self, *, chat: bool = False, langs: bool = False, context_policy: bool = False, what: str = "this model"
    ) -> None:
        """Options only a prompted family takes (translate's --chat / --langs / --context-policy)."""

    # ------------------------------------------------------------------------------------------------ bundles
    def bundle_heads(self, config) -> dict[str, Any]:
        """The bundle config.json's `heads` entry."""
        return {"block_size": config.block_size, "identity_p1": config.identity_p1, "head_hidden": config.head_hidden}

    @abstractmethod
    def folder_tokenizer(self, folder: Path, config, meta: dict | None):
        """A model's own tokenizer folder (an imported model's files), checked against its config -> (tokenizer,
        what a bundle's config.json records about it besides hash and files). TokenizerError if it does not fit."""

    @abstractmethod
    def tokenizer_ids(self, tok, config) -> tuple[dict[str, int], dict[str, int]]:
        """(ids a bundle's own tokenizer folder gives, the ids the config must have for them): they must agree."""

    # ------------------------------------------------------------------------------------------------ export
    def medusa_draft_problem(self, config) -> str | None:
        """Why this model cannot be exported as vLLM Medusa heads (export.format=vllm), or None."""
        return self.title

    # ------------------------------------------------------------------------------------------------ distillation
    @abstractmethod
    def check_distill(self, beam_size: int, temperature: float) -> None:
        """Refuse distillation settings a teacher of this family cannot use (DistillError)."""

    def distill_length_penalty(self, length_penalty: float) -> float:
        return float(length_penalty)

    @abstractmethod
    def distill_records(self, cfg):
        """The DatasetDict a teacher of this family re-decodes (distill.split of it)."""

    def check_teacher_ids(self, loaded) -> None:
        """A teacher with the corpus's tokenizer: its tokenizer and config must agree (DistillError)."""


# ---------------------------------------------------------------------------------------------------- registry
_FAMILIES: dict[str, ModelFamily] = {}  # filled by families/lm.py and mt.py, which families/__init__.py imports


def register(family: ModelFamily) -> ModelFamily:
    _FAMILIES[family.name] = family
    return family


def families() -> list[ModelFamily]:
    """Every family, in the order an `hf:` folder is offered to them (the most specific first)."""
    fams = _FAMILIES
    return sorted(fams.values(), key=lambda f: f.arch is None)


def get_family(name: str) -> ModelFamily:
    fams = _FAMILIES
    if name not in fams:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(sorted(fams))}")
    return fams[name]


def family_of(x: Any) -> ModelFamily:
    """The family of a family name, a saved model config (dict, Hydra node or dataclass), a model or a LoadedModel."""
    if isinstance(x, ModelFamily):
        return x
    if isinstance(x, str):
        return get_family(x)
    if not isinstance(x, Mapping) and hasattr(x, "model") and hasattr(x, "source"):  # a loading.LoadedModel
        x = x.model
    if not isinstance(x, Mapping) and hasattr(x, "config"):  # a model
        x = x.config
    arch = config_arch(x) if x is not None else None
    for fam in _FAMILIES.values():
        if fam.arch == arch:
            return fam
    raise ValueError(f"unknown model arch {arch!r}; known: " + ", ".join(repr(f.arch) for f in _FAMILIES.values()))
