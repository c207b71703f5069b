"""Evaluate checkpoints: greedy (the reference) vs blockwise for every block size x acceptance rule x batch size.

For each combination: BLEU/chrF of the blockwise output, k̂, decoder calls, agreement with greedy (% identical
sentences) and the wall-clock speedup, timed fairly (warm-up first; greedy and blockwise alternate on the same
batches; CUDA synchronized around every timing). Everything lands in one folder, written atomically:
report.json, report.md, plots, src.txt/ref.txt and one hypothesis file per combination.
"""

from __future__ import annotations

import glob
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from bpd_train.data.distilled import read_manifest
from bpd_train.data.sampler import length_batches
from bpd_train.decode_settings import EVAL_DTYPE
from bpd_train.decoding.batched import translate_ids
from bpd_train.decoding.serving import answer, prepare
from bpd_train.decoding.settings import (
    DecodeError as EvalError,
)
from bpd_train.decoding.settings import (
    DecodeSettings,
    check_block_sizes,
    parse_rule,
)
from bpd_train.decoding.text import one_line
from bpd_train.engine.fastlinear import cpu_model, engine_name
from bpd_train.evaluation.compare import Batches, compare, greedy_tokens
from bpd_train.evaluation.metrics import agreement, corpus_scores
from bpd_train.evaluation.report import add_comparisons, write_report
from bpd_train.io import atomic_dir, atomic_write_text
from bpd_train.sources.checkpoint import CheckpointError
from bpd_train.sources.loading import Source, load, resolve, run_checkpoints
from bpd_train.sources.loading import load as load_any

REPORT_FORMAT = "bpd-train-eval-report"
KEEP_PARAMS = 300_000_000


class EvalSettings:
    """What evaluate.py runs: the grid (block sizes x rules x batch sizes), how it times, and one DecodeSettings
    (`decode`: every other decode setting, as Translator and the translate command line take them, declared in
    bpd_train/decode_settings.py). `decode` fields may be given as keywords too: EvalSettings(dtype="int8")."""

    def __init__(
        self,
        block_sizes: Sequence[int] | None = None,  # None: the model's k and every smaller even k
        rules: Sequence[str] | None = ("exact", "top2"),
        batch_sizes: Sequence[int] | None = (1, 32),
        *,
        warmup: int = 1,  # untimed batches per decoder before timing
        max_bleu_drop: float = 1.0,  # the recommended run may lose at most this much base BLEU
        device: str = "auto",
        progress: bool = True,
        min_seconds: float = 0.0,  # timed passes over the sentences until each decoder ran this long
        adaptive_speedup: bool = True,  # exact rule on the CPU: also time adaptive feeding (what the serving
        #                                 paths run there with adaptive=auto) in the same interleaved run
        decode: DecodeSettings | None = None,
        **overrides,
    ) -> None:
        # checked once, before any decoding; dtype EVAL_DTYPE unless given (its tables compare precisions to fp32)
        self.decode = (decode or DecodeSettings(dtype=EVAL_DTYPE)).replace(**overrides)
        self.rules = [str(r) for r in (rules or [])]
        for r in self.rules:
            parse_rule(r)  # fail before any decoding
        self.batch_sizes = [int(b) for b in (batch_sizes or [])]
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise EvalError(f"batch_sizes must be a non-empty list of positive ints, got {self.batch_sizes}")
        self.block_sizes = [int(b) for b in block_sizes] if block_sizes is not None else None
        self.warmup, self.device, self.progress = int(warmup), device, bool(progress)
        self.min_seconds, self.adaptive_speedup = float(min_seconds), bool(adaptive_speedup)
        self.max_bleu_drop = float(max_bleu_drop)
        if not self.max_bleu_drop >= 0:
            raise EvalError(f"max_bleu_drop must be a BLEU difference >= 0, got {self.max_bleu_drop}")

    @property
    def adaptive(self) -> bool | float:
        """Adaptive feeding in the timed columns: auto (None) times the full feed there, and the serving paths'
        automatic choice beside it (adaptive_speedup); true / a threshold feed adaptively in the columns."""
        return False if self.decode.adaptive is None else self.decode.adaptive

    def decode_settings(self, **changes) -> DecodeSettings:
        """The DecodeSettings every combination starts from (its rule, block size and batch size are the grid's)."""
        return self.decode.replace(**changes)

    def as_dict(self) -> dict[str, Any]:
        """As report.json records it: the grid and timing, then the decode settings a decode config lists."""
        grid = ("block_sizes", "rules", "batch_sizes", "warmup", "max_bleu_drop", "device", "progress")
        out = {k: getattr(self, k) for k in grid}
        decode = self.decode.as_config()
        out.update({k: decode[k] for k in DecodeSettings.yaml_names()})
        out.update(min_seconds=self.min_seconds, adaptive_speedup=self.adaptive_speedup)
        return out

    def torch_device(self) -> torch.device:
        if self.device in (None, "auto"):
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


