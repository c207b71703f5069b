"""bench/gpu.sh and bench/gpu.py on a CPU-only machine: the scripts parse, skip cleanly without CUDA, and the
decoding checks they run on the GPU work for real here at tiny sizes (--device cpu --quick)."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO_ROOT, offline_env

BENCH = REPO_ROOT / "bench"


def _gpu_module(name: str = "gpu"):
    """bench/gpu.py (or its decoding sections, bench/gpu_decode.py) loaded from its file, as the script runs."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("script", ["gpu.sh", "gpu_wheels.sh"])
def test_shell_scripts_parse(script):
    r = subprocess.run(["bash", "-n", str(BENCH / script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_sh_skips_cleanly_without_cuda():
    env = offline_env(PYTHON=sys.executable)
    env.pop("OUT", None)
    r = subprocess.run(
        ["bash", str(BENCH / "gpu.sh")], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["bench"] == "gpu" and "no CUDA" in out["skipped"] and out["ok"] is None


def test_cpu_quick_run_exercises_every_cpu_section(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            str(BENCH / "gpu.py"),
            "--device",
            "cpu",
            "--quick",
            "--out-dir",
            str(tmp_path),
            "--demo-dir",
            str(tmp_path / "no-demo"),
        ],
        cwd=REPO_ROOT,
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 1, lines[:-1]  # progress goes to stderr; stdout is the one JSON line
    out = json.loads(lines[0])
    assert out["ok"] is True and out["errors"] == {}
    assert json.loads((tmp_path / "gpu.json").read_text()) == out
    s = out["sections"]
    ex = s["exactness"]
    assert ex["ok"] and ex["mismatched_rows"] == 0 and ex["cases"] >= 6 and ex["mean_accepted"] > 1.2
    for row in s["step_cost"]["eager"].values():
        assert row["greedy_ms"] > 0 and all(row[f"k{k}_greedy_steps"] > 0 for k in (2, 4, 8))
    assert set(s["step_cost"]["eager"]) == {"tiny_b1", "tiny_b4"}
    lm = s["lm_step_cost"]["eager"]
    assert set(lm) == {"tiny_lm_b1", "tiny_lm_b8"} and all(r["k8_greedy_steps"] > 0 for r in lm.values())
    assert all(
        v["agreement"] == 1.0 and v["speedup"] > 0 and 1.0 <= v["mean_accepted"] <= v["k"]
        for k, v in s["speedup"].items()
        if k != "s"
    )
    assert s["demo"]["present"] is False
    assert "CUDA only" in s["train"]["skipped"] and "CUDA only" in s["compile"]["skipped"]


def test_exactness_check_reports_mismatches_of_a_relaxed_rule():
    """TopK(3) accepts proposals greedy would not have chosen: the same check must say so."""
    from bpd_train.decoding import Exact, TopK

    gpu = _gpu_module("gpu_decode")
    bad = gpu.check_exactness("cpu", quick=True, accept=TopK(3))
    assert bad["ok"] is False and bad["mismatched_rows"] > 0 and bad["mismatches"]
    m = bad["mismatches"][0]
    assert m["greedy"] != m["blockwise"]
    assert gpu.check_exactness("cpu", quick=True, accept=Exact())["ok"] is True


def test_step_bench_measures_the_same_work_as_decoding():
    """The timed block step verifies with head 1 at the k positions: its first verified token is the greedy
    step's token, and neither step moves the cache (so repeated timings do the same work)."""
    gpu = _gpu_module("gpu_decode")
    for sizes, lengths in ((gpu.QUICK_SIZES, 5), (gpu.QUICK_LM_SIZES, 0)):  # an LM's prefix is its cached prompt
        (spec,) = sizes.values()
        bench = gpu.StepBench(spec, ks=(2, 4), batch=3, device="cpu", prefix=5)
        with torch.no_grad():
            g = bench.greedy_step()
            for k in (2, 4):
                out = bench.block_step(k)
                assert out.shape == (3, 2 * k - 1)
                assert torch.equal(out[:, 0], g)
                assert bench.state.lengths == lengths
        ms = gpu.interleaved_ms(bench.steps(), "cpu", reps=3, warmup=1)
        assert set(ms) == {"greedy", "k2", "k4"} and all(t > 0 for t in ms.values())


def test_lm_step_bench_decodes_after_the_cached_prompt():
    """The LM bench's steps decode after the cached prompt prefix: head 1's argmax at each of the k positions is
    what a full forward pass over prefix + those tokens gives, and the cache is rolled back after every step."""
    gpu = _gpu_module("gpu_decode")
    bench = gpu.StepBench(gpu.QUICK_LM_SIZES["tiny_lm"], ks=(4,), batch=2, device="cpu", prefix=6)
    assert bench.state.base == 6
    with torch.no_grad():
        full = bench.model(torch.cat([bench.prompt[:, :-1], bench.tokens], dim=1))[:, 6:, 0].argmax(-1)  # [B,4]
        out = bench.block_step(4)
        assert torch.equal(out[:, :4], full)
        assert torch.equal(bench.greedy_step(), full[:, 0]) and bench.state.lengths == 0


def test_bad_section_name_is_one_clear_error():
    r = subprocess.run(
        [sys.executable, str(BENCH / "gpu.py"), "--device", "cpu", "--skip", "trian"],
        cwd=REPO_ROOT,
        env=offline_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "unknown section" in r.stderr and "trian" in r.stderr
    assert r.stdout == ""
