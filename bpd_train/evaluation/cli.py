"""What evaluate.py does with its Hydra config (the entry point stays thin; export.py's is bpd_train/app/export.py)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from bpd_train.data.distilled import DistillError, find_distilled_corpus, read_manifest
from bpd_train.data.lm.processing import load_lm_jsonl
from bpd_train.data.sampler import evenly_spaced
from bpd_train.decoding.settings import DecodeError as EvalError
from bpd_train.decoding.settings import DecodeSettings

log = logging.getLogger(__name__)


def _plain(node) -> Any:
    return (
        OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) or OmegaConf.is_list(node) else node
    )


def command_hint(cfg: DictConfig) -> str:
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

    src, tgt = str(cfg.data.src_lang), str(cfg.data.tgt_lang)
    files = (cfg.data.get("lm") or {}).get("files")
    if files:  # a decoder-only model's prompt/response records (data.lm.files): prompts in, references out
        return _load_prompts(cfg, dict(files), split, max_sentences)
    try:
        ds = load_corpus(cfg.data, splits=(split,))
    except KeyError as e:
        raise EvalError(f"data {cfg.data.name!r} has no split {split!r}") from e
    if split not in ds:
        raise EvalError(f"data {cfg.data.name!r} has no split {split!r} (has: {', '.join(ds)})")
    ds = ds[split]
    n = len(ds)
    if max_sentences is not None and int(max_sentences) < n:
        ds = ds.select(evenly_spaced(n, int(max_sentences)))
    pairs = ds["translation"]
    info = {
        "name": str(cfg.data.name),
        "split": split,
        "src_lang": src,
        "tgt_lang": tgt,
        "split_size": n,
        "max_sentences": max_sentences,
    }
    return [p[src] for p in pairs], [p[tgt] for p in pairs], info


def _load_prompts(cfg: DictConfig, files: dict, split: str, max_sentences: int | None):
    if not files.get(split):
        raise EvalError(f"data.lm.files has no {split!r} split (has: {', '.join(k for k, v in files.items() if v)})")
    ds = load_lm_jsonl({split: files[split]})[split]
    n = len(ds)
    if max_sentences is not None and int(max_sentences) < n:
        ds = ds.select(evenly_spaced(n, int(max_sentences)))
    cols = set(ds.column_names)
    if not ({"prompt", "response"} <= cols or "messages" in cols):
        raise EvalError(
            f"evaluation reads prompt/response or chat `messages` records; {files[split]} holds {ds.column_names}"
        )
    sources, refs = [], []
    for i, rec in enumerate(ds):
        msgs = rec.get("messages")
        if msgs:  # a chat: the messages before the last assistant turn are the prompt (rendered by the
            #       model's chat template, decoding/text.py LMText), that turn the reference
            last = msgs[-1] if isinstance(msgs[-1], dict) else {}
            if last.get("role") != "assistant" or not str(last.get("content") or "").strip():
                raise EvalError(
                    f"{files[split]} record {i}: a chat to evaluate must end with a non-empty assistant "
                    "message (the reference)"
                )
            sources.append([{k: v for k, v in m.items() if v is not None} for m in msgs[:-1]])
            refs.append(str(last["content"]))
        elif rec.get("prompt") is not None and rec.get("response") is not None:
            sources.append(rec["prompt"])
            refs.append(rec["response"])
        else:
            raise EvalError(f"{files[split]} record {i}: needs prompt and response, or messages")
    info = {
        "name": str(cfg.data.name),
        "split": split,
        "prompts": True,
        "split_size": n,
        "max_sentences": max_sentences,
        "chats": sum(not isinstance(s, str) for s in sources),
    }
    return sources, refs, info


def quality_split(cfg: DictConfig, timed: int, info: dict) -> tuple[list, list] | None:
    """evaluate.bleu_sentences: the sentences each checkpoint's greedy BLEU/chrF is scored on when they are more than
    the timed ones (evaluate.max_sentences): `all` (the whole split) or N evenly spaced; null = the timed ones.
    BLEU over 80 sentences moves by about a point between runs of the same regime; greedy decoding (which exact
    blockwise output equals) of a whole split at the largest batch size costs seconds."""
    want = cfg.evaluate.get("bleu_sentences")
    if want is None or str(want).lower() in ("null", "none"):
        return None
    if str(want).lower() == "all":
        n = None
    else:
        try:
            n = int(want)
        except (TypeError, ValueError):
            n = -1
        if n < 1:
            raise EvalError(
                f"evaluate.bleu_sentences must be `all`, null or a positive number of sentences, got {want!r}"
            )
    size = int(info.get("split_size") or 0)
    if (n if n is not None and n < size else size) <= timed:  # no more than the timed sentences: score those
        return None
    sources, refs, _ = load_split(cfg, str(cfg.evaluate.split), n)
    return sources, refs


def distilled_corpus(cfg: DictConfig) -> Path | None:
    """evaluate.distilled: auto = the corpus's one complete distilled training corpus, when there is exactly one
    (its teacher becomes a comparison point); a folder; or null/false for none."""
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
    if cfg.get("num_threads"):  # before any timing: the report records torch.get_num_threads()
        torch.set_num_threads(int(cfg.num_threads))
    settings = EvalSettings(
        block_sizes=_plain(d.block_sizes),
        rules=_plain(d.rules),
        batch_sizes=_plain(e.batch_sizes),
        warmup=int(e.warmup),
        device=str(e.device),
        progress=bool(e.progress),
        adaptive_speedup=bool(e.get("adaptive_speedup", True)),
        min_seconds=float(e.get("min_seconds") or 0.0),
        max_bleu_drop=float(e.get("max_bleu_drop", 1.0)),
        decode=DecodeSettings.from_config(_plain(d)),  # every decode setting the config gives (decode_settings.py)
    )
    inputs = _plain(e.inputs)
    if isinstance(inputs, str):
        inputs = [inputs]
    if not inputs:
        inputs = default_inputs(corpus_dir(cfg), command_hint(cfg))
    expanded = expand_inputs(inputs, all_checkpoints=bool(e.all_checkpoints))
    name = e.name or (expanded[0][0].replace("/", "_") if len(expanded) == 1 else "all")
    out_dir = Path(e.output_dir) if e.output_dir else corpus_dir(cfg) / "eval" / name
    loaded = load_inputs(expanded, settings)  # bad checkpoints and block sizes fail before the data loads
    distilled = distilled_corpus(cfg)
    sources, refs, info = load_split(cfg, str(e.split), e.max_sentences)
    quality = quality_split(cfg, len(sources), info)
    report = evaluate_inputs(
        expanded,
        sources,
        refs,
        settings,
        out_dir,
        data_info=info,
        overwrite=bool(e.overwrite),
        plots=bool(e.plots),
        command=_command(),
        loaded=loaded,
        distilled_dir=distilled,
        quality=quality,
    )
    if str(e.wandb).lower() != "false":
        from bpd_train.evaluation.wandb_log import log_report

        log_report(report, out_dir, force=str(e.wandb).lower() == "true")
    print((out_dir / "report.md").read_text(encoding="utf-8"))
    log.info("evaluation report: %s", out_dir)
    return out_dir