# ------------------------------------------------------------------------------------------------------ inputs
def _display_name(path: Path, run_level: bool) -> str:
    if path.is_dir():
        return path.name
    if path.parent.name == "checkpoints":
        run = path.parent.parent.name
        return run if run_level else f"{run}/{path.stem}"
    return path.stem


def expand_inputs(inputs: Sequence[str | os.PathLike], all_checkpoints: bool = False) -> list[tuple[str, Source]]:
    """Checkpoint files, run folders, bundles, ZeRO folders or glob patterns -> [(unique name, resolved source)].
    all_checkpoints: every checkpoint of a run folder, else the one loading.resolve picks."""
    out: list[tuple[str, Source]] = []
    for spec in inputs:
        spec = str(spec)
        paths = sorted(Path(p) for p in glob.glob(spec)) if glob.has_magic(spec) else [Path(spec)]
        if not paths:
            raise CheckpointError(f"no checkpoint matches {spec}")
        for p in paths:
            source = resolve(spec if not glob.has_magic(spec) else p)
            if source.path == p or source.kind not in ("ckpt", "zero"):  # not a run folder (a bundle, hf:...)
                out.append((_display_name(p, False) if p.exists() else p.name, source))
                continue
            ckpts = (run_checkpoints(p) if all_checkpoints else []) or [source]
            for c in ckpts:
                name = p.name if len(ckpts) == 1 else f"{p.name}/{c.path.stem}"
                out.append((name, c))
    names: dict[str, int] = {}
    unique = []
    for name, p in out:
        names[name] = names.get(name, 0) + 1
        unique.append((name if names[name] == 1 else f"{name}#{names[name]}", p))
    return unique


def default_inputs(corpus_dir: Path, train_hint: str) -> list[str]:
    """The corpus's base run and every heads run under ${paths.artifacts}/<corpus>/."""
    runs = []
    if (corpus_dir / "base").is_dir():
        runs.append(str(corpus_dir / "base"))
    runs += [str(p) for p in sorted((corpus_dir / "heads").glob("*")) if p.is_dir() and not p.name.startswith(".")]
    if not runs:
        raise CheckpointError(
            f"no trained model under {corpus_dir} (base/ or heads/*): train one first with "
            f"`python train.py +regime=base{train_hint}` (and `+regime=frozen{train_hint}` for "
            "heads), or pass evaluate.inputs=[PATH]"
        )
    return runs


# ------------------------------------------------------------------------------------------------------ decoding
def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_.#" else "_" for c in name)


def imported_regime(meta: dict, cfg) -> str | None:
    """An imported model without heads (`hf:<folder>`, or a bundle exported from one) is the base model of its
    report: every heads run trained from it starts there, and the best-run rule holds them to its BLEU."""
    source = meta.get("source") or (meta.get("training") or {}).get("source") or ""
    imported = source in ("hf", "gguf") or str(source).startswith(("hf:", "gguf:"))
    return "base" if imported and int(cfg.block_size) == 1 else None


