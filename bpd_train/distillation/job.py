"""The distillation job: re-translate a corpus split with a teacher's beam search into resumable shards.

``run(cfg)`` is what ``python distill.py`` calls. Every worker (process, rank or array task) computes the
same plan, takes its round-robin share of the shards, skips the ones already on disk, decodes the rest
(sorted by length within the shard, token-budget batches, KV-cached batched beam search) and writes each
shard atomically. The worker that sees every shard on disk verifies the corpus and marks it complete;
``distill.action=verify`` does the same on its own (the dependent step of a SLURM job array).
"""

from __future__ import annotations

import logging
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from bpd_train.data.distilled import (
    DEFAULT_COMMAND,
    DistillError,
    TeacherSettings,
    canonical_max_len,
    check_compatible,
    new_manifest,
    our_files,
    read_manifest,
    remove_stale_temps,
    shard_is_done,
    shards_for_worker,
    verify_corpus,
    write_manifest,
)
from bpd_train.distillation.shards import SHARD_WRITERS
from bpd_train.distillation.workers import Worker, detect_worker, worker_device

log = logging.getLogger(__name__)

ACTIONS = ("run", "verify", "plan", "status")
# Overrides that differ between the workers of one corpus; the command stored in the manifest omits them.
_WORKER_KEYS = (
    "distill.worker_index",
    "distill.num_workers",
    "distill.action",
    "distill.verify",
    "distill.device",
    "distill.progress",
    "distill.overwrite",
    "distill.launcher",
    "distill.devices",
    "distill.num_nodes",
    "distill.num_threads",
    "distill.precision",
    "num_threads",
    "hydra.",
)


def command_from_overrides(overrides: Sequence[str], program: str = "python distill.py") -> str:
    keep = [o for o in overrides if not o.lstrip("+~").startswith(_WORKER_KEYS)]
    return " ".join([program, *map(shlex.quote, keep)])


def train_base_command(overrides: Sequence[str]) -> str:
    keep = [o for o in overrides if not o.lstrip("+~").startswith(("distill.", "hydra."))]
    return " ".join(["python train.py +regime=base", *map(shlex.quote, keep)])


# ------------------------------------------------------------------------------------------ decoding


def __getattr__(name: str):
    # translate_ids lives in decoding/batched.py (evaluation calls it too); re-exported here, torch loaded on use
    if name == "translate_ids":
        from bpd_train.decoding.batched import translate_ids

        return translate_ids
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ------------------------------------------------------------------------------------------- the job


@dataclass
class Job:
    cfg: Any
    out_dir: Path
    manifest: dict
    dataset: Any  # the selected split (datasets.Dataset), rows in plan order
    teacher: Any  # checkpoint.LoadedModel (on CPU until a worker needs it)
    command: str


def _resolve_teacher(cfg, overrides: Sequence[str]):
    from bpd_train.sources.checkpoint import CheckpointError
    from bpd_train.sources.loading import PREFIXES, resolve

    d = cfg.distill
    corpus_dir = Path(cfg.paths.artifacts) / cfg.data.name
    if d.teacher:
        if str(d.teacher).startswith(tuple(PREFIXES)):  # hf:<folder or hub id>
            return resolve(str(d.teacher))
        p = Path(str(d.teacher)).expanduser()
        if not p.exists():
            raise DistillError(
                f"teacher {p} does not exist (distill.teacher); pass a checkpoint file, a run "
                "folder, an exported bundle or hf:<folder or hub id>"
            )
        try:
            return resolve(p)
        except CheckpointError as e:
            raise DistillError(f"cannot use {p} as the teacher: {e}") from e
    p = corpus_dir / "base"
    if not p.exists():
        raise DistillError(
            f"no base model at {p} to use as the teacher; make it with "
            f"`{train_base_command(overrides)}`, or pass distill.teacher=PATH"
        )
    return p


def _teacher_sha256(loaded) -> str:
    return loaded.source.id.removeprefix("sha256:")  # checkpoint file, bundle weights or ZeRO model states


