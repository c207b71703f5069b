"""slurm/*.sbatch and slurm/pipeline.sh without a cluster: fake sbatch/srun record what would be submitted.

pytest tests/test_slurm_scripts.py -q      (fast; the real-cluster runs are in test_slurm.py, marker `slurm`)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# sbatch: print a new id (";cluster" like --parsable does on federations, to test the stripping) and record
# the arguments one per line; srun: record its arguments.
FAKE_SBATCH = """#!/bin/bash
n=$(( $(cat "$FAKE_DIR/n" 2>/dev/null || echo 100) + 1 )); echo $n > "$FAKE_DIR/n"
printf '%s\\n' "$@" > "$FAKE_DIR/sbatch.$n"
echo "$n;local"
"""
FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$FAKE_DIR/srun"
"""


@pytest.fixture
def fake(tmp_path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, text in (("sbatch", FAKE_SBATCH), ("srun", FAKE_SRUN)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PATH=f"{bin_}:{env['PATH']}", FAKE_DIR=str(tmp_path), LOG_DIR=str(tmp_path / "logs"))
    for k in (
        "PARTITION",
        "ACCOUNT",
        "NODES",
        "GPUS_PER_NODE",
        "CPUS_PER_TASK",
        "STRATEGY",
        "EXPERIMENT",
        "REGIMES",
        "STAGES",
        "DISTILL_TASKS",
        "PYTHON",
    ):
        env.pop(k, None)

    def run(script, *args, **extra_env):
        p = subprocess.run(
            ["bash", str(REPO / script), *args],
            env={**env, **extra_env},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout

    def submitted():
        """{job id: [sbatch args]} in submission order."""
        return {
            int(f.name.split(".")[1]): f.read_text().splitlines()
            for f in sorted(tmp_path.glob("sbatch.*"), key=lambda f: int(f.name.split(".")[1]))
        }

    run.submitted = submitted
    run.dir = tmp_path
    return run


def _opt(args, name):
    vals = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return vals[-1] if vals else None


def _deps(args):
    d = _opt(args, "dependency")
    return sorted(int(x) for x in d.split(":")[1:]) if d else []


def _stage(args):
    """The pipeline stage a job runs (its --wrap command), or None."""
    m = re.search(r"--stage (\S+) --launcher slurm$", _opt(args, "wrap") or "")
    return m.group(1) if m else None


def test_pipeline_submits_the_pipelines_own_stages(fake):
    # the stage list and its dependencies are the local driver's (python -m bpd_train.pipeline --print-stages):
    # the demo's teacher and `self` stages, no second copy in the script
    out = fake(
        "slurm/pipeline.sh",
        "paths.artifacts=/scratch/a",
        EXPERIMENT="demo",
        GPUS_PER_NODE="4",
        NODES="2",
        PARTITION="gpu",
        ACCOUNT="proj",
        DISTILL_TASKS="3",
        K="8",
        PYTHON=sys.executable,
    )
    jobs = dict(kv.split("=") for kv in re.search(r"^jobs: (.*)$", out, re.M).group(1).split())
    assert list(jobs) == [
        "base",
        "teacher",
        "distill-corpus-array",
        "distill-corpus-verify",
        "frozen",
        "finetune",
        "distill",
        "both",
        "self-distill-array",
        "self-distill-verify",
        "self",
        "evaluate",
        "export",
    ], out
    sub = fake.submitted()
    jid = {name: int(j) for name, j in jobs.items()}
    for args in sub.values():
        assert _opt(args, "partition") == "gpu" and _opt(args, "account") == "proj" and "--parsable" in args
        wrap = _opt(args, "wrap")
        assert "-m bpd_train.pipeline --experiment demo --k 8 paths.artifacts=/scratch/a --stage" in wrap, wrap
    assert {_stage(sub[j]) for j in jid.values()} == {n.rsplit("-array", 1)[0].rsplit("-verify", 1)[0] for n in jobs}
    # training: multi-node, one task per GPU, and train.sbatch's requeue settings
    b = sub[jid["base"]]
    assert (_opt(b, "nodes"), _opt(b, "ntasks-per-node"), _opt(b, "gpus-per-node")) == ("2", "4", "4")
    assert _opt(b, "signal") == "SIGUSR1@120" and "--requeue" in b and _deps(b) == []
    # the teacher continues the base; its beam-search corpus (array, then verify) waits for it
    assert _deps(sub[jid["teacher"]]) == [jid["base"]]
    a = sub[jid["distill-corpus-array"]]
    assert _opt(a, "array") == "0-2" and _opt(a, "gpus-per-task") == "1" and _deps(a) == [jid["teacher"]]
    v = sub[jid["distill-corpus-verify"]]
    assert _deps(v) == [jid["distill-corpus-array"]] and "DISTILL_ACTION=verify" in _opt(v, "export")
    corpus = jid["distill-corpus-verify"]
    assert _deps(sub[jid["frozen"]]) == [jid["base"]] and _deps(sub[jid["finetune"]]) == [jid["base"]]
    assert _deps(sub[jid["distill"]]) == sorted([jid["base"], corpus]) == _deps(sub[jid["both"]])
    # self: both's own greedy output, then heads from both on it
    assert _deps(sub[jid["self-distill-array"]]) == [jid["both"]]
    assert _deps(sub[jid["self"]]) == sorted([jid["both"], jid["self-distill-verify"]])
    ev, ex = sub[jid["evaluate"]], sub[jid["export"]]
    assert _deps(ev) == sorted(jid[r] for r in ("base", "frozen", "finetune", "distill", "both", "self"))
    assert _opt(ev, "gpus-per-node") == "1" and _deps(ex) == [jid["evaluate"]]
    for j in list(jid.values())[1:]:
        assert "--kill-on-invalid-dep=yes" in sub[j]


def test_pipeline_cpu_only_has_no_gres(fake):
    fake(
        "slurm/pipeline.sh",
        EXPERIMENT="smoke",
        GPUS_PER_NODE="0",
        CPUS_PER_TASK="1",
        REGIMES="frozen",
        PYTHON=sys.executable,
    )
    sub = fake.submitted()
    assert [_stage(a) for a in sub.values()] == ["base", "frozen", "evaluate", "export"]  # no corpus needed
    for args in sub.values():
        assert not any("gpu" in a or "gres" in a for a in args), args
        assert "--experiment smoke" in _opt(args, "wrap")
    assert _opt(sub[min(sub)], "ntasks-per-node") == "1"


def test_pipeline_stages_subset(fake):
    fake(
        "slurm/pipeline.sh",
        STAGES="heads evaluate",
        REGIMES="distill",
        GPUS_PER_NODE="0",
        EXPERIMENT="smoke",
        PYTHON=sys.executable,
    )
    sub = fake.submitted()
    first, ev = sub
    assert _stage(sub[first]) == "distill" and _deps(sub[first]) == []  # artifacts assumed to exist
    assert _deps(sub[ev]) == [first]


def test_stage_job_runs_its_command_through_the_sbatch_file(fake, tmp_path):
    # inside a stage job: the pipeline picks the stage's command and runs train.sbatch's job mode (srun), which
    # adds the allocation's settings
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(
        PATH=f"{fake.dir / 'bin'}:{env['PATH']}",
        FAKE_DIR=str(fake.dir),
        SLURM_JOB_ID="7",
        SLURM_JOB_NUM_NODES="1",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_NTASKS="1",
        PYTHON="python",
        SLURM_SUBMIT_DIR=str(REPO),
        PYTHONPATH=str(REPO),
    )
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "bpd_train.pipeline",
            "--experiment",
            "smoke",
            "--stage",
            "base",
            "--launcher",
            "slurm",
            f"paths.artifacts={tmp_path}/art",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    argv = (fake.dir / "srun").read_text().splitlines()
    assert argv[:3] == ["--kill-on-bad-exit=1", "python", "train.py"]
    assert argv[3:6] == ["+regime=base", "experiment=smoke", f"paths.artifacts={tmp_path}/art"]
    assert "trainer=cpu" in argv


def test_train_sbatch_submit_mode(fake):
    out = fake(
        "slurm/train.sbatch", "+regime=base", "model=big", GPUS_PER_NODE="8", NODES="4", STRATEGY="deepspeed_zero2"
    )
    (args,) = fake.submitted().values()
    assert (_opt(args, "nodes"), _opt(args, "ntasks-per-node"), _opt(args, "gpus-per-node")) == ("4", "8", "8")
    assert "STRATEGY=deepspeed_zero2" in _opt(args, "export")
    assert args[-2:] == ["+regime=base", "model=big"] and "train job: 101" in out
    fake("slurm/train.sbatch", "+regime=base", GPUS_PER_NODE="0")
    args = fake.submitted()[102]
    assert _opt(args, "ntasks-per-node") == "1" and not any("gpu" in a for a in args)


def _job_mode(fake, *args, **env):
    """Run train.sbatch as if inside a job; return what srun was asked to run."""
    fake("slurm/train.sbatch", *args, SLURM_JOB_ID="7", SLURM_SUBMIT_DIR=str(REPO), PYTHON="python", **env)
    return (fake.dir / "srun").read_text().splitlines()


def test_train_sbatch_job_mode_multinode_gpu(fake):
    argv = _job_mode(
        fake,
        "+regime=base",
        SLURM_JOB_NUM_NODES="2",
        SLURM_NTASKS_PER_NODE="4(x2)",
        SLURM_NTASKS="8",
        SLURM_GPUS_ON_NODE="4",
    )
    assert argv[:3] == ["--kill-on-bad-exit=1", "python", "train.py"]
    assert argv[3:] == ["+regime=base", "trainer.num_nodes=2", "trainer.devices=4", "strategy=ddp"]
    argv = _job_mode(
        fake,
        "+regime=both",
        "strategy=fsdp",
        "trainer.devices=2",
        SLURM_JOB_NUM_NODES="1",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_NTASKS="2",
        SLURM_GPUS_ON_NODE="2",
        STRATEGY="ddp",
    )
    assert argv[3:] == ["+regime=both", "strategy=fsdp", "trainer.devices=2", "trainer.num_nodes=1"]


def test_train_sbatch_job_mode_cpu(fake):
    argv = _job_mode(
        fake,
        "+regime=base",
        "experiment=smoke",
        SLURM_JOB_NUM_NODES="1",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_NTASKS="1",
        STRATEGY="auto",
    )
    assert argv[3:] == [
        "+regime=base",
        "experiment=smoke",
        "trainer.num_nodes=1",
        "trainer.devices=1",
        "trainer=cpu",
        "strategy=auto",
    ]


@pytest.mark.parametrize(
    "extra",
    [
        ["trainer.num_nodes=2", "trainer.devices=4", "strategy=ddp"],
        ["experiment=smoke", "trainer.num_nodes=1", "trainer.devices=1", "trainer=cpu"],
        ["experiment=smoke", "trainer.num_nodes=2", "trainer.devices=1", "trainer=cpu", "strategy=ddp"],
    ],
)
def test_job_mode_overrides_compose(extra):
    """What train.sbatch adds is a valid set of overrides for conf/train.yaml (with and without a preset)."""
    from hydra import compose, initialize_config_dir

    import bpd_train  # noqa: F401  (the ${repo_root:} resolver)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["+regime=base", *extra])
    nodes, devices = (int(e.split("=")[1]) for e in extra if e.startswith(("trainer.num_nodes", "trainer.devices")))
    assert (cfg.trainer.num_nodes, cfg.trainer.devices) == (nodes, devices)
    if "trainer=cpu" in extra:
        assert cfg.trainer.accelerator == "cpu"


def test_launcher_config_composes():
    from hydra import compose, initialize_config_dir

    import bpd_train  # noqa: F401

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["+regime=frozen", "hydra/launcher=slurm"], return_hydra_config=True)
    la = cfg.hydra.launcher
    assert la._target_.endswith("SlurmLauncher")
    assert la.additional_parameters.signal == "USR1@120" and la.additional_parameters.requeue is True
    assert la.tasks_per_node == la.gpus_per_node
