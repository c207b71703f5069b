"""Sequence-level distillation: a teacher's beam search re-translates a corpus split into shards.

On-disk format, manifest, find/load: ``bpd_train.data.distilled``. The job: ``job.run`` (what
``python distill.py`` calls). Which shards a process takes: ``workers.detect_worker``.
"""

from bpd_train.data.distilled import DistillError, find_distilled_corpus, load_distilled_corpus
from bpd_train.distillation import job as _job
from bpd_train.distillation.job import Job, prepare, run, run_worker
from bpd_train.distillation.workers import Worker, detect_worker

__all__ = [
    "DistillError",
    "find_distilled_corpus",
    "load_distilled_corpus",
    "Job",
    "prepare",
    "run",
    "run_worker",
    "translate_ids",
    "Worker",
    "detect_worker",
]


def __getattr__(name: str):
    if name == "translate_ids":  # decoding/batched.py: torch loads on first use
        return _job.translate_ids
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
