"""Two real DDP ranks (gloo, CPU) in a subprocess: each epoch every example exactly once, equal batch counts."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

import bpd_train

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import lightning.pytorch as pl, torch
    from omegaconf import OmegaConf
    import bpd_train
    from bpd_train.data import BPDDataModule
    out, art, hf = sys.argv[1:4]
    torch.set_num_threads(1)
    cfg = OmegaConf.load(os.path.join(bpd_train.REPO_ROOT, "conf/data/bible_en_fr.yaml"))
    cfg.limit = {"train": 301, "validation": 41, "test": 10}
    cfg.spm.vocab_size = 400
    cfg.num_proc = 1

    class M(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))
            self.seen, self.vseen = [], []
        def training_step(self, b, i):
            self.seen.append([self.current_epoch] + b["idx"].tolist())
            return (self.w * b["src"].float().mean()).sum()
        def validation_step(self, b, i):
            self.vseen += b["idx"].tolist()
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    m = M()
    t = pl.Trainer(max_epochs=2, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                   enable_progress_bar=False, enable_checkpointing=False, num_sanity_val_steps=0,
                   use_distributed_sampler=False, enable_model_summary=False)
    dm = BPDDataModule(cfg, art, seed=1, max_tokens=700, cache_dir=hf)
    t.fit(m, datamodule=dm)
    with open(f"{out}.{t.global_rank}", "w") as f:
        json.dump({"seen": m.seen, "vseen": m.vseen, "rows": list(dm.datasets["train"]["row"])}, f)
""")


@pytest.mark.slow
def test_two_ddp_ranks_shard_exactly_once(tmp_path):
    script = tmp_path / "ddp_run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(bpd_train.REPO_ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out"), str(tmp_path / "art"), str(tmp_path / "hf")],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(2)]
    rows = sorted(ranks[0]["rows"])
    assert rows == sorted(ranks[1]["rows"])
    orders = []
    for epoch in range(2):
        per_rank = [[b[1:] for b in r["seen"] if b[0] == epoch] for r in ranks]
        assert len(per_rank[0]) == len(per_rank[1]) > 0
        seen = [i for batches in per_rank for b in batches for i in b]
        assert sorted(seen) == rows  # every example exactly once across the two ranks
        orders.append(per_rank)
    assert orders[0] != orders[1]  # reshuffled between epochs
    # validation (one pass per epoch): each example once per pass across ranks
    assert sorted(ranks[0]["vseen"] + ranks[1]["vseen"]) == sorted(list(range(41)) * 2)
