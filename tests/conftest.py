import os

# Offline by default: a stray hub call otherwise hangs on DNS.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import torch  # noqa: E402

# Two cores and several processes (DDP, subprocess runs): one thread each keeps tests from thrashing.
torch.set_num_threads(1)

import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent


def offline_env(**extra: str) -> dict[str, str]:
    """Environment for subprocess runs of the entry points: offline, one thread, shared extension cache."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="offline", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"
    )
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO_ROOT / ".torch_extensions"))
    env.update(extra)
    return env


def run_train(
    *overrides: str, artifacts: Path, timeout: float = 600, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python train.py <overrides> paths.artifacts=<artifacts>` as a subprocess (csv logger, own hydra dir)."""
    name = "-".join(o.split("=", 1)[-1].replace("/", "_") for o in overrides if "regime=" in o) or "run"
    cmd = [
        sys.executable,
        str(REPO_ROOT / "train.py"),
        *overrides,
        f"paths.artifacts={artifacts}",
        f"hydra.run.dir={artifacts.parent}/{artifacts.name}-hydra/{name}",
    ]
    if not any(o.startswith("logger=") for o in overrides):
        cmd.append("logger=csv")
    r = subprocess.run(cmd, cwd=REPO_ROOT, env=env or offline_env(), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
    return r


def copy_smoke_base(smoke_base: tuple[Path, Path], art: Path) -> Path:
    """A private artifacts folder `art` with the session's smoke tokenizer and base run (the shared one stays
    read-only); returns its corpus folder (<art>/<data.name>)."""
    import shutil

    _, base = smoke_base
    corpus = art / base.parent.name
    shutil.copytree(base.parent / "spm", corpus / "spm")
    shutil.copytree(base, corpus / "base", ignore=shutil.ignore_patterns("logs"))
    return corpus


@pytest.fixture(scope="session")
def smoke_base(tmp_path_factory) -> tuple[Path, Path]:
    """One `train.py +regime=base experiment=smoke` run for the whole session: (artifacts_dir, base_run_dir).

    base_run_dir = <artifacts_dir>/<data.name>/base with checkpoints/{best,last}.ckpt, tokenizer.model,
    config.yaml. Treat it as read-only (copy it before changing anything)."""
    artifacts = tmp_path_factory.mktemp("smoke_artifacts")
    run_train("+regime=base", "experiment=smoke", artifacts=artifacts)
    runs = sorted(p.parent for p in artifacts.glob("*/base/checkpoints"))
    assert len(runs) == 1 and (runs[0] / "checkpoints" / "last.ckpt").is_file(), f"no base run in {artifacts}"
    return artifacts, runs[0]


# ------------------------------------------------------------------------------------ the native decode kernels
def native_expected() -> str | None:
    """Why the native kernels must build on this machine (an x86-64 CPU with AVX2 and FMA, a C++ compiler, the
    engine not turned off), or None where skipping their tests is right."""
    import shutil

    if os.environ.get("BPD_DECODE_ENGINE", "auto").strip().lower() == "torch":
        return None
    if os.uname().machine not in ("x86_64", "AMD64"):
        return None
    try:
        flags = next((ln for ln in open("/proc/cpuinfo", encoding="utf-8") if ln.startswith("flags")), "").split()
    except OSError:
        return None
    if not {"avx2", "fma"} <= set(flags):
        return None
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        return None
    return f"this CPU has AVX2 and FMA and {cxx} is installed"


def pytest_sessionstart(session):
    """A broken build fails the run where the kernels can build; they are skipped only where the CPU lacks them."""
    from bpd_train.engine.fastlinear import native_build_error, native_kernels

    why = native_expected()
    if why is not None and native_kernels() is None:
        pytest.exit(
            f"the native decode kernels did not build although {why}: {native_build_error()} "
            "(fix the build; BPD_DECODE_ENGINE=torch runs the suite without them)",
            returncode=1,
        )


def pytest_terminal_summary(terminalreporter):
    from bpd_train.engine.fastlinear import engine_name, native_build_error

    name = engine_name()
    if name != "torch":
        terminalreporter.write_line(f"native decode kernels: built ({name})")
    else:
        reason = native_build_error() or "turned off, or not an x86-64 CPU with AVX2 and FMA"
        terminalreporter.write_line(f"native decode kernels: not built ({reason}); their exactness tests skipped")
