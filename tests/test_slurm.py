"""Real SLURM tests on a single-node cluster that the fixture starts on localhost.

pytest -m slurm tests/test_slurm.py -x -q        (needs: bash .ci/install-slurm.sh, and root)

The cluster mechanics first (job array, afterok dependency, requeue on SIGUSR1) with trivial jobs, then
slurm/pipeline.sh with the smoke preset: every stage must complete, and a SIGUSR1 sent to the base training
job must make Lightning save an hpc checkpoint and requeue the job, which then resumes from it.
"""

from __future__ import annotations

import json
import os
import re
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
    arr = c.sbatch(
        "--array=0-1",
        f"--output={tmp_path}/a-%A_%a.out",
        "--wrap",
        f"echo $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT > {tmp_path}/task$SLURM_ARRAY_TASK_ID",
    )
    dep = c.sbatch(
        f"--dependency=afterok:{arr}",
        "--kill-on-invalid-dep=yes",
        f"--output={tmp_path}/d.out",
        "--wrap",
        f"cat {tmp_path}/task0 {tmp_path}/task1 > {tmp_path}/joined",
    )
    bad = c.sbatch(f"--output={tmp_path}/bad.out", "--wrap", "exit 3")
    never = c.sbatch(
        f"--dependency=afterok:{bad}",
        "--kill-on-invalid-dep=yes",
        f"--output={tmp_path}/n.out",
        "--wrap",
        f"touch {tmp_path}/never",
    )
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
    script.write_text(
        textwrap.dedent(f"""\
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
            # Written straight to a file: the requeue kills the step at once, and srun may not have
            # forwarded a print to job.out by then (CI lost "got USR1" that way once).
            with open("{tmp_path}/usr1", "w") as f:
                f.write("got USR1 in job " + os.environ["SLURM_JOB_ID"])
            subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=True)
        signal.signal(signal.SIGUSR1, on_usr1)
        print("ready", flush=True)
        time.sleep(120)
        '
        """)
    )
    jid = c.sbatch(str(script))
    out = tmp_path / "job.out"
    _wait_for(lambda: out.exists() and "ready" in out.read_text(), 60, "the job step to start")
    c.cmd("scancel", "--signal=USR1", jid)  # what SLURM itself sends 120 s before the time limit
    rec = c.wait(jid, timeout=90)[jid][0]
    text = out.read_text()
    assert _state(rec) == "COMPLETED", text
    assert rec["Restarts"] == "1", rec
    usr1 = tmp_path / "usr1"
    assert usr1.exists() and usr1.read_text() == f"got USR1 in job {jid}", text
    assert "start restart=0" in text and "start restart=1" in text and "resumed" in text


