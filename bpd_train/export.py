"""Export: a run, checkpoint, ZeRO folder or bundle -> a bundle folder (the format itself is bpd_train/bundle.py).

`python export.py` runs `run_export`. The model is loaded through bpd_train/loading.py like every other stage;
`load_bundle`, `BundleError` and `export_bundle` stay importable from here (the names users and the README use).
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from bpd_train.bundle import BundleError, check_output_dir, load_bundle
from bpd_train.bundle import write_bundle as export_bundle
from bpd_train.checkpoint import CheckpointError
from bpd_train.loading import LoadedModel, Source, load, resolve

__all__ = ["BundleError", "export_bundle", "export_checkpoint", "load_bundle", "provenance", "run_export"]

log = logging.getLogger(__name__)


def provenance(loaded: LoadedModel, name: str | None = None) -> dict[str, Any]:
    meta = loaded.meta or {}
    keep = ("regime", "paper_regime", "data", "data_name", "src_lang", "tgt_lang", "init_from", "global_step", "epoch",
            "seed", "head_loss", "trainable", "wandb_run_id", "wandb_project")
    out = {k: meta[k] for k in keep if k in meta and isinstance(meta[k], (str, int, float, bool))}
    if meta.get("training") and isinstance(meta["training"], dict):  # re-exporting a bundle
        out = {**meta["training"], **out}
    out["source"] = str(loaded.source)
    if name:
        out["name"] = name
    return out


def export_checkpoint(source: str | os.PathLike | Source, out_dir: str | os.PathLike, *, dtype: str = "float32",
                      overwrite: bool = False, report: str | os.PathLike | None = None, tag: str | None = None,
                      name: str | None = None) -> Path:
    """A Lightning checkpoint / run folder / ZeRO folder / bundle -> a bundle at `out_dir`."""
    from bpd_train.evaluation.report import card_section

    src = resolve(source, tag=tag)
    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite)  # before the (slow) load
    loaded = load(src)
    prov = provenance(loaded, name)
    prov["source_id"] = src.id
    prov["bundle_name"] = out_dir.name
    card = card_section(report, src.id) if report else None
    return export_bundle(loaded.model, loaded.tokenizer_path, out_dir, dtype=dtype, overwrite=overwrite,
                         provenance=prov, card_extra=card)


# ------------------------------------------------------------------------------------------------- export.py
def default_export_source(cfg) -> Path:
    """The newest trained head run of the corpus (else its base model)."""
    from bpd_train.evaluation.cli import _hint, corpus_dir

    root = corpus_dir(cfg)
    runs = []
    for run in [*sorted((root / "heads").glob("*")), root / "base"]:
        try:
            runs.append((resolve(run).path.stat().st_mtime, run))
        except (CheckpointError, OSError):
            continue
    if not runs:
        hint = _hint(cfg)
        raise CheckpointError(f"nothing to export under {root}: train first with `python train.py +regime=base{hint}` "
                              f"(then e.g. `python train.py +regime=frozen{hint}`), or pass export.checkpoint=PATH")
    heads = [r for r in runs if r[1].parent.name == "heads"]
    return max(heads or runs)[1]


def run_export(cfg) -> Path:
    from bpd_train.evaluation.cli import corpus_dir
    from bpd_train.evaluation.report import find_report

    x = cfg.export
    src = Path(x.checkpoint) if x.checkpoint else default_export_source(cfg)
    name = x.name or (src.name if src.is_dir() else (src.parent.parent.name if src.parent.name == "checkpoints"
                                                     else src.stem))
    out = Path(x.output_dir) if x.output_dir else corpus_dir(cfg) / "export" / name
    source = resolve(src, tag=x.tag)
    report = x.report
    if report is not None and str(report).lower() == "auto":
        report = find_report(corpus_dir(cfg) / "eval", source.id)
        if report is None:
            log.info("no evaluation report covers %s: the model card will say so", src)
    path = export_checkpoint(source, out, dtype=str(x.dtype), overwrite=bool(x.overwrite), report=report,
                             tag=x.tag, name=name)
    print(f"exported {src} -> {path}" + (f" (model card table from {report})" if report else ""))
    return path
