"""Real SLURM tests on a single-node cluster that the fixture starts on localhost.

pytest -m slurm tests/test_slurm.py -x -q        (needs: bash .ci/install-slurm.sh, and root)

The cluster mechanics first (job array, afterok dependency, requeue on SIGUSR1) with trivial jobs, then
slurm/pipeline.sh with the smoke preset: every stage must complete, and a SIGUSR1 sent to the base training
job must make Lightning save an hpc checkpoint and requeue the job, which then resumes from it.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from slurm_cluster import slurm_cluster  # noqa: F401  (the session fixture)

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parents[1]


def _state(rec: dict) -> str:
    return rec.get("JobState", "?")


def test_array_and_dependency(slurm_cluster, tmp_path):  # noqa: F811
    c = slurm_cluster
    arr = c.sbatch("--array=0-1", f"--output={tmp_path}/a-%A_%a.out",
                   "--wrap", f"echo $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT > {tmp_path}/task$SLURM_ARRAY_TASK_ID")
    dep = c.sbatch(f"--dependency=afterok:{arr}", "--kill-on-invalid-dep=yes", f"--output={tmp_path}/d.out",
                   "--wrap", f"cat {tmp_path}/task0 {tmp_path}/task1 > {tmp_path}/joined")
    bad = c.sbatch(f"--output={tmp_path}/bad.out", "--wrap", "exit 3")
    never = c.sbatch(f"--dependency=afterok:{bad}", "--kill-on-invalid-dep=yes", f"--output={tmp_path}/n.out",
                     "--wrap", f"touch {tmp_path}/never")
    recs = c.wait([arr, dep, bad, never], timeout=120)
    assert [_state(r) for r in recs[arr]] == ["COMPLETED", "COMPLETED"], recs[arr]
    assert _state(recs[dep][0]) == "COMPLETED"
    assert (tmp_path / "joined").read_text().split() == ["0/2", "1/2"]
    assert _state(recs[bad][0]) == "FAILED"
    assert _state(recs[never][0]) == "CANCELLED" and not (tmp_path / "never").exists()


def test_sigusr1_requeue_mechanics(slurm_cluster, tmp_path):  # noqa: F811
    """What Lightning's auto-requeue relies on: --signal reaches the srun step, `scontrol requeue` from
    inside the job requeues it, the restarted job sees SLURM_RESTART_COUNT and appends to its log."""
    c = slurm_cluster
    script = tmp_path / "job.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --requeue
        #SBATCH --signal=SIGUSR1@120
        #SBATCH --open-mode=append
        #SBATCH --output={tmp_path}/job.out
        echo "start restart=${{SLURM_RESTART_COUNT:-0}}"
        if [ "${{SLURM_RESTART_COUNT:-0}}" -ge 1 ]; then echo resumed; exit 0; fi
        srun {sys.executable} -c '
        import os, signal, subprocess, time
        def on_usr1(*_):
            print("got USR1", flush=True)
            subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True)
        signal.signal(signal.SIGUSR1, on_usr1)
        print("ready", flush=True)
        time.sleep(120)
        '
        """))
    jid = c.sbatch(str(script))
    out = tmp_path / "job.out"
    _wait_for(lambda: out.exists() and "ready" in out.read_text(), 60, "the job step to start")
    c.cmd("scancel", "--signal=USR1", jid)  # what SLURM itself sends 120 s before the time limit
    rec = c.wait(jid, timeout=90)[jid][0]
    text = out.read_text()
    assert _state(rec) == "COMPLETED", text
    assert rec["Restarts"] == "1", rec
    assert "got USR1" in text and "start restart=0" in text and "start restart=1" in text and "resumed" in text


def _wait_for(cond, timeout: float, what: str, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