def _check_teacher(loaded, cfg, train_split) -> None:
    """Teacher and tokenizer must agree (vocabulary size, special ids), and with the corpus tokenizer. A teacher
    that brings its own tokenizer (hf:..., or a model trained from one) was checked against it when it loaded
    (its ids are not ours: Marian starts with the pad, NLLB with the language); the students then use that
    tokenizer too, which the datamodule checks against this corpus's manifest."""
    if loaded.own_tokenizer:
        return
    loaded.family.check_teacher_ids(loaded)  # the encoder-decoder's: tokenizer pieces and special ids
    if not cfg.distill.get("check_corpus_tokenizer", True):
        return
    corpus_tok = _corpus_tokenizer(cfg, train_split)
    if corpus_tok is None:
        log.warning(
            "corpus '%s' has no tokenizer under %s yet; using the teacher's own (%s)",
            cfg.data.name,
            cfg.paths.artifacts,
            loaded.tokenizer_path,
        )
        return
    from bpd_train.sources.loading import check_tokenizer, tokenizer_hash

    check_tokenizer(
        f"teacher {loaded.source}",
        loaded.tokenizer_hash,
        f"corpus '{cfg.data.name}'",
        corpus_tok,
        tokenizer_hash(corpus_tok),
        error=DistillError,
        hint=" (another corpus or tokenizer setting), and its token ids would not fit the students. Use "
        "a teacher trained on this corpus (or distill.check_corpus_tokenizer=false to keep only "
        "its text).",
    )


def _corpus_tokenizer(cfg, train_split) -> Path | None:
    """The corpus's own tokenizer file for these data settings, if it has been built (never trains one)."""
    from bpd_train.data.tokenizer import spm_settings, tokenizer_key

    key = tokenizer_key(train_split, str(cfg.data.src_lang), str(cfg.data.tgt_lang), spm_settings(cfg.data))
    p = Path(cfg.paths.artifacts) / str(cfg.data.name) / "spm" / key / "spm.model"
    return p if p.is_file() else None


def _select_split(cfg, family):
    """(the split to distill, the corpus's train split): the records a teacher of this family re-decodes (a
    decoder-only teacher may answer the prompts of data.lm.files instead of the translation corpus's)."""
    d = cfg.distill
    try:
        dsd = family.distill_records(cfg)
    except (ValueError, FileNotFoundError) as e:
        raise DistillError(f"cannot load corpus '{cfg.data.name}': {e}") from e
    if d.split not in dsd:
        raise DistillError(
            f"corpus '{cfg.data.name}' has no split '{d.split}' (it has {sorted(dsd)}); set distill.split"
        )
    ds = dsd[d.split]
    if d.limit is not None:
        if int(d.limit) < 1:
            raise DistillError(f"distill.limit must be >= 1 or null, got {d.limit}")
        ds = ds.select(range(min(int(d.limit), len(ds))))
    if len(ds) == 0:
        raise DistillError(f"split '{d.split}' of corpus '{cfg.data.name}' is empty: nothing to distill")
    return ds, dsd.get("train")


def _ids(ds) -> list[str]:
    if "id" in ds.column_names:
        return [str(i) for i in ds["id"]]
    return [str(i) for i in range(len(ds))]


def prepare(cfg, overrides: Sequence[str] = ()) -> Job:
    """Everything that can fail on bad input, checked before anything is written."""
    from bpd_train.sources.checkpoint import CheckpointError
    from bpd_train.sources.loading import load

    d = cfg.distill
    if d.action not in ACTIONS:
        raise DistillError(f"distill.action={d.action!r}; choose one of {', '.join(ACTIONS)}")
    if int(d.beam_size) < 1:
        raise DistillError(f"distill.beam_size must be >= 1, got {d.beam_size}")
    canonical_max_len(d.max_len)
    command = command_from_overrides(overrides)
    teacher_path = _resolve_teacher(cfg, overrides)
    try:
        teacher = load(teacher_path, map_location="cpu")  # a .ckpt, a run folder, a bundle or a ZeRO run
    except CheckpointError as e:
        raise DistillError(f"cannot use {teacher_path} as the teacher: {e}") from e
    family = teacher.family
    temperature = float(d.get("temperature", 0.0) or 0.0)
    family.check_distill(int(d.beam_size), temperature)
    decode_dtype = str(d.get("dtype", "fp32") or "fp32").lower()
    if decode_dtype not in ("fp32", "bf16", "int8"):
        raise DistillError(f"distill.dtype={decode_dtype!r}; use fp32, bf16 or int8")
    if decode_dtype != "fp32" and family.distill_kind != "lm":
        raise DistillError(
            f"distill.dtype={decode_dtype}: only a decoder-only teacher decodes in another precision "
            "(a translation teacher: distill.precision=bf16)"
        )
    ds, train_split = _select_split(cfg, family)
    _check_teacher(teacher, cfg, train_split)
    ids = _ids(ds)
    settings = TeacherSettings(
        teacher_sha256=_teacher_sha256(teacher),
        tokenizer_hash=teacher.tokenizer_hash,
        beam_size=int(d.beam_size),
        length_penalty=family.distill_length_penalty(float(d.length_penalty)),
        max_len=d.max_len,
        split=str(d.split),
        src_lang=str(cfg.data.src_lang),
        tgt_lang=str(cfg.data.tgt_lang),
        kind=family.distill_kind,
        temperature=temperature,
        seed=int(d.get("seed", 0) or 0),
        decode_dtype=decode_dtype,
    )
    corpus_dir = Path(cfg.paths.artifacts) / cfg.data.name
    out_dir = Path(d.output_dir) if d.output_dir else corpus_dir / "distill" / settings.teacher_id
    wanted = new_manifest(
        settings,
        ids,
        int(d.shard_size),
        corpus=str(cfg.data.name),
        teacher_path=teacher.source.spec or str(Path(teacher.source).resolve()),
        limit=None if d.limit is None else int(d.limit),
        command=command,
        vocab_size=int(teacher.config.vocab_size),
    )
    if (out_dir / "manifest.json").exists():
        existing = read_manifest(out_dir)
        if not d.overwrite:
            check_compatible(existing, wanted, out_dir)
            wanted = existing
    elif out_dir.exists() and any(not p.name.startswith(".manifest.json.") for p in out_dir.iterdir()):
        # (another worker may be writing the manifest right now: its temp file is not foreign content)
        raise DistillError(
            f"{out_dir} exists, is not empty and has no manifest.json: not a distilled corpus. "
            "Nothing was changed; choose another distill.output_dir or remove it."
        )
    return Job(cfg, out_dir, wanted, ds, teacher, command)


