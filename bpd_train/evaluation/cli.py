"""What evaluate.py and export.py do with their Hydra config (the entry points stay thin)."""
from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger(__name__)


def _plain(node) -> Any:
    return OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) or OmegaConf.is_list(node) \
        else node


def _hint(cfg: DictConfig) -> str:
    """' experiment=smoke' when the user ran with it, so the commands we suggest are the ones to copy."""
    try:
        from hydra.core.hydra_config import HydraConfig

        exp = [o for o in HydraConfig.get().overrides.task if o.startswith("experiment=")]
        return " " + exp[0] if exp else ""
    except Exception:  # noqa: BLE001 - not under Hydra (tests)
        return ""


def _command() -> str:
    return " ".join(["python", Path(sys.argv[0]).name, *sys.argv[1:]])


def corpus_dir(cfg: DictConfig) -> Path:
    return Path(cfg.paths.artifacts) / str(cfg.data.name)


def load_split(cfg: DictConfig, split: str, max_sentences: int | None) -> tuple[list[str], list[str], dict]:
    """Sources and references of a split (evenly spaced subset when max_sentences is set)."""
    from bpd_train.data import load_corpus
    from bpd_train.evaluation.decode import EvalError

    src, tgt = str(cfg.data.src_lang), str(cfg.data.tgt_lang)
    try:
        ds = load_corpus(cfg.data, splits=(split,))
    except KeyError as e:
        raise EvalError(f"data {cfg.data.name!r} has no split {split!r}") from e
    if split not in ds:
        raise EvalError(f"data {cfg.data.name!r} has no split {split!r} (has: {', '.join(ds)})")
    ds = ds[split]
    n = len(ds)
    if max_sentences is not None and int(max_sentences) < n:
        m = int(max_sentences)
        idx = sorted({round(i * (n - 1) / max(1, m - 1)) for i in range(m)}) if m > 1 else [0][:m]
        ds = ds.select(idx)
    pairs = ds["translation"]
    info = {"name": str(cfg.data.name), "split": split, "src_lang": src, "tgt_lang": tgt, "split_size": n,
            "max_sentences": max_sentences}
    return [p[src] for p in pairs], [p[tgt] for p in pairs], info


def distilled_corpus(cfg: DictConfig) -> Path | None:
    """evaluate.distilled: auto = the corpus's one complete distilled training corpus, when there is exactly one
    (its teacher becomes a comparison point); a folder; or null/false for none."""
    from bpd_train.data.distilled import DistillError, find_distilled_corpus, read_manifest

    want = cfg.evaluate.get("distilled", "auto")
    if want is None or str(want).lower() in ("false", "none", "null", ""):
        return None
    if str(want).lower() == "auto":
        try:
            return find_distilled_corpus(corpus_dir(cfg), split="train", command="python distill.py")
        except DistillError as e:
            log.info("no teacher to compare with: %s", e)
            return None
    read_manifest(want)  # a folder without a manifest fails here, before any decoding
    return Path(str(want))


def run_evaluate(cfg: DictConfig) -> Path:
    from bpd_train.evaluation.runner import EvalSettings, default_inputs, evaluate_inputs, expand_inputs, load_inputs

    e, d = cfg.evaluate, cfg.decode
    settings = EvalSettings(block_sizes=_plain(d.block_sizes), rules=_plain(d.rules), batch_sizes=_plain(e.batch_sizes),
                            max_len=_plain(d.max_len), warmup=int(e.warmup), device=str(e.device),
                            progress=bool(e.progress), max_bleu_drop=float(e.get("max_bleu_drop", 1.0)))
    inputs = _plain(e.inputs)
    if isinstance(inputs, str):
        inputs = [inputs]
    if not inputs:
        inputs = default_inputs(corpus_dir(cfg), _hint(cfg))
    expanded = expand_inputs(inputs, all_checkpoints=bool(e.all_checkpoints))
    name = e.name or (expanded[0][0].replace("/", "_") if len(expanded) == 1 else "all")
    out_dir = Path(e.output_dir) if e.output_dir else corpus_dir(cfg) / "eval" / name
    loaded = load_inputs(expanded, settings)  # bad checkpoints and block sizes fail before the data loads
    distilled = distilled_corpus(cfg)
    sources, refs, info = load_split(cfg, str(e.split), e.max_sentences)
    report = evaluate_inputs(expanded, sources, refs, settings, out_dir, data_info=info, overwrite=bool(e.overwrite),
                             plots=bool(e.plots), command=_command(), loaded=loaded,
                             distilled_dir=distilled)
    if str(e.wandb).lower() != "false":
        from bpd_train.evaluation.wandb_log import log_report

        log_report(report, out_dir, force=str(e.wandb).lower() == "true")
    print((out_dir / "report.md").read_text(encoding="utf-8"))
    log.info("evaluation report: %s", out_dir)
    return out_dir


def default_export_source(cfg: DictConfig) -> Path:
    from bpd_train.checkpoint import CheckpointError
    from bpd_train.export import resolve_source

    root = corpus_dir(cfg)
    runs = []
    for run in [*sorted((root / "heads").glob("*")), root / "base"]:
        try:
            runs.append((resolve_source(run)[1].stat().st_mtime, run))
        except (CheckpointError, OSError):
            continue
    if not runs:
        hint = _hint(cfg)
        raise CheckpointError(f"nothing to export under {root}: train first with `python train.py +regime=base{hint}` "
                              f"(then e.g. `python train.py +regime=frozen{hint}`), or pass export.checkpoint=PATH")
    heads = [r for r in runs if r[1].parent.name == "heads"]
    return max(heads or runs)[1]


def run_export(cfg: DictConfig) -> Path:
    from bpd_train.evaluation.report import find_report
    from bpd_train.export import export_checkpoint, source_id

    x = cfg.export
    src = Path(x.checkpoint) if x.checkpoint else default_export_source(cfg)
    name = x.name or (src.name if src.is_dir() else (src.parent.parent.name if src.parent.name == "checkpoints"
                                                     else src.stem))
    out = Path(x.output_dir) if x.output_dir else corpus_dir(cfg) / "export" / name
    report = x.report
    if report is not None and str(report).lower() == "auto":
        report = find_report(corpus_dir(cfg) / "eval", source_id(src)) if src.exists() else None
        if report is None:
            log.info("no evaluation report covers %s: the model card will say so", src)
    path = export_checkpoint(src, out, dtype=str(x.dtype), overwrite=bool(x.overwrite), report=report,
                             tag=x.tag, name=name)
    print(f"exported {src} -> {path}" + (f" (model card table from {report})" if report else ""))
    return path
