"""slurm/*.sbatch and slurm/pipeline.sh without a cluster: fake sbatch/srun record what would be submitted.

pytest tests/test_slurm_scripts.py -q      (fast; the real-cluster runs are in test_slurm.py, marker `slurm`)
"""

from __future__ import annotations

import os
import re
import subprocess
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
    for k in ("PARTITION", "ACCOUNT", "NODES", "GPUS_PER_NODE", "CPUS_PER_TASK", "STRATEGY", "EXPERIMENT",
              "REGIMES", "STAGES", "DISTILL_TASKS", "PYTHON"):
        env.pop(k, None)

    def run(script, *args, **extra_env):
        p = subprocess.run(["bash", str(REPO / script), *args], env={**env, **extra_env}, cwd=REPO,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stdout + p.stderr
        return p.stdout

    def submitted():
        """{job id: [sbatch args]} in submission order."""
        return {int(f.name.split(".")[1]): f.read_text().splitlines()
                for f in sorted(tmp_path.glob("sbatch.*"), key=lambda f: int(f.name.split(".")[1]))}

    run.submitted = submitted
    run.dir = tmp_path
    return run


def _opt(args, name):
    vals = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return vals[-1] if vals else None


def _deps(args):
    d = _opt(args, "dependency")
    return sorted(int(x) for x in d.split(":")[1:]) if d else []


def test_pipeline_dependency_graph_gpu(fake):
    out = fake("slurm/pipeline.sh", "paths.artifacts=/scratch/a", EXPERIMENT="demo", GPUS_PER_NODE="4",
               NODES="2", PARTITION="gpu", ACCOUNT="proj", DISTILL_TASKS="3")
    jobs = dict(kv.split("=") for kv in re.search(r"^jobs: (.*)$", out, re.M).group(1).split())
    assert list(jobs) == ["base", "distill-array", "distill-verify", "frozen", "finetune", "distill", "both",
                          "evaluate", "export"], out
    sub = fake.submitted()
    ids = list(sub)
    base, arr, ver, frozen, finetune, distill, both, ev, ex = ids
    assert re.search(rf"^base\s+{base}$", out, re.M) and re.search(rf"^export\s+{ex}$", out, re.M), out
    for args in sub.values():
        assert _opt(args, "partition") == "gpu" and _opt(args, "account") == "proj"
        assert "--parsable" in args
    # training: multi-node, one task per GPU, the sbatch file, experiment + user overrides, regime
    b = sub[base]
    assert (_opt(b, "nodes"), _opt(b, "ntasks-per-node"), _opt(b, "gpus-per-node")) == ("2", "4", "4")
    assert b[-4:] == ["slurm/train.sbatch", "+regime=base", "experiment=demo", "paths.artifacts=/scratch/a"]
    assert _deps(b) == []
    # distillation: array after base, then verify after the array, one GPU per task
    a = sub[arr]
    assert _opt(a, "array") == "0-2" and _opt(a, "gpus-per-task") == "1" and _deps(a) == [base]
    assert "slurm/distill.sbatch" in a
    v = sub[ver]
    assert _deps(v) == [arr] and "DISTILL_ACTION=verify" in _opt(v, "export") and "slurm/distill.sbatch" in v
    # heads: gold-data regimes after base only, distilled-data regimes after the verified corpus
    assert _deps(sub[frozen]) == [base] and _deps(sub[finetune]) == [base]
    assert _deps(sub[distill]) == sorted([base, ver]) and _deps(sub[both]) == sorted([base, ver])
    for jid, r in ((frozen, "frozen"), (finetune, "finetune"), (distill, "distill"), (both, "both")):
        assert f"+regime={r}" in sub[jid] and _opt(sub[jid], "job-name") == f"bpd-{r}"
    # evaluate after every training job, on one GPU; export after evaluate
    assert _deps(sub[ev]) == sorted([base, frozen, finetune, distill, both])
    assert _opt(sub[ev], "gpus-per-node") == "1" and "slurm/evaluate.sbatch" in sub[ev]
    assert ev in _deps(sub[ex]) and "export.py" in _opt(sub[ex], "wrap")
    for jid in ids[1:]:
        assert "--kill-on-invalid-dep=yes" in sub[jid]


def test_pipeline_cpu_only_has_no_gres(fake):
    fake("slurm/pipeline.sh", EXPERIMENT="smoke", GPUS_PER_NODE="0", CPUS_PER_TASK="1", REGIMES="frozen")
    sub = fake.submitted()
    assert len(sub) == 4  # base, frozen, evaluate, export: no distillation corpus needed
    for args in sub.values():
        assert not any("gpu" in a or "gres" in a for a in args), args
        assert "experiment=smoke" in args or "experiment=smoke" in (_opt(args, "wrap") or "")
    assert _opt(sub[min(sub)], "ntasks-per-node") == "1"


def test_pipeline_stages_subset(fake):
    fake("slurm/pipeline.sh", STAGES="heads evaluate", REGIMES="distill", GPUS_PER_NODE="0")
    sub = fake.submitted()
    first, ev = sub
    assert "+regime=distill" in sub[first] and _deps(sub[first]) == []  # artifacts assumed to exist
    assert _deps(sub[ev]) == [first]


def test_train_sbatch_submit_mode(fake):
    out = fake("slurm/train.sbatch", "+regime=base", "model=big", GPUS_PER_NODE="8", NODES="4",
               STRATEGY="deepspeed_zero2")
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
    argv = _job_mode(fake, "+regime=base", SLURM_JOB_NUM_NODES="2", SLURM_NTASKS_PER_NODE="4(x2)",
                     SLURM_NTASKS="8", SLURM_GPUS_ON_NODE="4")
    assert argv[:3] == ["--kill-on-bad-exit=1", "python", "train.py"]
    assert argv[3:] == ["+regime=base", "trainer.num_nodes=2", "trainer.devices=4", "strategy=ddp"]
    argv = _job_mode(fake, "+regime=both", "strategy=fsdp", "trainer.devices=2", SLURM_JOB_NUM_NODES="1",
                     SLURM_NTASKS_PER_NODE="2", SLURM_NTASKS="2", SLURM_GPUS_ON_NODE="2", STRATEGY="ddp")
    assert argv[3:] == ["+regime=both", "strategy=fsdp", "trainer.devices=2", "trainer.num_nodes=1"]


def test_train_sbatch_job_mode_cpu(fake):
    argv = _job_mode(fake, "+regime=base", "experiment=smoke", SLURM_JOB_NUM_NODES="1",
                     SLURM_NTASKS_PER_NODE="1", SLURM_NTASKS="1", STRATEGY="auto")
    assert argv[3:] == ["+regime=base", "experiment=smoke", "trainer.num_nodes=1", "trainer.devices=1",
                        "trainer=cpu", "strategy=auto"]


@pytest.mark.parametrize("extra", [
    ["trainer.num_nodes=2", "trainer.devices=4", "strategy=ddp"],
    ["experiment=smoke", "trainer.num_nodes=1", "trainer.devices=1", "trainer=cpu"],
    ["experiment=smoke", "trainer.num_nodes=2", "trainer.devices=1", "trainer=cpu", "strategy=ddp"],
])
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
