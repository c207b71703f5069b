"""Token-budget, length-bucketed batch sampler that shards across ranks and resumes mid-epoch.

Per epoch, every rank builds the same global list of batches from (seed, epoch) alone:
1. shuffle the examples, then stable-sort by length, so equal lengths land in a new random order every epoch;
2. cut the sorted list greedily into batches whose *padded* size `rows * max(length in batch)` stays
   within `max_tokens` (`length` = what the caller passes: the data module gives max(src_len, tgt_len),
   so the budget bounds both padded tensors; a single example longer than the budget is a batch of one);
3. while the number of batches is not a multiple of `num_replicas`, split the batch with the most rows in
   two (a split batch still fits the budget). No example is ever duplicated or dropped, so every example is
   seen exactly once per epoch across ranks and every rank runs the same number of steps. This needs at
   least `num_replicas` examples;
4. shuffle the batch order (when `shuffle`), then rank r takes batches r, r+R, r+2R, ...

Lightning calls `set_epoch` only on `batch_sampler.sampler`, which here forwards to this sampler.

Resume: `state_dict()` records the epoch and how many batches this rank has consumed in it; after
`load_state_dict()` the next `__iter__` yields exactly the remaining batches of that epoch, and later
epochs start from the beginning. `consumed` counts batches handed out by `__iter__`; with DataLoader workers
that runs ahead of training, so the data module saves the count of batches its DataLoader *delivered*
instead (see batches.py), which is what Lightning's progress counts. A state saved with another
max_tokens, world size or corpus size restarts its epoch from the first batch, with a warning.
"""
from __future__ import annotations

import warnings
from typing import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler


class _EpochSetter(Sampler[int]):
    """`batch_sampler.sampler`: Lightning calls `set_epoch` on `dataloader.sampler` and
    `dataloader.batch_sampler.sampler`, never on the batch sampler itself; this forwards the call."""

    def __init__(self, owner: "TokenBucketBatchSampler"):
        self._owner = owner

    def set_epoch(self, epoch: int) -> None:
        self._owner.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:  # this rank's examples in this epoch's order
        return (i for b in self._owner.rank_batches() for i in b)

    def __len__(self) -> int:
        return sum(len(b) for b in self._owner.rank_batches())


