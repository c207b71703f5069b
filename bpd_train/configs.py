"""Where the shipped Hydra configs and data are (`REPO_ROOT`, `INSTALLED`, the resolvers `work_root` and
`corpus_name`) and what the configs offer, read from conf/ without Hydra or torch: the front ends (bpd_train/app/cli.py)
check a command line with it before anything heavy loads, and training/ reads the regime's record (`Regime`) and its
choices from here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

# Where conf/ and the bundled corpus (data/) are: the clone (an editable install), or the copies a wheel ships in
# bpd_train/_root (bpd_train/_build.py). INSTALLED: no clone around, so runs write under the working directory.
# (bpd_train/__init__.py re-exports these: `bpd_train.REPO_ROOT`.)
_SHIPPED = Path(__file__).resolve().parent / "_root"
INSTALLED = (_SHIPPED / "conf").is_dir()
REPO_ROOT = _SHIPPED if INSTALLED else Path(__file__).resolve().parent.parent


def work_root() -> str:
    """Where artifacts/ and outputs/ go by default (conf/paths/default.yaml): the clone, else the working directory."""
    return str(Path.cwd() if INSTALLED else REPO_ROOT)


def corpus_name(
    path: object, hf_name: object = None, hf_config: object = None, src: object = None, tgt: object = None
) -> str:
    """A corpus's default name (conf/data/local.yaml): what it is plus a hash of where it is, so two corpora never
    share an artifacts folder: /data/news -> news-en-fr-1a2b3c."""
    import hashlib
    import re

    if path:
        where = str(Path(str(path)).expanduser().resolve())
        stem = Path(where).name.split(".")[0] or "corpus"
    else:
        local = Path(str(hf_name)).expanduser()
        where = f"{local.resolve() if local.exists() else hf_name}/{hf_config}"
        stem = "-".join(str(x).rstrip("/").rsplit("/", 1)[-1] for x in (hf_name, hf_config) if x)
    digest = hashlib.sha256(where.encode()).hexdigest()[:6]
    name = "-".join(str(x) for x in (stem, src, tgt, digest) if x)
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name)


def register_resolvers() -> None:
    """Hydra configs say ${repo_root:} so the bundled data is found whatever the working directory."""
    try:
        from omegaconf import OmegaConf
    except ImportError:  # the pure-torch parts must import without omegaconf
        return
    if not OmegaConf.has_resolver("repo_root"):
        OmegaConf.register_new_resolver("repo_root", lambda: str(REPO_ROOT))
    if not OmegaConf.has_resolver("work_root"):
        OmegaConf.register_new_resolver("work_root", work_root)
    if not OmegaConf.has_resolver("corpus_name"):
        OmegaConf.register_new_resolver("corpus_name", corpus_name)


# The training regime's choices, declared once: training/ (regimes.py, losses.py) and the command line's pre-check
# (cli.py CHOICES) import them.
TRAINABLE = ("all", "heads")
# self: the init_from model's own greedy output (distill.py teacher=<init_from> distill.beam_size=1), what exact
# decoding accepts proposals against (training/run.py finds that corpus)
SOURCES = ("gold", "distilled", "mixed", "self")
HEAD_LOSSES = ("random", "mean", "weighted")  # training/losses.py: one sampled head, the mean, a weighted sum


def config_dir() -> Path:
    """The folder of Hydra configs: the clone's conf/, or the copy an installed wheel ships (bpd_train/_build.py)."""
    return REPO_ROOT / "conf"


def regime_names() -> list[str]:
    """The regimes `+regime=` can pick: conf/regime/*.yaml (conf/regime/_*.yaml hold what several share)."""
    return sorted(p.stem for p in (config_dir() / "regime").glob("*.yaml") if not p.stem.startswith("_"))


@dataclass(frozen=True)
class Regime:
    name: str
    trainable: str = "all"  # all | heads (backbone frozen)
    source: str = "gold"  # gold | distilled | mixed (distilled pairs plus gold ones, see gold_share) | self
    gold_share: float = 0.5  # source=mixed: the fraction of the training pairs that are gold
    init_from: str | None = None  # checkpoint / run folder / bundle the backbone comes from
    block_size: int = 1  # k of the model this regime trains
    head_loss: str = "mean"  # random | mean | weighted
    stage: str = "base"  # base | heads
    run_subdir: str = "base"
    distilled_dir: str | None = None
    paper_name: str | None = None
    feature_cache_gb: float = 0.0  # frozen backbone: keep each row's hidden states (up to this many GiB) for reuse

    def __post_init__(self) -> None:
        if self.trainable not in TRAINABLE:
            raise ValueError(f"regime {self.name}: trainable must be one of {TRAINABLE}, got {self.trainable!r}")
        if self.source not in SOURCES:
            raise ValueError(f"regime {self.name}: source must be one of {SOURCES}, got {self.source!r}")
        if self.source == "mixed" and not 0.0 <= float(self.gold_share) < 1.0:
            raise ValueError(f"regime {self.name}: gold_share (source=mixed) must be in [0, 1), got {self.gold_share}")
        if self.source == "self" and not self.init_from:
            raise ValueError(
                f"regime {self.name}: source=self trains on a model's own greedy output; set "
                f"regime.init_from to that model"
            )
        if self.head_loss not in HEAD_LOSSES:
            raise ValueError(f"regime {self.name}: head_loss must be one of {HEAD_LOSSES}, got {self.head_loss!r}")
        if int(self.block_size) < 1:
            raise ValueError(f"regime {self.name}: block_size must be >= 1, got {self.block_size}")
        if self.trainable == "heads" and not self.init_from:
            raise ValueError(f"regime {self.name}: a frozen backbone needs init_from (a base checkpoint)")
        if self.trainable == "heads" and int(self.block_size) < 2:
            raise ValueError(
                f"regime {self.name}: a frozen backbone with k=1 has nothing to train; set model.block_size >= 2"
            )

    @property
    def freeze_backbone(self) -> bool:
        return self.trainable == "heads"

    @classmethod
    def from_cfg(cls, cfg: Mapping[str, Any]) -> "Regime":
        names = {f.name for f in dataclasses.fields(cls)}
        d = {k: v for k, v in dict(cfg).items() if k in names}
        d["block_size"] = int(d.get("block_size", 1))
        if d.get("init_from") is not None:
            d["init_from"] = str(Path(str(d["init_from"])).expanduser())
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
