# python bench/chain_heads.py RUN CORPUS [--k 4] [--steps 800] [--modes none add proj]   (~17-23 min per mode, 1 thread)
"""Would heads that also see the token before their own accept more? Measured on a trained run's frozen backbone
and its own greedy output (a `distill.py teacher=RUN distill.beam_size=1` corpus): decoder states are computed once,
then each kind of heads 2..k trains on them from scratch with the same batches, and its teacher-forced k̂ is read
on the corpus' last 500 sentences. On a model's own greedy output teacher forcing gives the decoder's k̂ exactly:
head i's proposal counts only where heads 1..i-1 were right, i.e. where the token it conditions on is the target.

Modes (head i >= 2 predicts i tokens ahead from the decoder state h, its own FFN of --hidden units):
  none  state = h + fc2(relu(fc1(h)))                         (what BPD heads see: h only)
  add   the same on x = h + e(prev)                            (prev: the token before head i's, embedded by the
                                                                model's own tied, scaled embedding)
  proj  the same on x = h + P e(prev), P a learned D x D map per head (starts at zero)
"""

from __future__ import annotations

import argparse
import glob
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def shift(y: torch.Tensor, i: int, pad: int) -> torch.Tensor:
    """[B,T] targets shifted left by i, the last i positions padded."""
    if i == 0:
        return y
    o = torch.full_like(y, pad)
    if i < y.shape[1]:
        o[:, :-i] = y[:, i:]
    return o


class Heads(nn.Module):
    def __init__(self, mode: str, k: int, d: int, hidden: int, emb: torch.Tensor):
        super().__init__()
        self.mode, self.emb = mode, emb
        self.fc1 = nn.ModuleList([nn.Linear(d, hidden) for _ in range(k - 1)])
        self.fc2 = nn.ModuleList([nn.Linear(hidden, d) for _ in range(k - 1)])
        for lin in self.fc2:  # every head starts as head 1, as BPD heads do
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)
        if mode == "proj":
            self.tok = nn.ModuleList([nn.Linear(d, d, bias=False) for _ in range(k - 1)])
            for lin in self.tok:
                nn.init.zeros_(lin.weight)

    def state(self, h: torch.Tensor, i: int, prev: torch.Tensor) -> torch.Tensor:
        """h [B,T,D], prev [B,T] the token before head i's -> head i's pre-norm state [B,T,D]."""
        x = h
        if self.mode == "add":
            x = h + self.emb[prev]
        elif self.mode == "proj":
            x = h + self.tok[i - 1](self.emb[prev])
        return h + self.fc2[i - 1](F.relu(self.fc1[i - 1](x)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run", help="a trained run (its backbone stays frozen)")
    ap.add_argument("corpus", help="that run's own greedy output: a distill.py output folder")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--steps", type=int, default=800)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=["none", "add", "proj"], choices=["none", "add", "proj"])
    a = ap.parse_args(argv)
    from bpd_train.sources.loading import load

    torch.set_num_threads(a.threads)
    loaded = load(a.run, map_location="cpu")
    m, text = loaded.model.eval(), loaded.family.text_adapter(loaded)
    c, k, pad = m.config, a.k, m.config.pad_id
    rows = [json.loads(x) for f in sorted(glob.glob(str(Path(a.corpus) / "shard-*.jsonl"))) for x in open(f)]
    if len(rows) < 1000:
        raise SystemExit(f"error: {a.corpus} holds {len(rows)} sentences; give a distill.py output of at least 1000")
    hs, ys = [], []
    t0 = time.time()
    with torch.no_grad():  # decoder states on the corpus, teacher-forced, once
        for i in range(0, len(rows), 64):
            chunk = rows[i : i + 64]
            src = text.batch([text.source_ids(r["translation"]["en"]) for r in chunk])
            tg = [r["teacher_ids"] + [c.eos_id] for r in chunk]
            T = max(map(len, tg))
            out = torch.full((len(chunk), T), pad)
            inp = torch.full((len(chunk), T), pad)
            for j, y in enumerate(tg):
                out[j, : len(y)] = torch.tensor(y)
                inp[j, 0] = c.bos_id
                inp[j, 1 : len(y)] = torch.tensor(y[:-1])
            hs.append(m.features(m.encode(src), inp))
            ys.append(out)
    T = max(y.shape[1] for y in ys)
    H = torch.cat([F.pad(h, (0, 0, 0, T - h.shape[1])) for h in hs])
    Y = torch.cat([F.pad(y, (0, T - y.shape[1]), value=pad) for y in ys])
    valid = Y[:256] != pad
    same = ((m.head_logits(H[:256], 0).argmax(-1) == Y[:256]) & valid).sum() / valid.sum()
    print(
        f"{len(rows)} sentences, decoder states in {time.time() - t0:.0f} s; head 1 == the corpus on "
        f"{same:.2%} of tokens (the corpus is this model's own greedy output)",
        flush=True,
    )
    emb = m.embed.weight.detach() * m.embed_scale
    n, ntr = H.shape[0], H.shape[0] - 500

    def trim(idx):
        h, y = H[idx], Y[idx]
        t = int((y != pad).sum(1).max())
        return h[:, :t], y[:, :t]

    def khat(heads: Heads) -> float:
        with torch.no_grad():
            h, y = trim(torch.arange(ntr, n))
            ok = y != pad
            run = (m._project(h).argmax(-1) == y) & ok
            acc = run.double()
            for i in range(1, k):
                tgt = shift(y, i, pad)
                logits = m._project(heads.state(h, i, shift(y, i - 1, pad)))
                run = run & (logits.argmax(-1) == tgt) & (tgt != pad)
                acc += run
            return float(acc[ok].sum() / ok.sum())

    for mode in a.modes:
        torch.manual_seed(0)  # the same batches for every mode
        heads = Heads(mode, k, c.d_model, a.hidden, emb)
        opt = torch.optim.AdamW(heads.parameters(), lr=2e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
        t0 = time.time()
        for step in range(a.steps):
            h, y = trim(torch.randint(0, ntr, (a.batch,)))
            loss = sum(
                F.cross_entropy(
                    m._project(heads.state(h, i, shift(y, i - 1, pad))).flatten(0, 1),
                    shift(y, i, pad).flatten(),
                    ignore_index=pad,
                )
                for i in range(1, k)
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            if (step + 1) % max(1, a.steps // 4) == 0:
                print(
                    json.dumps(
                        {
                            "mode": mode,
                            "k": k,
                            "step": step + 1,
                            "khat": round(khat(heads), 3),
                            "seconds": round(time.time() - t0),
                        }
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
