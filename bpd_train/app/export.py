"""Export: a run, checkpoint, ZeRO folder, bundle or hf:... -> a bundle folder (the format itself is
bpd_train/sources/bundle.py), or with export.format=hf a transformers checkpoint folder
(bpd_train/sources/convert/hf/mt.py `to_hf`:
the backbone for transformers' from_pretrained, the heads in bpd_heads.safetensors, custom_generate/generate.py
for transformers' generate() with the heads, the tokenizer files).

`python export.py` runs `run_export`. The model is loaded through bpd_train/sources/loading.py like every other stage;
`load_bundle`, `BundleError` and `export_bundle` stay importable from here (the names users and the README use).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from bpd_train.sources.bundle import BundleError, check_output_dir, load_bundle
from bpd_train.sources.bundle import write_bundle as export_bundle
from bpd_train.sources.checkpoint import CheckpointError
from bpd_train.sources.convert import hf_format
from bpd_train.sources.loading import LoadedModel, Source, load, resolve

__all__ = [
    "BundleError",
    "export_bundle",
    "export_checkpoint",
    "export_hf",
    "export_vllm",
    "load_bundle",
    "provenance",
    "run_export",
]
FORMATS = ("bundle", "hf", "vllm")

log = logging.getLogger(__name__)


def provenance(loaded: LoadedModel, name: str | None = None) -> dict[str, Any]:
    meta = loaded.meta or {}
    keep = (
        "regime",
        "paper_regime",
        "data",
        "data_name",
        "src_lang",
        "tgt_lang",
        "init_from",
        "global_step",
        "epoch",
        "seed",
        "head_loss",
        "trainable",
        "wandb_run_id",
        "wandb_project",
    )
    out = {k: meta[k] for k in keep if k in meta and isinstance(meta[k], (str, int, float, bool))}
    if meta.get("training") and isinstance(meta["training"], dict):  # re-exporting a bundle
        out = {**meta["training"], **out}
    out["source"] = str(loaded.source)
    if name:
        out["name"] = name
    return out


def export_checkpoint(
    source: str | os.PathLike | Source,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    report: str | os.PathLike | None = None,
    tag: str | None = None,
    name: str | None = None,
) -> Path:
    """A Lightning checkpoint / run folder / ZeRO folder / bundle -> a bundle at `out_dir`."""
    from bpd_train.evaluation.report import card_section, recommended_settings

    src = resolve(source, tag=tag)
    out_dir = Path(out_dir)
    check_output_dir(out_dir, overwrite)  # before the (slow) load
    loaded = load(src)
    prov = provenance(loaded, name)
    prov["source_id"] = src.id
    prov["bundle_name"] = out_dir.name
    card = card_section(report, src.id) if report else None
    decode = recommended_settings(report, src.id) if report else None
    return export_bundle(
        loaded.model,
        loaded.tokenizer_path,
        out_dir,
        dtype=dtype,
        overwrite=overwrite,
        provenance=prov,
        card_extra=card,
        tokenizer_meta=loaded.tokenizer_meta,
        decode=decode,
    )


def export_hf(
    source: str | os.PathLike | Source, out_dir: str | os.PathLike, *, overwrite: bool = False, tag: str | None = None
) -> Path:
    """Any model source -> a transformers checkpoint folder (fp32) with bpd_heads.safetensors, beside it
    custom_generate/generate.py (with which transformers' own generate() decodes blockwise with the heads;
    bpd_train/hf_generate), and the tokenizer files: an imported model's own, or this project's tokenizer.model
    (read back by HFTokenizer kind spm).
    `overwrite` replaces only a folder that an earlier export.format=hf wrote."""
    from bpd_train.data.hf_tokenizer import tokenizer_files
    from bpd_train.sources.convert.common import check_hf_output_dir

    src = resolve(source, tag=tag)
    out_dir = Path(out_dir)
    check_hf_output_dir(out_dir, overwrite)  # before the (slow) load
    loaded = load(src)
    if loaded.own_tokenizer:
        files = {name: loaded.tokenizer_path / name for name in tokenizer_files(loaded.tokenizer_path)}
    else:
        files = {"tokenizer.model": loaded.tokenizer_path}
    # the family's transformers layout (Marian / Pegasus, Llama / Qwen2), which the hf: import reads back
    return hf_format(loaded.family).write(loaded.model, out_dir, files=files, overwrite=overwrite)


def export_vllm(
    source: str | os.PathLike | Source,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    tag: str | None = None,
) -> Path:
    """A decoder-only model with Medusa heads -> the folder vLLM's `medusa` speculative model loads
    (convert/vllm_medusa.py; serve it as the draft beside the base model)."""
    from bpd_train.sources.convert.vllm_medusa import export_medusa

    src = resolve(source, tag=tag)
    loaded = load(src)
    what = loaded.family.medusa_draft_problem(loaded.config)
    if what is not None:
        raise ValueError(
            f"export.format=vllm writes Medusa heads of a decoder-only model; {src} is {what} (train "
            "the heads with model.heads=medusa, or use export.format=bundle|hf)"
        )
    return export_medusa(loaded.model, out_dir, dtype=dtype, overwrite=overwrite)


# ------------------------------------------------------------------------------------------------- export.py
def default_export_source(cfg) -> Path:
    """The newest trained head run of the corpus (else its base model)."""
    from bpd_train.evaluation.cli import command_hint, corpus_dir

    root = corpus_dir(cfg)
    runs = []
    for run in [*sorted((root / "heads").glob("*")), root / "base"]:
        try:
            runs.append((resolve(run).path.stat().st_mtime, run))
        except (CheckpointError, OSError):
            continue
    if not runs:
        hint = command_hint(cfg)
        raise CheckpointError(
            f"nothing to export under {root}: train first with `python train.py +regime=base{hint}` "
            f"(then e.g. `python train.py +regime=frozen{hint}`), or pass export.checkpoint=PATH"
        )
    heads = [r for r in runs if r[1].parent.name == "heads"]
    return max(heads or runs)[1]


def run_export(cfg) -> Path:
    from bpd_train.evaluation.cli import corpus_dir
    from bpd_train.evaluation.report import find_report

    x = cfg.export
    if cfg.get("num_threads"):  # as train.py / evaluate.py take it (one override for every stage of the pipeline)
        import torch

        torch.set_num_threads(int(cfg.num_threads))
    fmt = str(x.get("format", "bundle"))
    if fmt not in FORMATS:
        raise ValueError(f"export.format={fmt!r}; choose one of {', '.join(FORMATS)}")
    src = Path(str(x.checkpoint)) if x.checkpoint else default_export_source(cfg)
    source = resolve(str(x.checkpoint) if x.checkpoint else src, tag=x.tag)
    named = src if src.exists() else source.path  # hf:<id> is no path: name it after the folder it resolved to
    name = x.name or (
        named.name
        if named.is_dir()
        else (named.parent.parent.name if named.parent.name == "checkpoints" else named.stem)
    )
    out = Path(x.output_dir) if x.output_dir else corpus_dir(cfg) / "export" / (name + ("-hf" if fmt == "hf" else ""))
    if fmt == "vllm":
        out = Path(x.output_dir) if x.output_dir else corpus_dir(cfg) / "export" / (name + "-vllm-medusa")
        path = export_vllm(source, out, dtype=str(x.dtype), overwrite=bool(x.overwrite), tag=x.tag)
        print(f"exported {x.checkpoint or src} -> {path} (vLLM medusa draft model)")
        return path
    if fmt == "hf":
        path = export_hf(source, out, overwrite=bool(x.overwrite), tag=x.tag)
        print(f"exported {x.checkpoint or src} -> {path} (transformers checkpoint + bpd_heads.safetensors)")
        return path
    report = x.report
    if report is not None and str(report).lower() == "auto":
        report = find_report(corpus_dir(cfg) / "eval", source.id)
        if report is None:
            log.info("no evaluation report covers %s: the model card will say so", src)
    path = export_checkpoint(
        source, out, dtype=str(x.dtype), overwrite=bool(x.overwrite), report=report, tag=x.tag, name=name
    )
    print(f"exported {src} -> {path}" + (f" (model card table from {report})" if report else ""))
    return path
