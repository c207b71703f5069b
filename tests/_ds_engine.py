"""Drive the raw DeepSpeed engine on CPU (DS_ACCELERATOR=cpu, gloo, one process) around the training module's
own loss, the way Lightning's DeepSpeedStrategy does on a GPU: the engine wraps a module whose forward runs
compute_loss, so every parameter access happens where ZeRO-3 either gathers it or does not.

    python tests/_ds_engine.py --stage 3 --bf16 --family ed --regime frozen [--persist0]

Prints one line `RESULT {json}`: losses, how many parameters ZeRO-3 partitioned, checks of a saved checkpoint.
A separate process per run: DeepSpeed's accelerator and process group are process-wide."""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("RANK", "0")
os.environ.setdefault("LOCAL_RANK", "0")
os.environ.setdefault("WORLD_SIZE", "1")

import torch  # noqa: E402

VOCAB = 40


def model_config(family: str, k: int = 4) -> dict:
    if family == "lm":
        return dict(
            arch="lm",
            vocab_size=VOCAB,
            d_model=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_ff=48,
            max_positions=64,
            block_size=k,
            eos_id=2,
            bos_id=1,
        )
    return dict(
        vocab_size=VOCAB,
        d_model=32,
        n_heads=4,
        n_encoder_layers=2,
        n_decoder_layers=2,
        d_ff=48,
        max_positions=64,
        block_size=k,
        dropout=0.1,
    )


def batch(family: str, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    if family == "lm":
        tok = torch.randint(4, VOCAB, (3, 9), generator=g)
        tgt = torch.cat([tok[:, 1:], torch.full((3, 1), -1)], dim=1)
        return {"tokens": tok, "targets": tgt}
    src = torch.randint(4, VOCAB, (3, 7), generator=g)
    src[0, -2:] = 0  # some padding
    tgt = torch.randint(4, VOCAB, (3, 6), generator=g)
    tgt_in = torch.cat([torch.ones(3, 1, dtype=torch.long), tgt[:, :-1]], dim=1)
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt}


class Step(torch.nn.Module):
    """Lightning's module wrapper in miniature: the engine's forward is the training step's loss."""

    def __init__(self, module):
        super().__init__()
        self.module = module

    def forward(self, b: dict, heads: list[int], weights: list[float]):
        return self.module.compute_loss(b, heads, weights)[0]


def ds_config(stage: int, bf16: bool, persist0: bool) -> dict:
    zero: dict = {"stage": stage}
    if stage == 3 and persist0:  # partition every parameter, however small (real sizes behave like this)
        zero.update(
            stage3_param_persistence_threshold=0,
            stage3_max_live_parameters=1,
            stage3_prefetch_bucket_size=1,
            reduce_bucket_size=64,
            allgather_bucket_size=64,
        )
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": bf16},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_allow_untested_optimizer": True,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--persist0", action="store_true")
    ap.add_argument("--family", default="ed")
    ap.add_argument("--regime", default="base")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--eval", action="store_true", help="also a validation step (no grad, eval mode)")
    ap.add_argument("--port", default="29611")
    ap.add_argument(
        "--heads",
        default=None,
        help="heads of each step's loss, steps separated by '/', e.g. 1,2,3/0 "
        "(default: all trained heads; the last list repeats)",
    )
    ap.add_argument(
        "--save",
        default=None,
        help="save a DeepSpeed checkpoint here, as Lightning does, and report "
        "whether its consolidation holds the base model's backbone bit for bit",
    )
    ap.add_argument("--dump", default=None, help="write the trained model's full fp32 state here (torch.save)")
    args = ap.parse_args()
    os.environ.setdefault("MASTER_PORT", args.port)
    torch.set_num_threads(1)
    torch.manual_seed(0)

    import deepspeed

    from bpd_train.training.module import BPDLightningModule
    from bpd_train.training.regimes import Regime

    frozen = args.regime == "frozen"
    regime = Regime(
        name=args.regime,
        trainable="heads" if frozen else "all",
        block_size=4,
        init_from="base" if frozen else None,
        stage="heads" if frozen else "base",
    )
    module = BPDLightningModule(
        model_config(args.family),
        regime.to_dict(),
        {"optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-3}},
        loss={"recompute": True},
    )
    base = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    module.keep_frozen_fp32()  # what its setup hook does under Lightning's DeepSpeedStrategy with bf16
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    params = [p for p in module.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(
        model=Step(module),
        model_parameters=params,
        optimizer=torch.optim.AdamW(params, lr=1e-3),
        config=ds_config(args.stage, args.bf16, args.persist0),
    )
    plan = [[int(h) for h in step.split(",")] for step in args.heads.split("/")] if args.heads else [module.train_heads]
    sizes = [p.data.numel() for p in module.parameters()]
    out: dict = {"partitioned": sum(1 for p in module.parameters() if p.data.numel() == 0), "params": len(sizes)}
    losses = []
    for s in range(args.steps):
        heads = plan[min(s, len(plan) - 1)]
        loss = engine(batch(args.family, s), heads, [1.0 / len(heads)] * len(heads))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    out.update(losses=losses, dtype=str(next(module.model.parameters()).dtype))
    if args.eval:
        engine.eval()
        with torch.no_grad():
            # what validation_step does, inside the engine's forward as Lightning runs it
            heads = module.train_heads
            out["val"] = float(engine(batch(args.family, 99), heads, [1.0 / len(heads)] * len(heads)))
        engine.train()
    if args.dump:
        with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=args.stage == 3):
            state = {n: p.detach().float().clone() for n, p in module.model.named_parameters()}
        if int(os.environ["RANK"]) == 0:
            torch.save(state, args.dump)
    if args.save:
        client: dict = {}
        module.on_save_checkpoint(client)
        engine.save_checkpoint(args.save, tag="checkpoint", client_state=client)
        if int(os.environ["RANK"]) == 0:
            from bpd_train.sources.zero import consolidate_zero

            state, meta = consolidate_zero(args.save)
            frozen = [n for n, p in module.model.named_parameters() if not p.requires_grad]
            out["frozen"] = len(frozen)
            out["backbone_exact"] = all(torch.equal(state[n], base[n]) for n in frozen)
            out["heads_trained"] = any(not torch.equal(state[n], base[n]) for n in state if n.startswith("heads."))
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