class TokenBucketBatchSampler(Sampler[list[int]]):
    def __init__(self, lengths: Sequence[int], max_tokens: int, num_replicas: int = 1, rank: int = 0,
                 seed: int = 0, shuffle: bool = True):
        if max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is not in [0, num_replicas={num_replicas})")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        if self.lengths.ndim != 1:
            raise ValueError("lengths must be one integer per example")
        if len(self.lengths) < num_replicas:
            raise ValueError(f"{len(self.lengths)} examples cannot give each of {num_replicas} ranks a batch")
        self.max_tokens = int(max_tokens)
        self.num_replicas = int(num_replicas)
        self.rank = int(rank)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epoch = 0
        self.consumed = 0  # batches of `epoch` already handed out on this rank
        self._resume_from = 0  # batches of `epoch` to skip at the next __iter__ (set by load_state_dict)
        self._cache: tuple[tuple[int, int], list[np.ndarray]] | None = None
        self.sampler = _EpochSetter(self)

    # ------------------------------------------------------------------------------------------ batches
    def _global_batches(self, epoch: int) -> list[np.ndarray]:
        if self._cache is not None and self._cache[0] == (self.seed, epoch):
            return self._cache[1]
        n = len(self.lengths)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(n)
        else:
            rng = None
            order = np.arange(n)
        order = order[np.argsort(self.lengths[order], kind="stable")]
        sorted_len = self.lengths[order]
        batches: list[np.ndarray] = []
        start = 0
        while start < n:
            # Sorted ascending, so a batch's max length is its last row's and rows * max grows with each row:
            # the rows that fit are a prefix of the at most max_tokens // len[start] candidates.
            cap = min(n, start + max(1, self.max_tokens // max(1, int(sorted_len[start]))))
            rows = np.arange(1, cap - start + 1)
            fits = int(np.count_nonzero(rows * sorted_len[start:cap] <= self.max_tokens))
            end = start + max(1, fits)
            batches.append(order[start:end])
            start = end
        while len(batches) % self.num_replicas:
            i = max(range(len(batches)), key=lambda j: (len(batches[j]), -j))
            b = batches[i]
            if len(b) < 2:
                raise ValueError("cannot split batches further to balance ranks")  # unreachable: n >= replicas
            half = len(b) // 2
            batches[i: i + 1] = [b[:half], b[half:]]
        if rng is not None:
            batches = [batches[j] for j in rng.permutation(len(batches))]
        self._cache = ((self.seed, epoch), batches)
        return batches

    def rank_batches(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's batches for an epoch (default: the current one), as lists of example indices."""
        batches = self._global_batches(self.epoch if epoch is None else epoch)
        return [b.tolist() for b in batches[self.rank:: self.num_replicas]]

    # --------------------------------------------------------------------------------------- protocol
    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self.consumed = 0
            self._resume_from = 0

    def __len__(self) -> int:
        return len(self._global_batches(self.epoch)) // self.num_replicas

    def __iter__(self) -> Iterator[list[int]]:
        mine = self.rank_batches()
        start, self._resume_from = self._resume_from, 0
        self.consumed = start
        for b in mine[start:]:
            self.consumed += 1
            yield b

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed,
                "num_replicas": self.num_replicas, "max_tokens": self.max_tokens, "num_examples": len(self.lengths)}

    def load_state_dict(self, state: dict) -> None:
        """Resume at the saved position. If the data, max_tokens or world size changed, the saved position
        means nothing here: warn and restart the saved epoch from its first batch instead."""
        self.seed = int(state.get("seed", self.seed))
        self.set_epoch(int(state["epoch"]))
        changed = [f"{k} {state[k]} -> {mine}" for k, mine in (("num_replicas", self.num_replicas),
                                                              ("max_tokens", self.max_tokens),
                                                              ("num_examples", len(self.lengths)))
                   if k in state and state[k] != mine]
        consumed = int(state["consumed"])
        if changed:
            warnings.warn(f"batch sampler state was saved with other settings ({', '.join(changed)}); "
                          f"restarting epoch {self.epoch} from its first batch instead of batch {consumed}",
                          stacklevel=2)
            consumed = 0
        if consumed >= len(self):  # saved after the epoch's last batch: what remains is the next epoch
            self.set_epoch(self.epoch + 1)
            consumed = 0
        self.consumed = self._resume_from = consumed


def length_batches(lengths: Sequence[int], max_sentences: int, max_tokens: int | None = None) -> list[list[int]]:
    """Row indices for decoding (evaluation, translate, distillation): grouped into batches of similar length,
    longest first (an OOM shows up at once), each with at most `max_sentences` rows and, if given, at most
    `max_tokens` padded tokens (a longer single row is a batch of its own). Deterministic: ties keep input order."""
    if max_sentences < 1 or (max_tokens is not None and max_tokens < 1):
        raise ValueError(f"max_tokens and max_sentences must be >= 1, got {max_tokens}, {max_sentences}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    cur: list[int] = []
    cur_max = 0
    for i in order:
        new_max = max(cur_max, lengths[i])
        if cur and (len(cur) >= max_sentences or (max_tokens is not None and (len(cur) + 1) * new_max > max_tokens)):
            batches.append(cur)
            cur, new_max = [], lengths[i]
        cur.append(i)
        cur_max = new_max
    if cur:
        batches.append(cur)
    return batches


def evenly_spaced(n: int, m: int | None) -> list[int]:
    """m indices spread evenly over range(n), first and last included (all of them when m is None or >= n): a
    subset of a corpus that samples all of it, the same every time."""
    if m is None or m >= n:
        return list(range(n))
    if m < 1:
        return []
    return sorted({round(i * (n - 1) / max(1, m - 1)) for i in range(m)}) if m > 1 else [0]
