"""Which worker am I? One process, torchrun/srun ranks, SLURM job-array tasks, or both at once.

Shards are handed out round-robin over `count` workers (see data.distilled.shards_for_worker); a worker is
(array task) x (rank inside the task): index = task * ranks + rank, count = tasks * ranks. No process group
is needed: workers share nothing but the output folder, so they never wait for each other.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from bpd_train.data.distilled import DistillError


@dataclass(frozen=True)
class Worker:
    index: int
    count: int
    local_rank: int = 0
    source: str = "single process"

    def __str__(self) -> str:
        return f"worker {self.index}/{self.count} ({self.source})"


def _int(env: Mapping[str, str], key: str) -> int | None:
    v = env.get(key)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise DistillError(f"environment variable {key}={v!r} is not an integer") from None


def _ranks(env: Mapping[str, str]) -> tuple[int, int, int, str]:
    """(rank, world, local_rank, source) of the processes inside one job (array task)."""
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is not None and world is not None:  # torchrun, Lightning DDP children, mpirun wrappers
        return rank, world, _int(env, "LOCAL_RANK") or 0, "RANK/WORLD_SIZE"
    # srun: the step's task count (the batch script itself is a one-task step even when the job has more).
    procid = _int(env, "SLURM_PROCID")
    ntasks = _int(env, "SLURM_STEP_NUM_TASKS") or _int(env, "SLURM_NTASKS")
    if procid is not None and ntasks is not None and ntasks > 1:
        return procid, ntasks, _int(env, "SLURM_LOCALID") or 0, "SLURM_PROCID/SLURM_NTASKS"
    return 0, 1, _int(env, "LOCAL_RANK") or 0, "single process"


def _array(env: Mapping[str, str]) -> tuple[int, int] | None:
    """(task index from 0, task count) of a SLURM job array; --array=a-b[:step] works for any a and step."""
    tid, count = _int(env, "SLURM_ARRAY_TASK_ID"), _int(env, "SLURM_ARRAY_TASK_COUNT")
    if tid is None:
        return None
    if count is None:
        raise DistillError(
            "SLURM_ARRAY_TASK_ID is set but SLURM_ARRAY_TASK_COUNT is not; "
            "set both, or distill.worker_index/num_workers"
        )
    lo, hi = _int(env, "SLURM_ARRAY_TASK_MIN"), _int(env, "SLURM_ARRAY_TASK_MAX")
    lo = 0 if lo is None else lo
    step = _int(env, "SLURM_ARRAY_TASK_STEP") or (((hi - lo) // (count - 1)) if hi is not None and count > 1 else 1)
    idx, rem = divmod(tid - lo, max(step, 1))
    if rem or not 0 <= idx < count:
        raise DistillError(
            f"SLURM array task {tid} does not fit --array={lo}-{hi}:{step} with {count} tasks; "
            "use a plain range such as --array=0-7"
        )
    return idx, count


def detect_worker(env: Mapping[str, str] | None = None, index: int | None = None, count: int | None = None) -> Worker:
    """Explicit index/count win (distill.worker_index/num_workers); otherwise the environment decides."""
    env = os.environ if env is None else env
    if (index is None) != (count is None):
        raise DistillError("set both distill.worker_index and distill.num_workers, or neither")
    if index is not None:
        if not 0 <= index < count:
            raise DistillError(f"distill.worker_index={index} must be in [0, num_workers={count})")
        return Worker(index, count, _int(env, "LOCAL_RANK") or 0, "distill.worker_index/num_workers")
    rank, world, local, source = _ranks(env)
    if not 0 <= rank < world:
        raise DistillError(f"rank {rank} is not in [0, {world}) ({source})")
    arr = _array(env)
    if arr is None:
        return Worker(rank, world, local, source)
    task, tasks = arr
    src = "SLURM array" + ("" if world == 1 else f" x {source}")
    return Worker(task * world + rank, tasks * world, local, src)


def worker_device(setting: str, worker: Worker, cuda_count: int) -> str:
    """The device of this worker for distill.device: `auto` and a bare `cuda` spread the workers of a node over
    cuda:0..N-1 by local rank (a bare `cuda` would otherwise put them all on cuda:0); `auto` without GPUs is cpu;
    `cuda:N`, `cpu` and others are taken as given."""
    dev = str(setting)
    if dev == "auto":
        dev = "cuda" if cuda_count > 0 else "cpu"
    if dev == "cuda":
        if cuda_count <= 0:
            raise DistillError("distill.device=cuda but no CUDA device is visible; use distill.device=cpu or auto")
        return f"cuda:{worker.local_rank % cuda_count}"
    return dev
