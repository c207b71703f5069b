"""BlockwiseEval: logs val/bleu, val/mean_accepted, val/speedup from a validation subset, on rank 0 only."""

from types import SimpleNamespace

import pytest
import torch

from _eval_tiny import build_tiny, read_pairs

from bpd_train.evaluation.callback import BlockwiseEval
from bpd_train.evaluation.metrics import pad_batch
from bpd_train.sources.loading import load as load_model


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    return build_tiny(tmp_path_factory)


def _fake(tiny, run, n_val=10, rank=0):
    from bpd_train.data import Tokenizer

    tok = Tokenizer(tiny["tok"])
    pairs = read_pairs("validation", n_val)
    rows = [(tok.encode(s)[:60] + [2], tok.encode(t)[:60] + [2]) for s, t in pairs]
    batches = [
        {
            "src": pad_batch([r[0] for r in rows[i : i + 4]], 0),
            "tgt_out": pad_batch([r[1] for r in rows[i : i + 4]], 0),
            "idx": torch.arange(i, min(i + 4, len(rows))),
        }
        for i in range(0, len(rows), 4)
    ]
    logged = {}
    module = SimpleNamespace(
        model=load_model(run).model.train(), log=lambda name, value, **kw: logged.__setitem__(name, (value, kw))
    )
    trainer = SimpleNamespace(
        sanity_checking=False,
        global_rank=rank,
        datamodule=SimpleNamespace(tokenizer=tok, val_dataloader=lambda: batches),
    )
    return trainer, module, logged


def test_logs_metrics_for_a_heads_model(tiny):
    trainer, module, logged = _fake(tiny, tiny["run"])
    cb = BlockwiseEval(n_sentences=6, batch_size=4, max_len=[1.0, 4])
    cb.on_validation_epoch_end(trainer, module)
    assert set(logged) == {"val/bleu", "val/mean_accepted", "val/speedup", "val/agreement"}
    assert logged["val/agreement"][0] == 100.0  # exact acceptance == greedy
    assert 1.0 <= logged["val/mean_accepted"][0] <= 4 and logged["val/speedup"][0] > 0
    assert all(kw["rank_zero_only"] for _, kw in logged.values())
    assert module.model.training  # train mode restored
    assert len(cb._subset[0]) == 6  # evenly spaced subset, collected once


def test_skips_where_it_should(tiny):
    trainer, module, logged = _fake(tiny, tiny["base"])
    BlockwiseEval().on_validation_epoch_end(trainer, module)  # auto: off for k = 1
    assert logged == {}
    BlockwiseEval(enabled=True, n_sentences=3, max_len=[1.0, 2]).on_validation_epoch_end(trainer, module)
    assert logged["val/mean_accepted"][0] == 1.0 and logged["val/speedup"][0] == 1.0
    trainer, module, logged = _fake(tiny, tiny["run"], rank=1)
    BlockwiseEval().on_validation_epoch_end(trainer, module)
    trainer.sanity_checking = True
    BlockwiseEval().on_validation_epoch_end(trainer, module)
    assert logged == {}
    cb = BlockwiseEval(n_sentences=2, every_n_validations=2, max_len=[1.0, 2])
    trainer, module, logged = _fake(tiny, tiny["run"], rank=0)
    cb.on_validation_epoch_end(trainer, module)
    assert logged
    logged.clear()
    cb.on_validation_epoch_end(trainer, module)
    assert logged == {}


def test_every_rank_logs_rank_zeros_values(tiny):
    """With several processes rank 0 decodes and broadcasts: a checkpoint monitoring val/bleu decides on each rank."""
    sent = {}
    for rank in (0, 1):
        trainer, module, logged = _fake(tiny, tiny["base"], rank=rank)
        trainer.world_size = 2

        def broadcast(obj, src, rank=rank):
            assert src == 0 and (obj is None) == (rank == 1)  # only rank 0 decoded
            sent.setdefault("metrics", obj)
            return sent["metrics"]

        trainer.strategy = SimpleNamespace(broadcast=broadcast)
        BlockwiseEval(enabled=True, n_sentences=3, max_len=[1.0, 2]).on_validation_epoch_end(trainer, module)
        assert {n: v for n, (v, _) in logged.items()} == sent["metrics"] and "val/bleu" in logged
        assert not any(kw["rank_zero_only"] for _, kw in logged.values())