def _device(cfg, worker: Worker):
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return torch.device(worker_device(cfg.distill.get("device", "auto"), worker, gpus))


def _amp_dtype(cfg, device):
    import torch

    prec = str(cfg.distill.get("precision", "32"))
    if prec in ("32", "fp32", "float32"):
        return None
    if prec in ("bf16", "bf16-mixed", "bfloat16"):
        return torch.bfloat16
    if prec in ("16", "fp16", "16-mixed") and device.type == "cuda":
        return torch.float16
    raise DistillError(f"distill.precision={prec!r}; use 32 or bf16")


def run_worker(job: Job, worker: Worker, device=None) -> dict[str, Any]:
    """Decode this worker's unfinished shards; return counts and speed."""
    d = job.cfg.distill
    m = job.manifest
    mine = [m["shards"][i] for i in shards_for_worker(m["num_shards"], worker.index, worker.count)]
    stale = remove_stale_temps(job.out_dir, [s["file"] for s in mine])
    if stale:
        log.info("removed %d partial shard file(s) left by an interrupted run", stale)
    todo = [s for s in mine if not shard_is_done(job.out_dir, s)]
    stats = {
        "worker": worker.index,
        "workers": worker.count,
        "my_shards": len(mine),
        "skipped": len(mine) - len(todo),
        "decoded_shards": 0,
        "sentences": 0,
        "seconds": 0.0,
    }
    log.info(
        "%s: %d of %d shards are mine, %d already done, %d to decode",
        worker,
        len(mine),
        m["num_shards"],
        stats["skipped"],
        len(todo),
    )
    if not todo:
        return stats
    import torch

    if d.get("num_threads"):  # CPU: on oversubscribed cores OpenMP threads spin waiting for each other
        torch.set_num_threads(int(d.num_threads))
    device = torch.device(device) if device is not None else _device(job.cfg, worker)
    amp = _amp_dtype(job.cfg, device)
    model = job.teacher.model.to(device).eval()
    t0 = time.perf_counter()
    SHARD_WRITERS[job.teacher.family.distill_kind](job, worker, todo, model, stats, device, amp)
    stats["seconds"] = round(time.perf_counter() - t0, 3)
    stats["sentences_per_s"] = round(stats["sentences"] / max(stats["seconds"], 1e-9), 2)
    return stats


def status(out_dir: Path, manifest: dict) -> dict[str, Any]:
    done = [s["index"] for s in manifest["shards"] if (out_dir / s["file"]).is_file()]
    return {
        "out_dir": str(out_dir),
        "complete": bool(manifest.get("complete")),
        "shards": manifest["num_shards"],
        "shards_on_disk": len(done),
        "missing": [s["index"] for s in manifest["shards"] if s["index"] not in done],
    }


