"""How the native engine's C++ is laid out and rebuilt, checked without a compiler: linear.cpp is the one
translation unit and includes every part, every part ships in the wheel, and a change to any of them (a header
too) gives the extension a new name, so a stale build is never loaded."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from bpd_train.engine.fastlinear import source_digest

CSRC = Path(__file__).resolve().parent.parent / "bpd_train" / "engine" / "csrc"


def test_linear_cpp_includes_every_part_and_no_file_is_long():
    parts = {p.name for p in CSRC.iterdir() if p.suffix == ".h"}
    included = set(re.findall(r'^#include "([^"]+)"', (CSRC / "linear.cpp").read_text(), re.M))
    assert included == parts
    assert {p.name for p in CSRC.iterdir() if p.suffix == ".cpp"} == {"linear.cpp"}
    for p in CSRC.iterdir():
        lines = len(p.read_text().splitlines())
        assert lines <= 800, (p.name, lines)


def test_the_wheel_ships_the_headers():
    pyproject = (CSRC.parents[2] / "pyproject.toml").read_text()
    assert re.search(r'^"bpd_train\.engine" = \[.*"csrc/\*\.cpp".*"csrc/\*\.h".*\]$', pyproject, re.M)


def test_any_source_change_renames_the_build(tmp_path):
    csrc = tmp_path / "csrc"
    shutil.copytree(CSRC, csrc)
    flags = ["-O3", "-march=native"]
    base = source_digest(csrc, flags)
    assert source_digest(csrc, flags) == base
    assert source_digest(csrc, flags + ["-g"]) != base
    vec = csrc / "vec.h"
    text = vec.read_text()
    vec.write_text(text + "// a comment\n")
    assert source_digest(csrc, flags) != base
    vec.write_text(text)
    assert source_digest(csrc, flags) == base
    (csrc / "extra.h").write_text("#pragma once\n")
    assert source_digest(csrc, flags) != base
    (csrc / "extra.h").unlink()
    (csrc / "notes.txt").write_text("not a source\n")
    assert source_digest(csrc, flags) == base


def test_a_broken_build_fails_the_test_run_where_the_kernels_can_build(tmp_path):
    """Where the CPU and compiler support the kernels, a build that fails stops pytest (exit 1, the reason on one
    line) instead of skipping the exactness suites; BPD_DECODE_ENGINE=torch runs without them."""
    import os
    import subprocess
    import sys

    import pytest

    from conftest import REPO_ROOT, native_expected

    if native_expected() is None:
        pytest.skip("this machine cannot build the native kernels (no AVX2 / FMA or no compiler)")
    (tmp_path / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    shutil.copy(REPO_ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    env = dict(os.environ, BPD_NATIVE_MARCH="no-such-cpu", TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"))
    env["PYTHONPATH"] = str(REPO_ROOT)
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 1, r.stdout[-2000:]
    assert "the native decode kernels did not build although this CPU has AVX2" in r.stdout + r.stderr
    env["BPD_DECODE_ENGINE"] = "torch"
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0 and "native decode kernels: not built" in r.stdout, r.stdout[-2000:]