def evaluate_loaded(
    loaded,
    name: str,
    sources: Sequence[str],
    refs: Sequence[str],
    settings: EvalSettings,
    out_dir: Path,
    extra: dict | None = None,
    langs: tuple[str | None, str | None] = (None, None),
    quality: tuple[Sequence, Sequence] | None = None,
) -> tuple[dict, list[dict]]:
    """Decode `sources` with one loaded model for every combination; write hypothesis files under out_dir/hyp/.
    A decoder-only model is prompted with each source as a prompt-format translation in `langs` (source,
    target), or with the source text itself when langs are None. `quality`: (sources, references) whose greedy
    BLEU/chrF is the checkpoint's quality (entry["quality"]), decoded untimed at the largest batch size.
    Returns (checkpoint entry, result rows)."""
    from tqdm import tqdm

    device = settings.torch_device()
    model = loaded.model.to(device).eval()
    cfg = model.config
    ks = check_block_sizes(settings.block_sizes, cfg.block_size, f"{name} ({loaded.source})")
    rules = [(r, parse_rule(r)) for r in settings.rules]
    text = loaded.family.text_adapter(loaded, langs[0], langs[1])
    base = settings.decode_settings()
    sampling = None
    if base.sampling:  # plain vs blockwise sampling; acceptance rules are for temperature 0 (one column per k)
        sampling = {n: getattr(base, n) for n in ("temperature", "top_k", "top_p", "seed", "verify")}
        rules = [("sampling", parse_rule("exact"))]
    # the decode options for this model's file type (dtype auto), tokenizer and device, packed
    decoder = prepare(model, text.sp, base, device, weight_type=getattr(loaded, "weight_type", None))
    base = decoder.settings  # (dtype auto resolved)
    options = decoder.options
    src_ids = [text.source_ids(s) for s in sources]
    truncated = text.truncated  # of the timed sources
    max_len = base.max_len
    hyp_dir = out_dir / "hyp" / _safe(name)
    hyp_dir.mkdir(parents=True, exist_ok=True)
    meta = loaded.meta or {}
    regime = meta.get("regime") or (meta.get("training") or {}).get("regime") or imported_regime(meta, cfg)
    combos = [(k, r, rule) for k in ks for r, rule in rules]
    lengths = [len(x) for x in src_ids]
    n_batches = sum(len(length_batches(lengths, b)) for b in settings.batch_sizes) * max(1, len(combos))
    q_ids = [text.source_ids(s) for s in quality[0]] if quality is not None else None
    q_batches = Batches.of(q_ids, max(settings.batch_sizes), cfg.pad_id, device) if q_ids else None
    n_batches += len(q_batches.groups) if q_batches else 0
    bar = tqdm(
        total=n_batches, desc=f"eval {name}", unit="batch", disable=not settings.progress, file=sys.stderr, leave=False
    )

    entry = {
        "name": name,
        "path": str(loaded.source),
        "regime": regime,
        "k": cfg.block_size,
        "identity_p1": cfg.identity_p1,
        "tokenizer_hash": loaded.tokenizer_hash,
        "truncated_sources": 0,
        "greedy": {"by_batch_size": {}},
        "decode": {
            "dtype": base.dtype,
            # as resolved ("auto"): draft tokens, proposal precision
            "draft_vocab": len(options.draft_vocab) if options.draft_vocab else None,
            "proposal_dtype": options.proposal_dtype,
            "adaptive": settings.adaptive,
            "engine": engine_name(),
            # temperature > 0: the greedy columns are plain sampling, the blockwise ones blockwise sampling
            "sampling": sampling,
        },
        **(extra or {}),
    }
    rows: list[dict] = []
    greedy_ref: list | None = None
    for bs in settings.batch_sizes:
        batches = Batches.of(src_ids, bs, cfg.pad_id, device)
        for combo in combos or [None]:
            k, rname, rule = combo or (None, None, None)
            also = (
                sampling is None
                and settings.adaptive_speedup
                and settings.adaptive is False
                and k is not None
                and base.replace(accept=rule, adaptive=None).adaptive_on(device) is True
            )
            c = compare(
                model,
                batches,
                k=k,
                rule=rule,
                max_len=max_len,
                device=device,
                warmup=settings.warmup,
                adaptive=settings.adaptive,
                also_adaptive=also,
                on_batch=bar.update,
                min_seconds=settings.min_seconds,
                sampling=sampling,
                weights=decoder.weights,
            )
            g = c.greedy
            if greedy_ref is None:
                greedy_ref = g.tokens
                hyps = [one_line(answer(base, text, t)[0]) for t in g.tokens]
                atomic_write_text(hyp_dir / "greedy.txt", "".join(h + "\n" for h in hyps))
                entry["greedy"].update(
                    corpus_scores(hyps, refs),
                    hyp_file=str((hyp_dir / "greedy.txt").relative_to(out_dir)),
                    tokens=g.stats.tokens,
                )
            by_bs = entry["greedy"]["by_batch_size"].setdefault(
                str(bs),
                {
                    "calls": g.stats.calls,
                    "prefill_calls": g.stats.prefill_calls,
                    "seconds": [],
                    "same_output_as_first_batch_size": agreement(g.tokens, greedy_ref) == 100.0,
                },
            )
            by_bs["seconds"].append(g.seconds / g.passes)
            if c.blockwise is None:
                continue
            b = c.blockwise
            hyps = [one_line(answer(base, text, t)[0]) for t in b.tokens]
            hyp_file = hyp_dir / f"k{k}.{_safe(rname)}.bs{bs}.txt"
            atomic_write_text(hyp_file, "".join(h + "\n" for h in hyps))
            scores = corpus_scores(hyps, refs)
            rows.append(
                {
                    "checkpoint": name,
                    "regime": regime,
                    "model_k": cfg.block_size,
                    "k": k,
                    "rule": rname,
                    "rule_label": rule.label if sampling is None else "Sampling",
                    "batch_size": bs,
                    "bleu": scores["bleu"],
                    "chrf": scores["chrf"],
                    "greedy_bleu": entry["greedy"]["bleu"],
                    "mean_accepted": b.stats.mean_accepted,
                    "calls": b.stats.calls,
                    "prefill_calls": b.stats.prefill_calls,
                    "greedy_calls": g.stats.calls,
                    # batch-level view: output tokens per batched decoder call, prefill included
                    "tokens_per_call": b.stats.tokens / max(1, b.stats.calls + b.stats.prefill_calls),
                    "accepted_hist": b.stats.to_dict()["accepted_hist"],
                    "tokens": b.stats.tokens,
                    "greedy_tokens": g.stats.tokens,
                    "agreement": c.agreement,
                    # seconds per pass over the sentences (timed_passes of them, interleaved)
                    "greedy_seconds": g.seconds / g.passes,
                    "blockwise_seconds": b.seconds / b.passes,
                    "speedup": c.speedup,
                    "timed_passes": g.passes,
                    "hyp_file": str(hyp_file.relative_to(out_dir)),
                }
            )
            if c.adaptive is not None:  # the serving paths' decoding: the same output, its own speed and k-hat
                rows[-1].update(
                    adaptive_speedup=c.adaptive_speedup,
                    adaptive_seconds=c.adaptive.seconds / c.adaptive.passes,
                    adaptive_mean_accepted=c.adaptive.stats.mean_accepted,
                    adaptive_agreement=agreement(c.adaptive.tokens, g.tokens),
                )
    if q_batches is not None:
        q_tokens = greedy_tokens(model, q_batches, max_len=max_len, on_batch=bar.update, weights=decoder.weights)
        hyps = [one_line(answer(base, text, t)[0]) for t in q_tokens]
        hyp_file = hyp_dir / "greedy.quality.txt"
        atomic_write_text(hyp_file, "".join(h + "\n" for h in hyps))
        scores = corpus_scores(hyps, quality[1])
        entry["quality"] = {
            "sentences": len(hyps),
            "bleu": scores["bleu"],
            "chrf": scores["chrf"],
            "hyp_file": str(hyp_file.relative_to(out_dir)),
        }
    else:  # the timed sentences are the quality set
        entry["quality"] = {
            "sentences": len(sources),
            "bleu": entry["greedy"]["bleu"],
            "chrf": entry["greedy"]["chrf"],
            "hyp_file": entry["greedy"]["hyp_file"],
        }
    bar.close()
    entry["truncated_sources"] = truncated
    for v in entry["greedy"]["by_batch_size"].values():
        v["seconds"] = sum(v["seconds"]) / len(v["seconds"])
    return entry, rows


