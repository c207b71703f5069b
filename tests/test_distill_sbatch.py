"""slurm/distill.sbatch without a cluster: fake sbatch/srun on PATH record what the script asks for
(the real-cluster run is tests/test_slurm.py)."""

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "slurm" / "distill.sbatch"


def _fake_bin(tmp: Path) -> Path:
    b = tmp / "bin"
    b.mkdir()
    for name, reply in (("sbatch", 'echo "$((1000 + $(wc -l < "$LOG")));cluster"'), ("srun", "true")):
        f = b / name
        f.write_text(f'#!/bin/bash\necho "{name} $*" >> "$LOG"\n{reply}\n')
        f.chmod(0o755)
    return b


def _env(tmp: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{_fake_bin(tmp)}:{env['PATH']}", LOG=str(tmp / "calls.log"), LOG_DIR=str(tmp / "logs"), **extra)
    return env


def test_submit_mode_makes_array_and_dependent_verify(tmp_path):
    r = subprocess.run(
        ["bash", str(SCRIPT), "experiment=smoke", "distill.limit=10"],
        env=_env(tmp_path, ARRAY_TASKS="4", GPUS_PER_TASK="0", PARTITION="debug"),
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    calls = (tmp_path / "calls.log").read_text().splitlines()
    assert len(calls) == 2
    array, verify = calls
    assert "--array=0-3" in array and "--partition=debug" in array and "--gpus-per-task" not in array
    assert array.endswith(f"{SCRIPT} experiment=smoke distill.limit=10")
    assert "--dependency=afterok:1001" in verify and "DISTILL_ACTION=verify" in verify and "--array" not in verify
    assert "array job: 1001" in r.stdout and "verify job: 1002" in r.stdout


def test_job_modes_run_workers_then_verify(tmp_path):
    py = tmp_path / "python"
    py.write_text('#!/bin/bash\necho "python $*" >> "$LOG"\n')
    py.chmod(0o755)
    env = _env(
        tmp_path,
        SLURM_JOB_ID="7",
        SLURM_ARRAY_TASK_ID="1",
        SLURM_ARRAY_TASK_COUNT="4",
        SLURM_SUBMIT_DIR=str(REPO),
        PYTHON=str(py),
    )
    assert subprocess.run(["bash", str(SCRIPT), "experiment=smoke"], env=env, cwd=tmp_path).returncode == 0
    env["DISTILL_ACTION"] = "verify"
    assert subprocess.run(["bash", str(SCRIPT), "experiment=smoke"], env=env, cwd=tmp_path).returncode == 0
    run, verify = (tmp_path / "calls.log").read_text().splitlines()
    assert run.startswith("srun --kill-on-bad-exit=1") and "distill.py experiment=smoke distill.action=run" in run
    assert "distill.verify=false" in run
    assert verify == "python distill.py experiment=smoke distill.action=verify"
