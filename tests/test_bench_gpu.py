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
        assert row["greedy_ms"] > 0 and all(row[f"k{k}_greedy_steps"] > 0 for k in (2, 4, 8)) and row["passes"] == 3
        lo, hi = row["k4_greedy_steps_range"]
        assert lo <= row["k4_greedy_steps"] <= hi
    assert set(s["step_cost"]["eager"]) == {"tiny_b1", "tiny_b4"}
    lm = s["lm_step_cost"]["eager"]
    assert set(lm) == {"tiny_lm_b1", "tiny_lm_b8"} and all(r["k8_greedy_steps"] > 0 for r in lm.values())
    assert all(
        v["agreement"] == 1.0
        and v["speedup"] == v["speedup_spread"]["median"] > 0
        and v["reps"] == 3
        and 1.0 <= v["mean_accepted"] <= v["k"]
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
        row = gpu.cost_row(gpu.step_times(bench.steps(), "cpu", calls=2))
        assert row["greedy_ms"] > 0 and row["k2_greedy_steps"] > 0 and row["k4_greedy_steps"] > 0


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


class Device:
    """A fake asynchronous device: timed code only queues work, and the clock moves by it when sync() waits."""

    def __init__(self):
        self.now, self.queued = 0.0, []

    def clock(self) -> float:
        return self.now

    def sync(self, device=None) -> None:
        self.now += sum(self.queued)
        self.queued.clear()

    def step(self, seconds, log=None, name=None):
        """A step function that queues seconds(call) of work per call."""
        n = {"i": 0}

        def fn():
            self.queued.append(seconds(n["i"]) if callable(seconds) else seconds)
            n["i"] += 1
            if log is not None:
                log.append(name)

        return fn


def test_step_costs_are_the_median_pass_with_every_step_synchronised(monkeypatch):
    gpu = _gpu_module("gpu_decode")
    dev = Device()
    monkeypatch.setattr(gpu, "sync", dev.sync)  # what torch.cuda.synchronize does for the real steps
    log = []
    # 4 calls a pass: calls 0-3 are the warm-up, 4-7 the first timed pass (k4 100x faster there)
    fns = {
        "greedy": dev.step(1e-3, log, "greedy"),
        "k4": dev.step(lambda i: 1.5e-5 if 4 <= i < 8 else 1.5e-3, log, "k4"),
    }
    row = gpu.cost_row(gpu.step_times(fns, "cpu", calls=4, clock=dev.clock))
    assert log.count("greedy") == log.count("k4") == 4 * 4  # a warm-up pass and 3 timed ones
    assert log[:8].count("k4") == 4 and all(len(set(log[i : i + 2])) == 2 for i in range(0, len(log), 2))
    assert row["greedy_ms"] == pytest.approx(1.0) and row["passes"] == 3
    assert row["k4_greedy_steps"] == pytest.approx(1.5)  # the median pass, not the fast one
    assert row["k4_greedy_steps_range"] == pytest.approx([0.015, 1.5])


def test_gpu_speedup_is_the_median_over_batches_with_every_call_synchronised(monkeypatch):
    from bpd_train.decoding import DecodeResult

    gpu = _gpu_module("gpu_decode")
    dev = Device()
    monkeypatch.setattr(gpu, "sync", dev.sync)
    log = []

    def decoder(name, seconds, hist):
        n = {"i": 0}

        def run(src):
            dev.queued.append(seconds(n["i"]) if callable(seconds) else seconds)
            n["i"] += 1
            log.append((name, src))
            return DecodeResult([[src] * 4], calls=4 // max(hist), mean_accepted=max(hist), accepted_hist=hist)

        return run

    batches = [1, 2, 3, 4]
    # blockwise's first timed pass (calls 4-7) 1000x faster; batch 4 slower than the rest
    block_s = lambda i: 0.00025 if 4 <= i < 8 else (0.5 if i % 4 == 3 else 0.25)  # noqa: E731
    row = gpu.race(decoder("g", 1.0, {1: 4}), decoder("b", block_s, {4: 1}), batches, 4, "cpu", clock=dev.clock)
    assert [n for n, _ in log[:8]].count("g") == 4  # a full warm-up pass first
    timed = log[8:]
    assert len(timed) == 3 * 2 * 4 and all(timed[i][1] == timed[i + 1][1] for i in range(0, len(timed), 2))
    assert {timed[i][0] for i in range(0, len(timed), 2)} == {"g", "b"}  # each goes first in turn
    assert row["speedup"] == pytest.approx(4.0)  # the median over batches: 4, 4, 4 and 2
    assert row["speedup_spread"]["min"] == pytest.approx(2.0) and row["speedup_spread"]["max"] == pytest.approx(4.0)
    assert row["greedy_ms_per_batch"] == pytest.approx(1000.0) and row["reps"] == 3
    assert row["agreement"] == 1.0 and row["mean_accepted"] == pytest.approx(4.0) and row["calls"] == 4
    with pytest.raises(ValueError, match="at least 3"):
        gpu.race(decoder("g", 1.0, {1: 4}), decoder("b", 0.25, {4: 1}), batches, 4, "cpu", reps=2, clock=dev.clock)