def run(cfg, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """The whole job for one worker; returns a summary (also logged)."""
    d = cfg.distill
    if d.action == "verify" and d.output_dir:  # a dependent verify step needs neither teacher nor corpus
        m = verify_corpus(d.output_dir)
        return _done(Path(d.output_dir), m)
    job = prepare(cfg, overrides)
    launcher = str(d.get("launcher", "env"))
    if launcher not in ("env", "lightning"):
        raise DistillError(
            f"distill.launcher={launcher!r}; choose env (one process, torchrun, srun, job arrays) "
            "or lightning (Trainer.predict with DDP over distill.devices)"
        )
    if launcher == "lightning":
        count = int(d.get("devices", 1)) * int(d.get("num_nodes", 1))
    else:
        count = detect_worker(index=d.get("worker_index"), count=d.get("num_workers")).count
    if d.overwrite and job.out_dir.exists():
        if count > 1:
            raise DistillError(
                "distill.overwrite=true with several workers would let them delete each other's "
                "shards; start over with one process (or remove the folder first)"
            )
        ours = our_files(job.out_dir)  # manifest, shards, dead writers' temp files: never a user's file
        log.warning("distill.overwrite=true: removing the %d file(s) of the corpus in %s", len(ours), job.out_dir)
        for p in ours:
            p.unlink(missing_ok=True)
        kept = [p.name for p in job.out_dir.iterdir()]
        if kept:
            log.warning(
                "distill.overwrite=true: kept %d file(s) distillation did not write: %s",
                len(kept),
                ", ".join(sorted(kept)[:5]),
            )
    if d.action == "status":  # looks, writes nothing
        return status(job.out_dir, job.manifest)
    if not (job.out_dir / "manifest.json").exists():
        write_manifest(job.out_dir, job.manifest)
    log.info(
        "distilled corpus: %s (%d examples, %d shards)",
        job.out_dir,
        job.manifest["num_examples"],
        job.manifest["num_shards"],
    )
    if d.action == "plan":  # the folder and its manifest, so that a job array can be sized from num_shards
        return {
            "out_dir": str(job.out_dir),
            "num_shards": job.manifest["num_shards"],
            "num_examples": job.manifest["num_examples"],
            "teacher_id": job.manifest["teacher_id"],
        }
    if d.action == "verify":
        return _done(job.out_dir, verify_corpus(job.out_dir))
    if job.manifest.get("complete") and all(shard_is_done(job.out_dir, s) for s in job.manifest["shards"]):
        log.info("%s is already complete; nothing to do", job.out_dir)
        return _done(job.out_dir, job.manifest, decoded=0)
    if launcher == "lightning":
        stats = _run_lightning(job)
    else:
        stats = run_worker(job, detect_worker(index=d.get("worker_index"), count=d.get("num_workers")))
    # Every worker looks once it is done: the last one to finish sees all shards and verifies (two that
    # finish together both verify, which is harmless: verification is idempotent and writes atomically).
    st = status(job.out_dir, job.manifest)
    if st["missing"]:
        log.info(
            "%d/%d shards on disk; the rest belong to other workers. The last worker to finish verifies "
            "the corpus, or run `%s distill.action=verify`",
            st["shards_on_disk"],
            st["shards"],
            job.command,
        )
        return {**stats, **st}
    if not d.get("verify", True):
        return {**stats, **st}
    return _done(job.out_dir, verify_corpus(job.out_dir), **stats)


def _run_lightning(job: Job) -> dict[str, Any]:
    """Lightning launches and numbers the processes (DDP; Trainer.predict); each one is a worker."""
    import lightning.pytorch as pl

    d = job.cfg.distill
    devices, nodes = int(d.get("devices", 1)), int(d.get("num_nodes", 1))
    dev = str(d.get("device", "auto"))
    accelerator = "auto" if dev == "auto" else dev.split(":")[0]

    class DistillPredict(pl.LightningModule):  # no parameters: Lightning only launches and ranks the processes
        def predict_dataloader(self):
            return [0]

        def predict_step(self, batch, batch_idx):
            w = Worker(self.global_rank, self.trainer.world_size, self.local_rank, "Lightning DDP")
            return run_worker(job, w, device=self.device)

    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        num_nodes=nodes,
        strategy="ddp" if devices * nodes > 1 else "auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    return trainer.predict(DistillPredict(), return_predictions=True)[0]


def _done(out_dir: Path, m: dict, **extra) -> dict[str, Any]:
    bleu = m.get("teacher_bleu") or {}
    log.info("complete: %s — %d examples, teacher BLEU %s vs gold", out_dir, m["num_examples"], bleu.get("bleu"))
    return {
        "out_dir": str(out_dir),
        "complete": bool(m.get("complete")),
        "num_examples": m["num_examples"],
        "teacher_bleu": bleu.get("bleu"),
        **extra,
    }


__all__ = ["run", "prepare", "run_worker", "translate_ids", "Job", "DEFAULT_COMMAND"]  # noqa: F822 - module __getattr__