def evaluate_teacher(
    distilled_dir: str | os.PathLike, sources: Sequence[str], refs: Sequence[str], settings: EvalSettings, out_dir: Path
) -> dict:
    """The distillation teacher as a comparison point for the runs trained on its output: its BLEU on the training
    sources it re-translated (the corpus manifest) and, while its checkpoint exists, its beam search (the manifest's
    beam, alpha and max_len) on these evaluation sources, which is the number a regime's BLEU can be set against."""
    m = read_manifest(distilled_dir)
    train = m.get("teacher_bleu") or {}
    entry = {
        "corpus": str(distilled_dir),
        "teacher_id": m.get("teacher_id"),
        "teacher_path": m.get("teacher_path"),
        "beam_size": m.get("beam_size"),
        "length_penalty": m.get("length_penalty"),
        "max_len": m.get("max_len"),
        "train_bleu": train.get("bleu"),
        "train_sentences": train.get("num_sentences"),
        "bleu": None,
        "chrf": None,
        "hyp_file": None,
    }
    if m.get("kind") == "lm":  # the model answered its own prompts: its greedy column is the base run's
        entry["self_distilled"] = True
        return entry
    try:
        loaded = load_any(m["teacher_path"], map_location="cpu")
    except (CheckpointError, OSError, KeyError) as e:  # moved or deleted since: the manifest's number still stands
        entry["missing"] = str(e)
        return entry
    model = loaded.model.to(settings.torch_device()).eval()
    text = loaded.family.text_adapter(loaded)
    out = translate_ids(
        model,
        [text.source_ids(s) for s in sources],
        beam_size=int(m["beam_size"]),
        length_penalty=float(m["length_penalty"]),
        max_len=m["max_len"],
        max_tokens=8192,
        max_sentences=max(settings.batch_sizes),
    )
    hyps = [one_line(text.detok(t)) for t, _ in out]
    hyp_file = out_dir / "hyp" / "teacher" / "beam.txt"
    hyp_file.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(hyp_file, "".join(h + "\n" for h in hyps))
    entry.update(corpus_scores(hyps, refs), hyp_file=str(hyp_file.relative_to(out_dir)), sentences=len(hyps))
    return entry


