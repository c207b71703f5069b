"""BPDDataModule: batches, ranks from the trainer, distilled source, and mid-epoch resume through Lightning."""

from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from datasets import Dataset
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import OmegaConf

import bpd_train
from bpd_train.data import BPDDataModule, TokenBucketBatchSampler
from bpd_train.data import distilled as distilled_mod

REPO = Path(bpd_train.__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cfg():
    c = OmegaConf.load(REPO / "conf" / "data" / "bible_en_fr.yaml")
    c.limit = {"train": 400, "validation": 60, "test": 60}
    c.spm.vocab_size = 500
    c.num_proc = 1
    return c


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dm")
    return root / "artifacts", root / "hf"


def _dm(cfg, dirs, **kw):
    art, hf = dirs
    dm = BPDDataModule(cfg, art, seed=3, max_tokens=kw.pop("max_tokens", 600), cache_dir=hf, **kw)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def test_batches(cfg, dirs):
    dm = _dm(cfg, dirs)
    assert dm.tokenizer.path.is_file() and dm.tokenizer.path.parent.parent == dirs[0] / "bible_en_fr" / "spm"
    dl = dm.train_dataloader()
    seen = []
    for b in dl:
        B, S = b["src"].shape
        assert b["tgt_in"].shape == b["tgt_out"].shape
        assert B * max(S, b["tgt_in"].shape[1]) <= 600
        assert (b["tgt_in"][:, 0] == 1).all()
        assert ((b["tgt_out"] == 2).sum(1) == 1).all() and ((b["src"] == 2).sum(1) == 1).all()
        # tgt_out is tgt_in shifted left by one, ending in eos
        n = (b["tgt_out"] != 0).sum(1)
        for r in range(B):
            assert torch.equal(b["tgt_in"][r, 1 : n[r]], b["tgt_out"][r, : n[r] - 1])
        seen += b["idx"].tolist()
    assert sorted(seen) == sorted(dm.datasets["train"]["row"])
    val = [i for b in dm.val_dataloader() for i in b["idx"].tolist()]
    assert sorted(val) == list(range(60))
    row = dm.datasets["validation"][0]
    assert dm.tokenizer.decode(row["src"]) == dm.corpus["validation"][row["row"]]["translation"]["en"]


def test_loaders_pin_host_memory_where_batches_go_to_a_gpu(cfg, dirs, monkeypatch):
    dm = _dm(cfg, dirs)
    assert not dm.train_dataloader().pin_memory or torch.cuda.is_available()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert dm.train_dataloader().pin_memory and dm.val_dataloader().pin_memory


def test_ranks_come_from_the_trainer(cfg, dirs):
    dm = _dm(cfg, dirs)
    conn = SimpleNamespace(use_distributed_sampler=False)
    dm.trainer = SimpleNamespace(world_size=3, global_rank=2, _accelerator_connector=conn)
    s = dm.train_dataloader().batch_sampler
    assert isinstance(s, TokenBucketBatchSampler) and (s.num_replicas, s.rank) == (3, 2)
    lens = set()
    for r in range(3):
        dm.trainer.global_rank = r
        lens.add(len(dm.train_dataloader()))
    assert len(lens) == 1
    conn.use_distributed_sampler = True
    with pytest.raises(ValueError, match="use_distributed_sampler=False"):
        dm.train_dataloader()


def test_distilled_source_uses_teacher_ids(cfg, dirs, monkeypatch):
    gold = _dm(cfg, dirs)
    tok = gold.tokenizer
    rows = [
        {
            "id": str(i),
            "translation": {"en": f"word {i}", "fr": f"teacher {i}"},
            "teacher_ids": tok.encode(f"mot {i}") + [tok.eos_id],
            "teacher_score": -1.0,
            "gold": "x",
        }
        for i in range(20)
    ]
    rows[3]["teacher_ids"] = [tok.eos_id]  # an empty translation: dropped by min_len and counted
    monkeypatch.setattr(distilled_mod, "find_distilled_corpus", lambda d: Path(d) / "distill" / "t1")
    monkeypatch.setattr(distilled_mod, "read_manifest", lambda d: {"tokenizer_hash": tok.hash})
    monkeypatch.setattr(distilled_mod, "load_distilled_corpus", lambda d, vocab_size=None: Dataset.from_list(rows))
    dm = _dm(cfg, dirs, source="distilled")
    train = dm.datasets["train"]
    assert len(train) == 19 and dm.stats["train"]["dropped"]["min_len"] == 1
    r = train[0]
    assert r["tgt"] == tok.encode("mot 0") and r["src"] == tok.encode("word 0") + [tok.eos_id]
    assert len(dm.datasets["validation"]) == len(gold.datasets["validation"])  # gold validation
    monkeypatch.setattr(distilled_mod, "read_manifest", lambda d: {"tokenizer_hash": "0" * 64})
    with pytest.raises(ValueError, match="tokenizer"):
        _dm(cfg, dirs, source="distilled")


def test_mixed_source_adds_gold_pairs_at_the_share(cfg, dirs, monkeypatch):
    gold = _dm(cfg, dirs)
    tok = gold.tokenizer
    rows = [
        {
            "id": str(i),
            "translation": {"en": f"word {i}", "fr": f"teacher {i}"},
            "teacher_ids": tok.encode(f"mot {i}") + [tok.eos_id],
            "teacher_score": -1.0,
            "gold": "x",
        }
        for i in range(30)
    ]
    monkeypatch.setattr(distilled_mod, "find_distilled_corpus", lambda d: Path(d) / "distill" / "t1")
    monkeypatch.setattr(distilled_mod, "read_manifest", lambda d: {"tokenizer_hash": tok.hash})
    monkeypatch.setattr(distilled_mod, "load_distilled_corpus", lambda d, vocab_size=None: Dataset.from_list(rows))
    gold_pairs = {tuple(r["src"]): r["tgt"] for r in gold.datasets["train"]}
    for share, n_gold in ((0.25, 10), (0.5, 30), (0.0, 0)):
        dm = _dm(cfg, dirs, source="mixed", gold_share=share)
        train = dm.datasets["train"]
        assert len(train) == 30 + n_gold and dm.stats["train"]["mixed_gold"] == n_gold
        assert [r["tgt"] for r in train.select(range(30))] == [tok.encode(f"mot {i}") for i in range(30)]
        extra = [train[i] for i in range(30, len(train))]
        assert all(gold_pairs[tuple(r["src"])] == r["tgt"] for r in extra)  # gold pairs with gold targets
        assert len({tuple(r["src"]) for r in extra}) == n_gold  # drawn without replacement
    again = _dm(cfg, dirs, source="mixed", gold_share=0.5).datasets["train"]["src"]
    assert again == _dm(cfg, dirs, source="mixed", gold_share=0.5).datasets["train"]["src"]  # seeded
    seen = [i for b in _dm(cfg, dirs, source="mixed", gold_share=0.5).train_dataloader() for i in b["idx"].tolist()]
    assert len(seen) == 60
    with pytest.raises(ValueError, match="gold_share"):
        _dm(cfg, dirs, source="mixed", gold_share=1.0)


# ------------------------------------------------------------------------------------ Lightning resume
class _Recorder(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.seen = []

    def training_step(self, batch, batch_idx):
        self.seen.append((self.current_epoch, tuple(batch["idx"].tolist())))
        return (self.w * batch["src"].float().mean()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def _fit(dm, root, ckpt_path=None, every=None):
    model = _Recorder()
    cbs = [ModelCheckpoint(dirpath=root, every_n_train_steps=every, save_top_k=-1, filename="{step}")] if every else []
    trainer = pl.Trainer(
        max_epochs=3,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        enable_checkpointing=bool(every),
        callbacks=cbs,
        default_root_dir=root,
        use_distributed_sampler=False,
    )
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return model.seen


@pytest.mark.parametrize("num_workers", [0, 1])
def test_lightning_mid_epoch_resume(cfg, dirs, tmp_path, num_workers):
    dm = _dm(cfg, dirs, max_tokens=900, num_workers=num_workers)
    per_epoch = len(dm.train_dataloader())
    assert per_epoch >= 8
    full = _fit(dm, tmp_path, every=1)
    assert len(full) == 3 * per_epoch
    assert [e for e, _ in full] == [e for e in range(3) for _ in range(per_epoch)]
    epochs = [[idx for _, idx in full[e * per_epoch : (e + 1) * per_epoch]] for e in range(3)]
    assert epochs[0] != epochs[1] != epochs[2]  # Lightning's set_epoch reaches the sampler: reshuffled
    assert all(sorted(i for b in ep for i in b) == sorted(dm.datasets["train"]["row"]) for ep in epochs)

    for step in (per_epoch + 3, 2 * per_epoch):  # mid-epoch, and right after an epoch's last batch
        ckpt = tmp_path / f"step={step}.ckpt"
        state = torch.load(ckpt, weights_only=True)["BPDDataModule"]["train_sampler"]
        assert (state["epoch"], state["consumed"]) == (1, step - per_epoch)
        resumed = _fit(_dm(cfg, dirs, max_tokens=900, num_workers=num_workers), tmp_path / "r", ckpt_path=ckpt)
        assert resumed == full[step:], f"resume from step {step} replayed or skipped batches"


def test_filtered_rows_keep_their_lengths(cfg, dirs):
    # Regression: the sampler once read lengths from the raw Arrow table, which ignores the rows a filter
    # removed, so lengths and rows drifted apart and a long epoch indexed past the end of the split.
    c = cfg.copy()
    c.filter.max_len = 60
    dm = _dm(c, dirs)
    train = dm.datasets["train"]
    assert len(train) < 400  # the filter really dropped rows
    sampler = dm.train_dataloader().batch_sampler
    assert list(sampler.lengths) == list(train["length"])
    assert sorted(i for b in sampler for i in b) == list(range(len(train)))


def test_evaluation_rows_the_model_cannot_read_are_left_out_and_counted(cfg, dirs, caplog):
    # A validation row longer than data.filter.max_len once reached the model at the first validation and
    # stopped training after all its steps; now it is left out when the data are set up, with a count.
    import logging

    c = cfg.copy()
    c.filter.max_len = 80
    with caplog.at_level(logging.WARNING):
        dm = _dm(c, dirs)
    val = dm.datasets["validation"]
    assert 0 < len(val) < 60 and max(val["length"]) <= 80
    n = dm.stats["validation"]["dropped"]["max_len"]
    assert (
        n == 60 - len(val) and f"validation: left out {n} of 60 rows longer than data.filter.max_len=80" in caplog.text
    )
    assert len(_dm(cfg, dirs).datasets["validation"]) == 60  # the default max_len keeps every bundled row


def test_regime_refuses_a_gold_share_that_leaves_no_teacher_pairs():
    from bpd_train.training.regimes import Regime

    assert Regime(name="both", source="mixed", gold_share=0.25).gold_share == 0.25
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match=r"gold_share .* must be in \[0, 1\)"):
            Regime(name="both", source="mixed", gold_share=bad)
    Regime(name="both", source="distilled", gold_share=1.0)  # ignored unless source=mixed
