"""Config typos through the real command lines: one `error:` line naming the closest valid key, exit status 2,
before Hydra makes an output folder; --help lists regimes, experiments and the most used options."""

import re
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, offline_env


def _run(script, *args, tmp):
    cmd = [sys.executable, str(REPO_ROOT / script), *args, f"paths.artifacts={tmp}/art", f"hydra.run.dir={tmp}/hydra"]
    return subprocess.run(cmd, cwd=tmp, env=offline_env(), capture_output=True, text=True, timeout=120)


CASES = {
    "unknown key with +": ("train.py", ["+regime=base", "+loss.p1weight=0.5"], r"'loss.p1weight'.*loss\.p1_weight"),
    "unknown model key with +": ("train.py", ["+regime=base", "+model.blocksize=4"], r"model\.block_size"),
    "unknown key": ("train.py", ["+regime=base", "model.blocksize=4"], r"'model.blocksize'.*model\.block_size"),
    "key under the wrong parent": ("train.py", ["+regime=base", "block_size=4"], r"model\.block_size"),
    "wrong type": (
        "train.py",
        ["+regime=base", "experiment=smoke", "model.block_size=four"],
        r"model\.block_size expects a number, got 'four'",
    ),
    "wrong bool": ("train.py", ["+regime=base", "model.identity_p1=yes please"], r"expects true or false"),
    "unknown regime": ("train.py", ["+regime=distil"], r"regime=distill\b"),
    "unknown experiment": ("train.py", ["+regime=base", "experiment=smok"], r"experiment=smoke\b"),
    "evaluate key": ("evaluate.py", ["evaluate.batch_size=[1]"], r"evaluate\.batch_sizes"),
    "export key": ("export.py", ["export.dtyp=bfloat16"], r"export\.dtype"),
    "distill key": ("distill.py", ["distill.beam=2"], r"distill\.beam_size"),
}


@pytest.mark.parametrize("case", CASES)
def test_config_typo_is_one_line(tmp_path, case):
    script, args, pattern = CASES[case]
    r = _run(script, *args, tmp=tmp_path)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert len(r.stderr.strip().splitlines()) == 1 and re.search(pattern, errors[0]), r.stderr
    assert not (tmp_path / "hydra").exists()  # refused before anything is written


def test_private_regime_group_is_hidden(tmp_path):
    r = _run("train.py", "+regime=distil", tmp=tmp_path)
    assert "_heads" not in r.stderr and "choices: base, both, distill, finetune, frozen, self" in r.stderr


def test_valid_additions_still_compose():
    # keys meant to be added: a new callback (its _target_ and arguments), load_dataset keyword arguments; and a
    # number where a list is the default (decode.max_len), a word for Lightning's devices
    from bpd_train.app.cli import check_config

    check_config(
        "train",
        [
            "+regime=base",
            "experiment=smoke",
            "+callbacks.snap._target_=x.Y",
            "+callbacks.snap.every_n_train_steps=3",
            "+data.hf_kwargs.data_files=f.json",
            "trainer.devices=auto",
            "trainer.val_check_interval=0.5",
        ],
        "python train.py",
    )
    check_config("evaluate", ["decode.max_len=20", "decode.adaptive=0.5"], "python evaluate.py")
    check_config("train", ["+regime=base", "--cfg", "job"], "python train.py")  # Hydra's flags: Hydra's business
    check_config(
        "train", ["-m", "hydra/launcher=slurm", "+regime=frozen,both", "model.block_size=2,4"], "python train.py"
    )  # README's sweep


def test_help_lists_regimes_experiments_options(tmp_path):
    r = subprocess.run(
        [sys.executable, str(REPO_ROOT / "train.py"), "--help"],
        cwd=tmp_path,
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    head = out.split("== Config")[0]
    for regime in ("base", "frozen", "finetune", "distill", "both", "self"):
        assert re.search(rf"^  {regime} +\S", head, re.M), head
    assert "_heads" not in head
    for exp in ("smoke", "demo"):
        assert re.search(rf"^  {exp} +\S", head, re.M)
    assert "model.block_size=K" in head and len(head.splitlines()) < 45
    assert "\nseed: 1234" in out  # then the config
