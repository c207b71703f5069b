"""TokenBucketBatchSampler invariants (exactly once, budget, equal batch counts per rank, resume) and collate."""

import numpy as np
import pytest
import torch

from bpd_train.data import TokenBucketBatchSampler, collate


def _lengths(n=997, seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(1, 120, size=n).tolist()


def _all_ranks(lengths, max_tokens, world, seed=0, epoch=0, shuffle=True):
    per_rank = []
    for r in range(world):
        s = TokenBucketBatchSampler(lengths, max_tokens, num_replicas=world, rank=r, seed=seed, shuffle=shuffle)
        s.set_epoch(epoch)
        batches = list(s)
        assert len(batches) == len(s)
        per_rank.append(batches)
    return per_rank


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("n", [997, 50, 7])
def test_exactly_once_budget_and_equal_counts(world, n):
    lengths = _lengths(n)
    max_tokens = 600
    per_rank = _all_ranks(lengths, max_tokens, world, epoch=1)
    counts = {len(b) for b in per_rank}
    assert len(counts) == 1, f"ranks got different batch counts: {[len(b) for b in per_rank]}"
    seen = [i for batches in per_rank for b in batches for i in b]
    assert sorted(seen) == list(range(n)), "every example exactly once per epoch across ranks"
    for batches in per_rank:
        for b in batches:
            assert len(b) >= 1
            assert len(b) * max(lengths[i] for i in b) <= max_tokens


def test_overlong_example_is_a_batch_of_one():
    lengths = [5, 5, 50, 5]
    batches = list(TokenBucketBatchSampler(lengths, max_tokens=20, shuffle=False))
    assert [2] in batches
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3]


def test_deterministic_per_seed_and_epoch():
    lengths = _lengths()
    a = _all_ranks(lengths, 500, 2, seed=3, epoch=5)
    b = _all_ranks(lengths, 500, 2, seed=3, epoch=5)
    c = _all_ranks(lengths, 500, 2, seed=3, epoch=6)
    d = _all_ranks(lengths, 500, 2, seed=4, epoch=5)
    assert a == b
    assert a != c and a != d


def test_no_shuffle_is_sorted_and_stable():
    lengths = _lengths(200)
    s = TokenBucketBatchSampler(lengths, 400, shuffle=False)
    flat = [i for b in s for i in b]
    assert [lengths[i] for i in flat] == sorted(lengths)
    s.set_epoch(3)
    assert [i for b in s for i in b] == flat


def test_too_few_examples_for_ranks():
    with pytest.raises(ValueError, match="ranks"):
        TokenBucketBatchSampler([3, 4], 100, num_replicas=3, rank=0)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_mid_epoch_resume_yields_exactly_the_remaining_batches(world):
    lengths = _lengths()
    for rank in range(world):
        s = TokenBucketBatchSampler(lengths, 500, num_replicas=world, rank=rank, seed=7)
        s.set_epoch(2)
        full = list(s)
        it = iter(s)
        head = [next(it) for _ in range(5)]
        state = s.state_dict()
        assert state["epoch"] == 2 and state["consumed"] == 5
        fresh = TokenBucketBatchSampler(lengths, 500, num_replicas=world, rank=rank, seed=7)
        fresh.load_state_dict(state)
        rest = list(fresh)
        assert head + rest == full
        # the epoch after the resumed one starts from the top again
        fresh.set_epoch(3)
        s.set_epoch(3)
        assert list(fresh) == list(s)


def test_resume_after_last_batch_moves_to_next_epoch():
    lengths = _lengths(300)
    s = TokenBucketBatchSampler(lengths, 500, seed=1)
    s.set_epoch(4)
    list(s)
    fresh = TokenBucketBatchSampler(lengths, 500, seed=1)
    fresh.load_state_dict(s.state_dict())
    assert fresh.epoch == 5
    s.set_epoch(5)
    assert list(fresh) == list(s)


def test_resume_with_other_world_size_restarts_the_epoch_with_a_warning():
    lengths = _lengths(300)
    s = TokenBucketBatchSampler(lengths, 500, num_replicas=2, rank=0)
    s.set_epoch(2)
    it = iter(s)
    next(it), next(it)
    other = TokenBucketBatchSampler(lengths, 500, num_replicas=3, rank=0)
    with pytest.warns(UserWarning, match="num_replicas 2 -> 3"):
        other.load_state_dict(s.state_dict())
    ref = TokenBucketBatchSampler(lengths, 500, num_replicas=3, rank=0)
    ref.set_epoch(2)
    assert other.epoch == 2 and list(other) == list(ref)


def test_bucketing_pads_little():
    lengths = _lengths(5000)
    s = TokenBucketBatchSampler(lengths, 2000, seed=0)
    real = sum(lengths)
    padded = sum(len(b) * max(lengths[i] for i in b) for b in s)
    assert real / padded >= 0.9


def test_collate_shapes_and_specials():
    rows = [{"row": 7, "src": [5, 6, 2], "tgt": [8, 9, 10]}, {"row": 3, "src": [5, 2], "tgt": []}]
    b = collate(rows, pad_id=0, bos_id=1, eos_id=2)
    assert b["src"].tolist() == [[5, 6, 2], [5, 2, 0]]
    assert b["tgt_in"].tolist() == [[1, 8, 9, 10], [1, 0, 0, 0]]
    assert b["tgt_out"].tolist() == [[8, 9, 10, 2], [2, 0, 0, 0]]
    assert b["idx"].tolist() == [7, 3]
    assert all(t.dtype == torch.long for t in b.values())
