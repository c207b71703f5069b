# python bench/train.py              (about 1-3 minutes on a 2-core CPU; --quick for a smoke run)
"""Training benchmark, ratios measured in one run. The last line printed is one JSON object.

1. Throughput, `frozen` vs `finetune` (same model, same batches, same head schedule): training tokens/s of a full
   step (forward, loss, backward, AdamW step) through the LightningModule's own loss code, timed by
   bench/protocol.py's measure(): one untimed warm-up pass, then --passes (>= 3) passes of ceil(--steps / --passes)
   steps each, the two taking turns step by step (who goes first rotating), CUDA synchronised around every timed
   step. tokens/s: the median pass (spread beside it); ratio: the median over steps of the per-step rate ratio.
   The frozen backbone runs without autograd and needs no backward, so target: frozen / finetune >= 1.5.
2. Peak memory of one forward+backward at k = 8 heads and a 32k vocabulary: head_loss `mean` (all heads,
   each recomputed in backward) vs `random` (one head, the paper's choice). Target: mean / random <= 1.2.
   Also reported: `mean` without recomputation (all k x T x V logits kept alive), what the recompute saves.
   Peak = the high-water mark of live tensor storage allocated during the step, counted with a
   TorchDispatchMode (works on CPU, where torch has no allocator statistics); on CUDA also
   torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_map_only  # noqa: E402

from bench.protocol import MIN_REPS, Run, measure, speedup, tok_s  # noqa: E402
from bpd_train.model import BPDConfig  # noqa: E402
from bpd_train.training.module import BPDLightningModule  # noqa: E402
from bpd_train.training.optim import param_groups  # noqa: E402

OPTIM = {"optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-4}}


class PeakMemory(TorchDispatchMode):
    """High-water mark of the bytes of tensor storages created while the mode is active and still alive."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def _track(self, t: torch.Tensor) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.live or st.device.type == "meta":
            return
        n = st.nbytes()
        self.live[key] = n
        self.current += n
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._free, key)  # storages keep their Python object while alive

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._track, out)
        return out


def module(cfg: BPDConfig, trainable: str, head_loss: str, recompute: bool = True) -> BPDLightningModule:
    regime = {
        "name": f"{trainable}-{head_loss}",
        "trainable": trainable,
        "block_size": cfg.block_size,
        "head_loss": head_loss,
        "init_from": "bench" if trainable == "heads" else None,
    }
    return BPDLightningModule(cfg.to_dict(), regime, OPTIM, {"label_smoothing": 0.1, "recompute": recompute})


