"""Ranks started all at once (srun, torchrun): only global rank 0 trains the sentencepiece model and fills the
datasets cache; the others wait for it (training/run.py prepare_data_once), then read the caches."""

import subprocess
import sys
import time

import pytest

from conftest import REPO_ROOT, offline_env

pytestmark = pytest.mark.slow  # trains a sentencepiece model and tokenizes the smoke corpus (~50 s on 2 cores)

SCRIPT = """
import logging, sys
from pathlib import Path
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from hydra import compose, initialize_config_dir
import bpd_train
from bpd_train.training.regimes import Regime
from bpd_train.training.run import make_datamodule, prepare_data_once
art = sys.argv[1]
with initialize_config_dir(str(bpd_train.REPO_ROOT / "conf"), version_base="1.3", job_name="t"):
    cfg = compose("train", overrides=["+regime=base", "experiment=smoke", f"paths.artifacts={art}"])
dm = make_datamodule(cfg, Regime.from_cfg(cfg.regime))
run_dir = Path(str(cfg.run_dir))
prepare_data_once(dm, run_dir, timeout=240)
print("PREPARED", flush=True)
dm.setup("fit")
print("SETUP", len(dm.datasets["train"]), dm.tokenizer.hash, flush=True)
"""


def test_only_rank0_trains_the_tokenizer(tmp_path, monkeypatch):
    art = tmp_path / "artifacts"
    procs = {}
    for rank in (1, 0):  # rank 1 first: without the wait it would train the tokenizer itself
        env = offline_env(
            TORCHELASTIC_RUN_ID="prep-test",
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            GROUP_RANK="0",
            LOCAL_WORLD_SIZE="2",
            PYTHONPATH=str(REPO_ROOT),
        )
        procs[rank] = subprocess.Popen(
            [sys.executable, "-c", SCRIPT, str(art)],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        time.sleep(3 if rank == 1 else 0)
    out = {rank: p.communicate(timeout=300)[0] for rank, p in procs.items()}
    assert all(p.returncode == 0 for p in procs.values()), out
    assert "tokenizer: training" in out[0]
    assert "tokenizer: training" not in out[1] and "tokenizer: reusing" in out[1], out[1]
    sizes = {rank: next(line for line in o.splitlines() if line.startswith("SETUP")) for rank, o in out.items()}
    assert sizes[0] == sizes[1]  # same data, same tokenizer
    # train() has rank 0 remove the launch's marker once training ran (every rank passed the wait)
    from lightning.pytorch.utilities import rank_zero_only

    from bpd_train.training.run import clear_data_marker

    markers = list(art.rglob(".data-ready-elastic-prep-test"))
    assert len(markers) == 1
    for k, v in dict(TORCHELASTIC_RUN_ID="prep-test", WORLD_SIZE="2").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    clear_data_marker(markers[0].parent)
    assert not markers[0].exists()
