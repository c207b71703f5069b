# python bench/train.py              (about 1-3 minutes on a 2-core CPU; --quick for a smoke run)
"""Training benchmark, ratios measured in one run. The last line printed is one JSON object.

1. Throughput, `frozen` vs `finetune` (same model, same batches, same head schedule, interleaved
   A,B,B,A,...): training tokens/s of a full step (forward, loss, backward, AdamW step) through the
   LightningModule's own loss code. The frozen backbone runs without autograd and needs no backward, so
   target: frozen / finetune >= 1.5.
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
    tokens = {n: 0 for n in runs}
    seconds = {n: 0.0 for n in runs}

    def step(name: str, i: int, timed: bool) -> None:
        m, opt = runs[name]
        b = batches[i % len(batches)]
        head = 1 + i % (args.k - 1)  # the same head schedule for both (head 1 is free for frozen)
        sync(device)
        t0 = time.perf_counter()
        loss, _ = m.compute_loss(b, [head], [1.0])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if timed:
            seconds[name] += time.perf_counter() - t0
            tokens[name] += int(b["tgt_out"].ne(0).sum())

    for i in range(args.warmup):
        for name in runs:
            step(name, i, timed=False)
    order = ["frozen", "finetune"]
    for i in range(args.steps):
        for name in order if i % 2 == 0 else order[::-1]:
            step(name, i, timed=True)
    tps = {n: tokens[n] / seconds[n] for n in runs}
    ratio = tps["frozen"] / tps["finetune"]
    return {
        "frozen_tokens_per_s": round(tps["frozen"], 1),
        "finetune_tokens_per_s": round(tps["finetune"], 1),
        "ratio": round(ratio, 3),
        "target": ">= 1.5",
        "met": ratio >= 1.5,
        "model": {"d_model": args.d_model, "layers": args.layers, "vocab": args.vocab, "k": args.k},
        "batch": {"rows": args.rows, "length": args.length},
        "steps_each": args.steps,
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


def main() -> None:
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
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--mem-k", type=int, default=8)
    ap.add_argument("--mem-vocab", type=int, default=32000)
    ap.add_argument("--mem-rows", type=int, default=32)
    args = ap.parse_args()
    if args.quick:
        args.d_model, args.layers, args.vocab, args.rows, args.steps, args.warmup = 64, 1, 1000, 16, 2, 1
        args.mem_vocab, args.mem_rows = 4000, 8
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    t0 = time.perf_counter()
    tp = throughput(args, device)
    print(
        f"throughput: frozen {tp['frozen_tokens_per_s']:.0f} tok/s, finetune {tp['finetune_tokens_per_s']:.0f} "
        f"tok/s, ratio {tp['ratio']:.2f} (target >= 1.5)",
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
