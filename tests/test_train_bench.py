"""bench/train.py runs (quick sizes) and ends with its JSON line."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO_ROOT, offline_env


def test_bench_train_quick_prints_json():
    r = subprocess.run(
        [sys.executable, str(REPO_ROOT / "bench" / "train.py"), "--quick", "--threads", "1"],
        capture_output=True,
        text=True,
        env=offline_env(),
        timeout=300,
        cwd=REPO_ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bench"] == "train"
    assert out["throughput"]["frozen_tokens_per_s"] > 0 and out["throughput"]["finetune_tokens_per_s"] > 0
    assert out["peak_memory"]["random_mb"] > 0 and out["peak_memory"]["mean_mb"] > 0
