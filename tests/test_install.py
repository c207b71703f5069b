"""`pip install .` (not editable) works from any directory: a wheel built from this tree carries the configs and the
bundled corpus, its console scripts run the smoke chain (train base, train heads, export, translate) from an
empty directory, and config typos are still one line. The fresh venv reuses this environment's packages (a .pth
line; no download), so only bpd-train itself comes from the wheel."""
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from conftest import REPO_ROOT, offline_env

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("install")
    # built from a copy of what the wheel needs: an in-tree build leaves build/ and *.egg-info in the checkout
    src = tmp / "src"
    src.mkdir()
    for rel in ("pyproject.toml", "README.md", "bpd_train", "conf", "data"):
        if (REPO_ROOT / rel).is_dir():
            shutil.copytree(REPO_ROOT / rel, src / rel, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO_ROOT / rel, src / rel)
    wheels = tmp / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(wheels), str(src)], check=True, capture_output=True, timeout=300, cwd=tmp)
    (wheel,) = wheels.glob("bpd_train-*.whl")
    env_dir = tmp / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=300)
    site = next(env_dir.glob("lib/python*/site-packages"))
    # this environment's packages (torch, lightning, ...) but not its editable bpd_train: a plain path line does
    # not run that folder's own .pth files
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install", "-q",
                    "--no-deps", "--no-index", str(wheel)], check=True, capture_output=True, timeout=300)
    return env_dir / "bin"


def _run(bin_dir, cwd, *cmd, stdin=None):
    env = offline_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    return subprocess.run([str(bin_dir / cmd[0]), *cmd[1:]], cwd=cwd, env=env, input=stdin, capture_output=True,
                          text=True, timeout=600)


def test_installed_package_runs_the_smoke_chain_elsewhere(venv, tmp_path):
    where = _run(venv, tmp_path, "python", "-c", "import bpd_train; print(bpd_train.__file__)")
    assert str(REPO_ROOT) not in where.stdout and "site-packages" in where.stdout, where.stdout + where.stderr
    small = ["experiment=smoke", "data.limit.train=300", "callbacks.blockwise_eval.enabled=false"]
    # the base through make demo's driver (its stages run the package's commands), the rest by hand
    r = _run(venv, tmp_path, "python", "-m", "bpd_train.pipeline", "--experiment", "smoke", "--stage", "base",
             *small[1:], "trainer.max_steps=2", "trainer.val_check_interval=2")
    assert r.returncode == 0 and "=== base: done" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    corpus = tmp_path / "artifacts" / "smoke" / "bible_en_fr"  # under the working directory, not site-packages
    assert (corpus / "base" / "checkpoints" / "last.ckpt").is_file()
    r = _run(venv, tmp_path, "bpd-train", "+regime=frozen", *small, "trainer.max_steps=2",
             "trainer.val_check_interval=2")
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run(venv, tmp_path, "bpd-export", "experiment=smoke", "export.report=null")
    assert r.returncode == 0, r.stderr[-3000:]
    bundle = corpus / "export" / "frozen-k4"
    r = _run(venv, tmp_path, "bpd-translate", "--bundle", str(bundle), stdin="In the beginning.\n")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1 and "k̂=" in r.stderr, r.stderr[-3000:]
    r = _run(venv, tmp_path, "bpd-train", "+regime=base", "+loss.p1weight=0.5")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: unknown config key 'loss.p1weight': '+' adds a key that nothing reads (did you mean loss.p1_weight?);"
        " see bpd-train --help"], r.stderr
    assert not (Path(where.stdout.strip()).parent / "artifacts").exists()