# ------------------------------------------------------------------------------------------------------ the run
def load_inputs(
    inputs: Sequence[tuple[str, Path]], settings: EvalSettings, expect_tokenizer_hash: str | None = None
) -> list[tuple[str, Path, object]]:
    """Load (on CPU) and check every input before any decoding: bad input fails in seconds, not after an hour.
    Models are kept for the evaluation while they add up to < KEEP_PARAMS parameters, else reloaded then."""
    loaded_all, kept = [], 0
    for name, path in inputs:
        path = resolve(path)
        loaded = load(path, map_location="cpu", expect_tokenizer_hash=expect_tokenizer_hash)
        check_block_sizes(settings.block_sizes, loaded.config.block_size, f"{name} ({path})")
        n = sum(p.numel() for p in loaded.model.parameters())
        keep = kept + n <= KEEP_PARAMS
        kept += n if keep else 0
        loaded_all.append((name, path, loaded if keep else None))
    return loaded_all


def _is_report_dir(path: Path) -> bool:
    """An earlier evaluation's folder (its report.json says so): the only kind overwrite may replace."""
    try:
        return json.loads((path / "report.json").read_text(encoding="utf-8")).get("format") == REPORT_FORMAT
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return False


def evaluate_inputs(
    inputs: Sequence[tuple[str, Path]],
    sources: Sequence[str],
    refs: Sequence[str],
    settings: EvalSettings,
    out_dir: str | os.PathLike,
    *,
    data_info: dict | None = None,
    overwrite: bool = True,
    plots: bool = True,
    command: str | None = None,
    expect_tokenizer_hash: str | None = None,
    loaded: list | None = None,
    distilled_dir: str | os.PathLike | None = None,
    quality: tuple[Sequence, Sequence] | None = None,
) -> dict:
    """Evaluate every (name, path) and write the report folder atomically. Returns the report dict.
    `loaded`: what load_inputs(inputs, settings) returned, if the caller already called it.
    `distilled_dir`: a distillation corpus whose teacher is reported as a comparison point.
    `quality`: (sources, references) to score greedy output on (each checkpoint's and the teacher's BLEU/chrF,
    the base comparison and the recommended run) when they are more than the timed `sources`; None: those."""
    if not sources:
        raise EvalError("no sentences to evaluate (empty split or max_sentences=0)")
    if len(sources) != len(refs):
        raise EvalError(f"{len(sources)} sources but {len(refs)} references")
    if quality is not None and (not quality[0] or len(quality[0]) != len(quality[1])):
        raise EvalError(f"{len(quality[0])} quality sources but {len(quality[1])} references")
    out_dir = Path(out_dir)
    info = data_info or {}
    if info.get("prompts"):  # prompt/response records: the sources are prompts already
        info = {k: v for k, v in info.items() if k not in ("src_lang", "tgt_lang")}
    device = settings.torch_device()
    loaded_all = list(loaded) if loaded is not None else load_inputs(inputs, settings, expect_tokenizer_hash)
    t0 = time.time()
    checkpoints, rows = [], []
    with atomic_dir(out_dir, overwrite=overwrite, replaceable=_is_report_dir) as tmp:
        shown = (s if isinstance(s, str) else json.dumps(s, ensure_ascii=False) for s in sources)  # a chat: JSON
        atomic_write_text(tmp / "src.txt", "".join(one_line(s) + "\n" for s in shown))
        atomic_write_text(tmp / "ref.txt", "".join(one_line(r) + "\n" for r in refs))
        for i, (name, path, loaded) in enumerate(loaded_all):
            if loaded is None:
                loaded = load(path, map_location="cpu", expect_tokenizer_hash=expect_tokenizer_hash)
            loaded_all[i] = (name, path, None)  # free each model once evaluated
            entry, r = evaluate_loaded(
                loaded,
                name,
                sources,
                refs,
                settings,
                tmp,
                extra={"source_id": path.id, "input": str(path), "wandb": _wandb_ids(path, loaded.meta or {})},
                langs=(info.get("src_lang"), info.get("tgt_lang")),
                quality=quality,
            )
            del loaded
            checkpoints.append(entry)
            rows += r
        q_src, q_refs = quality if quality is not None else (sources, refs)
        teacher = evaluate_teacher(distilled_dir, q_src, q_refs, settings, tmp) if distilled_dir else None
        report = {
            "format": REPORT_FORMAT,
            "format_version": 1,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "seconds": time.time() - t0,
            "command": command or " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
            "data": {**(data_info or {}), "sentences": len(sources), "quality_sentences": len(q_src)},
            "settings": settings.as_dict(),
            "environment": {
                "device": _device_name(device),
                "cpu": cpu_model(),
                "engine": engine_name(),
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "python": platform.python_version(),
            },
            "signatures": {
                "bleu": checkpoints[0]["greedy"]["bleu_signature"],
                "chrf": checkpoints[0]["greedy"]["chrf_signature"],
            },
            "files": {"sources": "src.txt", "references": "ref.txt"},
            "checkpoints": checkpoints,
            "rows": rows,
            "teacher": teacher,
        }
        add_comparisons(report)
        write_report(report, tmp, plots=plots)
    return report


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return f"cpu ({platform.processor() or platform.machine()})"


def _wandb_ids(path: Path, meta: dict) -> dict | None:
    """The W&B run a checkpoint was trained in: from its metadata, else from a wandb/ folder in its run folder."""
    rid = meta.get("wandb_run_id") or (meta.get("training") or {}).get("wandb_run_id")
    project = meta.get("wandb_project") or (meta.get("training") or {}).get("wandb_project")
    run_dir = None
    p = Path(path)
    for cand in (p if p.is_dir() else p.parent, p.parent, p.parent.parent):
        if (cand / "wandb").is_dir():
            run_dir = cand
            break
    if rid is None and run_dir is not None:
        found = sorted((run_dir / "wandb").glob("*run-*-*"), key=lambda d: d.stat().st_mtime)
        if found:
            rid = found[-1].name.rsplit("-", 1)[-1]
    if rid is None:
        return None
    return {"id": rid, "project": project, "dir": str(run_dir) if run_dir else None}
