"""An install from a source distribution works from any directory: `python -m build --sdist` carries the configs
and the bundled corpus (MANIFEST.in), a wheel built from that sdist ships them (bpd_train/_build.py), its console
scripts run the smoke chain (train base, train heads, export, translate) from an empty directory, and config typos
are still one line. The fresh venv reuses this environment's packages (a .pth line; no download), so only
bpd-train itself comes from the wheel, and the wheel's requirements must admit them (torch 2.13 among them)."""

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from importlib import metadata
from pathlib import Path

import pytest

from conftest import REPO_ROOT, offline_env

pytestmark = pytest.mark.slow


def _source_tree(dest: Path) -> None:
    """A copy of what a clone holds (tracked and untracked files, not ignored ones): an in-tree build leaves build/
    and *.egg-info in the checkout."""
    try:
        names = (
            subprocess.run(
                ["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO_ROOT, capture_output=True, check=True
            )
            .stdout.decode()
            .split("\0")
        )
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of the clone's files")
    for name in filter(None, names):
        src = REPO_ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def _sdist(src: Path, out: Path) -> Path:
    """`python -m build --sdist --no-isolation` (the dev extra installs `build`); without it, the same PEP 517 hook
    of setuptools that build calls."""
    try:
        import build  # noqa: F401

        cmd = [sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(out), str(src)]
    except ImportError:
        cmd = [sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})"]
    out.mkdir()
    r = subprocess.run(cmd, cwd=src, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    (sdist,) = out.glob("bpd_train-*.tar.gz")
    return sdist


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    _source_tree(src)
    sdist = _sdist(src, tmp / "dist")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for needed in (
        "LICENSE",
        "conf/train.yaml",
        "conf/experiment/smoke.yaml",
        "data/README.md",
        "data/bible-en-fr/train.jsonl.gz",
        "bpd_train/py.typed",
        "bpd_train/engine/csrc/linear.cpp",
    ):
        assert needed in names, f"the sdist lacks {needed}"
    wheels = tmp / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(sdist),
        ],
        check=True,
        capture_output=True,
        timeout=300,
        cwd=tmp,
    )
    (wheel,) = wheels.glob("bpd_train-*.whl")
    env_dir = tmp / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=300)
    site = next(env_dir.glob("lib/python*/site-packages"))
    # this environment's packages (torch, lightning, ...) but not its editable bpd_train: a plain path line does
    # not run that folder's own .pth files
    (site / "zz_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(env_dir / "bin" / "python"),
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return env_dir / "bin"


def test_wheel_requirements_admit_the_tested_versions(venv):
    """The installed wheel's ranges hold for the versions this environment runs (constraints.txt's), torch 2.13."""
    from packaging.requirements import Requirement

    r = subprocess.run(
        [
            str(venv / "python"),
            "-c",
            "from importlib import metadata; print('\\n'.join(metadata.requires('bpd-train')))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=offline_env(),
    )
    assert r.returncode == 0, r.stderr
    reqs = [Requirement(line) for line in r.stdout.splitlines() if line.strip()]
    core = [q for q in reqs if q.marker is None]
    assert {q.name for q in core} >= {"torch", "lightning", "hydra-core"}
    for q in core:
        have = metadata.version(q.name)
        assert q.specifier.contains(have, prereleases=True), f"{q} does not admit the installed {q.name} {have}"
    (torch_req,) = [q for q in core if q.name == "torch"]
    assert torch_req.specifier.contains("2.13.0") and not torch_req.specifier.contains("2.14.0")


def _run(bin_dir, cwd, *cmd, stdin=None):
    env = offline_env(PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [str(bin_dir / cmd[0]), *cmd[1:]], cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=600
    )


def test_installed_package_runs_the_smoke_chain_elsewhere(venv, tmp_path):
    where = _run(venv, tmp_path, "python", "-c", "import bpd_train; print(bpd_train.__file__)")
    assert str(REPO_ROOT) not in where.stdout and "site-packages" in where.stdout, where.stdout + where.stderr
    small = ["experiment=smoke", "data.limit.train=300", "callbacks.blockwise_eval.enabled=false"]
    # the base through make demo's driver (its stages run the package's commands), the rest by hand
    r = _run(
        venv,
        tmp_path,
        "python",
        "-m",
        "bpd_train.pipeline",
        "--experiment",
        "smoke",
        "--stage",
        "base",
        *small[1:],
        "trainer.max_steps=2",
        "trainer.val_check_interval=2",
    )
    assert r.returncode == 0 and "=== base: done" in r.stdout, r.stdout[-2000:] + r.stderr[-3000:]
    corpus = tmp_path / "artifacts" / "smoke" / "bible_en_fr"  # under the working directory, not site-packages
    assert (corpus / "base" / "checkpoints" / "last.ckpt").is_file()
    r = _run(
        venv, tmp_path, "bpd-train", "+regime=frozen", *small, "trainer.max_steps=2", "trainer.val_check_interval=2"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r = _run(venv, tmp_path, "bpd-export", "experiment=smoke", "export.report=null")
    assert r.returncode == 0, r.stderr[-3000:]
    bundle = corpus / "export" / "frozen-k4"
    r = _run(venv, tmp_path, "bpd-translate", "--bundle", str(bundle), stdin="In the beginning.\n")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 1 and "k̂=" in r.stderr, r.stderr[-3000:]
    r = _run(venv, tmp_path, "bpd-train", "+regime=base", "+loss.p1weight=0.5")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: unknown config key 'loss.p1weight': '+' adds a key that nothing reads (did you mean loss.p1_weight?);"
        " see bpd-train --help"
    ], r.stderr
    assert not (Path(where.stdout.strip()).parent / "artifacts").exists()