def make_batch(rows: int, length: int, vocab: int, seed: int, device) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (rows, length), generator=g)
    tgt = torch.randint(4, vocab, (rows, length + 1), generator=g)
    tgt[:, 0] = 1
    tgt[:, -1] = 2
    return {"src": src.to(device), "tgt_in": tgt[:, :-1].to(device), "tgt_out": tgt[:, 1:].to(device)}


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def throughput(args, device) -> dict:
    cfg = BPDConfig(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_heads=args.n_heads,
        n_encoder_layers=args.layers,
        n_decoder_layers=args.layers,
        d_ff=4 * args.d_model,
        block_size=args.k,
        dropout=0.1,
    )
    torch.manual_seed(0)
    finetune = module(cfg, "all", "random").to(device)
    frozen = module(cfg, "heads", "random").to(device)
    frozen.model.load_state_dict(copy.deepcopy(finetune.model.state_dict()))
    runs = {}
    for name, m in (("frozen", frozen), ("finetune", finetune)):
        m.train()
        groups = param_groups(m.model.backbone_parameters(), m.model.head_parameters(), lr=1e-4)
        runs[name] = (m, torch.optim.AdamW(groups, lr=1e-4))
    batches = [make_batch(args.rows, args.length, args.vocab, s, device) for s in range(4)]

    def step(name: str, i: int) -> Run:
        m, opt = runs[name]
        b = batches[i % len(batches)]
        head = 1 + i % (args.k - 1)  # the same head schedule for both (head 1 is free for frozen)
        loss, _ = m.compute_loss(b, [head], [1.0])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return Run([[0] * int(b["tgt_out"].ne(0).sum())])  # the step's training tokens, as a count

    for i in range(args.warmup):  # extra untimed steps, before the protocol's own warm-up pass
        for name in runs:
            step(name, i)
    engines = {name: (lambda i, name=name: step(name, i)) for name in runs}
    steps = max(1, -(-args.steps // args.passes))
    out = compare(engines, steps, args.passes, sync=lambda: sync(device))
    return {
        **out,
        "model": {"d_model": args.d_model, "layers": args.layers, "vocab": args.vocab, "k": args.k},
        "batch": {"rows": args.rows, "length": args.length},
    }


def compare(engines: dict, steps: int, passes: int, clock=time.perf_counter, sync=None) -> dict:
    """Time engines {"frozen", "finetune"} (step number -> Run whose ids count the step's tokens) under the
    protocol, `steps` steps per pass; the throughput JSON's timing fields."""
    t = measure(engines, list(range(steps)), passes, clock=clock, sync=sync)
    rate = {n: tok_s(t[n]) for n in t}
    ratio = speedup(t["finetune"], t["frozen"])
    return {
        "frozen_tokens_per_s": round(rate["frozen"]["median"], 1),
        "finetune_tokens_per_s": round(rate["finetune"]["median"], 1),
        "ratio": round(ratio["median"], 3),
        "target": ">= 1.5",
        "met": ratio["median"] >= 1.5,
        "tok_s_spread": {n: {k: round(v, 1) for k, v in r.items()} for n, r in rate.items()},
        "ratio_spread": {k: round(v, 3) for k, v in ratio.items()},
        "steps_each": steps * passes,
        "passes": passes,
    }


def peak_memory(args, device) -> dict:
    cfg = BPDConfig(
        vocab_size=args.mem_vocab,
        d_model=args.d_model,
        n_heads=args.n_heads,
        n_encoder_layers=args.layers,
        n_decoder_layers=args.layers,
        d_ff=4 * args.d_model,
        block_size=args.mem_k,
        dropout=0.1,
    )
    batch = make_batch(args.mem_rows, args.length, args.mem_vocab, 0, device)
    out = {}
    for name, head_loss, recompute in (
        ("random", "random", True),
        ("mean", "mean", True),
        ("mean_no_recompute", "mean", False),
    ):
        if name == "mean_no_recompute" and args.quick:
            continue
        torch.manual_seed(0)
        m = module(cfg, "all", head_loss, recompute).to(device)
        m.train()
        heads = [args.mem_k // 2] if head_loss == "random" else list(range(args.mem_k))
        w = [1.0 / len(heads)] * len(heads)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        with PeakMemory() as pm:
            loss, _ = m.compute_loss(batch, heads, w)
            loss.backward()
        out[f"{name}_mb"] = round(pm.peak / 2**20, 1)
        if device.type == "cuda":
            out[f"{name}_cuda_mb"] = round((torch.cuda.max_memory_allocated(device) - base) / 2**20, 1)
        del m, loss
    ratio = out["mean_mb"] / out["random_mb"]
    logits_mb = args.mem_rows * args.length * args.mem_vocab * 4 / 2**20
    out.update(
        {
            "ratio": round(ratio, 3),
            "target": "<= 1.2",
            "met": ratio <= 1.2,
            "k": args.mem_k,
            "vocab": args.mem_vocab,
            "target_tokens": args.mem_rows * args.length,
            "one_head_logits_mb": round(logits_mb, 1),
        }
    )
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, a few steps: checks that it runs")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--n-heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=6)  # Transformer-base depth
    ap.add_argument("--vocab", type=int, default=8000)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--length", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8, help="timed steps each, over --passes (rounded up)")
    ap.add_argument("--passes", type=int, default=MIN_REPS, help=f"timed passes after the warm-up pass (>= {MIN_REPS})")
    ap.add_argument("--warmup", type=int, default=0, help="extra untimed steps each before the warm-up pass")
    ap.add_argument("--mem-k", type=int, default=8)
    ap.add_argument("--mem-vocab", type=int, default=32000)
    ap.add_argument("--mem-rows", type=int, default=32)
    args = ap.parse_args(argv)
    if args.passes < MIN_REPS:
        ap.error(f"--passes {args.passes}: the protocol times at least {MIN_REPS} passes (a median needs them)")
    if args.quick:
        args.d_model, args.layers, args.vocab, args.rows, args.steps = 64, 1, 1000, 16, 3
        args.mem_vocab, args.mem_rows = 4000, 8
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    tp = throughput(args, device)
    print(
        f"throughput: frozen {tp['frozen_tokens_per_s']:.0f} tok/s, finetune {tp['finetune_tokens_per_s']:.0f} "
        f"tok/s, ratio {tp['ratio']:.2f} ({tp['ratio_spread']['min']:.2f}-{tp['ratio_spread']['max']:.2f} over steps, "
        f"{tp['passes']} passes; target >= 1.5)",
        flush=True,
    )
    mem = peak_memory(args, device)
    extra = f", mean without recompute {mem['mean_no_recompute_mb']:.0f} MB" if "mean_no_recompute_mb" in mem else ""
    print(
        f"peak memory (k={mem['k']}, V={mem['vocab']}): random {mem['random_mb']:.0f} MB, mean "
        f"{mem['mean_mb']:.0f} MB, ratio {mem['ratio']:.2f} (target <= 1.2){extra}",
        flush=True,
    )
    result = {
        "bench": "train",
        "device": str(device),
        "threads": torch.get_num_threads(),
        "throughput": tp,
        "peak_memory": mem,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