def _wait_for(cond, timeout: float, what: str, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(poll)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


# ------------------------------------------------------------------------------------------------ pipeline
ENTRY_POINTS = ("train.py", "distill.py", "evaluate.py", "export.py")
# Two of the four head regimes keep the test inside the suite's budget on 2 CPUs while still covering
# both dependency paths (gold data: after base; distilled data: after the verified corpus).
# BPD_SLURM_REGIMES="frozen finetune distill both" runs all four.
REGIMES = os.environ.get("BPD_SLURM_REGIMES", "frozen both").split()
PIPELINE_TIMEOUT = float(os.environ.get("BPD_SLURM_TIMEOUT", 1500))


def _tail(path: Path, n: int = 40) -> str:
    if not path.exists():
        return f"(no {path})"
    return f"==> {path} <==\n" + "".join(path.read_text(errors="replace").splitlines(True)[-n:])


@pytest.fixture(scope="module")
def pipeline(slurm_cluster, tmp_path_factory):  # noqa: F811
    """slurm/pipeline.sh with the smoke preset on the local cluster; SIGUSR1 to the base training job
    once Lightning has set its signal handlers. Returns what the tests check."""
    missing = [e for e in ENTRY_POINTS if not (REPO / e).exists()]
    if missing:
        pytest.skip(f"entry points not written yet: {' '.join(missing)}")
    c = slurm_cluster
    tmp = tmp_path_factory.mktemp("pipeline")
    logs, artifacts = tmp / "logs", tmp / "artifacts"
    env = dict(
        c.env,
        EXPERIMENT="smoke",
        GPUS_PER_NODE="0",
        CPUS_PER_TASK="1",
        DISTILL_TASKS="2",
        REGIMES=" ".join(REGIMES),
        LOG_DIR=str(logs),
        PYTHON=sys.executable,
        TRAIN_TIME="60:00",
        DISTILL_TIME="30:00",
        EVAL_TIME="30:00",
        EXPORT_TIME="10:00",
        OMP_NUM_THREADS="1",
        BASE_ARGS="progress_bar=tqdm",
    )
    p = subprocess.run(
        ["bash", "slurm/pipeline.sh", f"paths.artifacts={artifacts}", f"paths.outputs={tmp}/outputs"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    m = re.search(r"^jobs: (.*)$", p.stdout, re.M)
    assert m, p.stdout
    ids = dict(kv.split("=") for kv in m.group(1).split())
    assert list(ids) == ["base", "distill-corpus-array", "distill-corpus-verify", *REGIMES, "evaluate", "export"], (
        p.stdout
    )

    # SIGUSR1 once Lightning has set its handlers and a few optimizer steps are done (so the hpc checkpoint
    # is mid-run); PYTHONUNBUFFERED (set by train.sbatch) makes the progress bar reach the log at once.
    base_log = logs / f"bpd-base-{ids['base']}.out"
    deadline = time.monotonic() + 600
    signalled = None
    while time.monotonic() < deadline:
        text = base_log.read_text(errors="replace") if base_log.exists() else ""
        if "SLURM auto-requeueing enabled" in text:
            after_handlers = text.split("SLURM auto-requeueing enabled", 1)[1]
            steps = [int(n) for n in re.findall(r"Epoch 0:[^|\n]*\|[^|\n]*\|\s*(\d+)/", after_handlers)]
            if max(steps, default=0) >= 5:
                c.cmd("scancel", "--signal=USR1", ids["base"])  # = what SLURM sends 120 s before the time limit
                signalled = max(steps)
                break
        if all(s in ("COMPLETED", "FAILED", "CANCELLED") for s in c.states(ids["base"])):
            break
        time.sleep(0.2)
    recs = c.wait(list(ids.values()), timeout=PIPELINE_TIMEOUT, poll=2)
    return dict(
        ids=ids,
        recs=recs,
        logs=logs,
        artifacts=artifacts,
        stdout=p.stdout,
        signalled=signalled,
        corpus=artifacts / "bible_en_fr",
    )


def _job_logs(pl) -> str:
    return "\n".join(_tail(f) for f in sorted(pl["logs"].glob("*.out")))


def test_sigusr1_checkpoints_requeues_and_resumes(pipeline):
    pl = pipeline
    jid = pl["ids"]["base"]
    log = pl["logs"] / f"bpd-base-{jid}.out"
    assert pl["signalled"] is not None, "the base job ended before SIGUSR1 could be sent\n" + _tail(log, 80)
    rec = pl["recs"][jid][0]
    text = log.read_text(errors="replace")
    assert rec["Restarts"] == "1", f"not requeued: {rec}\n" + _tail(log, 80)
    assert rec["JobState"] == "COMPLETED", _tail(log, 80)
    hpc = sorted(pl["corpus"].glob(f"base/hpc/{jid}/hpc_ckpt_*.ckpt"))
    assert hpc, f"no hpc checkpoint under {pl['corpus']}/base/hpc/{jid}\n" + _tail(log, 80)

    import torch

    saved = torch.load(hpc[-1], map_location="cpu", weights_only=True)["global_step"]
    last = torch.load(pl["corpus"] / "base/checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    assert 0 < saved < last["global_step"], (saved, last["global_step"])
    # The first run and the requeued one append to the same log; the second restores the hpc checkpoint.
    assert "restart 0" in text and "restart 1" in text, _tail(log, 80)
    second = text[text.index("restart 1") :]
    assert re.search(r"Restor\w* .*hpc_ckpt_\d+\.ckpt", second), _tail(log, 120)


def test_pipeline_smoke_completes(pipeline):
    pl = pipeline
    bad = {
        name: [r.get("JobState") for r in pl["recs"][jid]]
        for name, jid in pl["ids"].items()
        if any(r.get("JobState") != "COMPLETED" for r in pl["recs"][jid])
    }
    assert not bad, f"stages not completed: {bad}\n{pl['stdout']}\n{_job_logs(pl)}"
    corpus = pl["corpus"]
    assert (corpus / "base/checkpoints/last.ckpt").is_file()
    manifests = list(corpus.glob("distill/*/manifest.json"))
    assert len(manifests) == 1, manifests
    assert json.loads(manifests[0].read_text()).get("complete") is True, manifests[0].read_text()
    k = 4  # experiment=smoke: model.block_size=4
    for r in REGIMES:
        assert list((corpus / f"heads/{r}-k{k}/checkpoints").glob("*.ckpt")), f"no checkpoint for {r}"
    assert list(corpus.glob("eval/*/report.json")), _job_logs(pl)
    assert list(corpus.glob("export/*/model.safetensors")), _job_logs(pl)


def test_hydra_submitit_launcher(slurm_cluster, tmp_path):  # noqa: F811
    """conf/hydra/launcher/slurm.yaml for real: a two-point sweep of a trivial Hydra app runs as a SLURM job
    array with Lightning's requeue signal, on the CPU-only local cluster."""
    c = slurm_cluster
    app = tmp_path / "app.py"
    app.write_text(
        textwrap.dedent(f"""\
        import os
        import hydra

        @hydra.main(version_base="1.3", config_path=None, config_name=None)
        def main(cfg):
            with open(os.path.join({str(tmp_path)!r}, f"point{{cfg.x}}"), "w") as f:
                f.write(os.environ["SLURM_ARRAY_JOB_ID"] + " " + os.environ["SLURM_NTASKS"])
            return cfg.x

        main()
        """)
    )
    sweep = tmp_path / "sweep"
    p = c.cmd(
        sys.executable,
        str(app),
        "-m",
        "hydra/launcher=slurm",
        f"hydra.searchpath=[file://{REPO}/conf]",
        "hydra.launcher.gpus_per_node=null",
        "hydra.launcher.cpus_per_task=1",
        "hydra.launcher.timeout_min=10",
        f"hydra.sweep.dir={sweep}",
        "+x=1,2",
        check=False,
        timeout=180,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    got = [(tmp_path / f"point{x}").read_text().split() for x in (1, 2)]
    assert got[0][0] == got[1][0] and got[0][1] == "1", got  # one array job, one task each
    script = next(sweep.glob(".submitit/*/*_submission.sh")).read_text()
    assert "#SBATCH --signal=USR1@120" in script and "#SBATCH --requeue" in script, script
    assert "gpus" not in script and "gres" not in script, script
