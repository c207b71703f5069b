"""Training losses, head metrics, schedules and the LightningModule's regime logic on synthetic batches."""

from __future__ import annotations

import math

import pytest
import torch

from bpd_train.model import BPDConfig, BPDModel
from bpd_train.training.losses import bpd_loss, head_stats, head_targets, head_weights
from bpd_train.training.module import BPDLightningModule, mix_seed
from bpd_train.training.optim import lr_lambda, param_groups

PAD = 0


def tiny(k=4, identity_p1=True, vocab=23, dropout=0.0) -> BPDModel:
    torch.manual_seed(0)
    m = BPDModel(
        BPDConfig(
            vocab_size=vocab,
            d_model=16,
            n_heads=2,
            n_encoder_layers=1,
            n_decoder_layers=1,
            d_ff=32,
            dropout=dropout,
            block_size=k,
            identity_p1=identity_p1,
        )
    )
    for p in m.head_parameters():  # the zero-initialised output layer would make every head equal head 1
        if not p.any():
            torch.nn.init.normal_(p, std=0.3)
    return m


def batch(b=3, s=7, t=9, vocab=23, seed=1):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(4, vocab, (b, s), generator=g)
    tgt = torch.randint(4, vocab, (b, t + 1), generator=g)
    tgt[:, 0] = 1
    lens = [t, t - 3, t - 5][:b]
    for r, n in enumerate(lens):  # eos then padding
        tgt[r, n] = 2
        tgt[r, n + 1 :] = PAD
    src[1, 5:] = PAD
    return {"src": src, "tgt_in": tgt[:, :-1].clone(), "tgt_out": tgt[:, 1:].clone()}


def test_head_targets_shift_left_and_pad():
    y = torch.tensor([[5, 6, 7, 2, 0]])
    assert head_targets(y, 0, PAD).tolist() == [[5, 6, 7, 2, 0]]
    assert head_targets(y, 2, PAD).tolist() == [[7, 2, 0, 0, 0]]
    assert head_targets(y, 9, PAD).tolist() == [[0, 0, 0, 0, 0]]


@pytest.mark.parametrize("identity_p1", [True, False])
def test_loss_matches_full_logits(identity_p1):
    """Head i at position t scores tgt_out[t+i] against the full forward's logits[:, t, i]."""
    m, b = tiny(identity_p1=identity_p1), batch()
    k = m.config.block_size
    full = m(b["src"], b["tgt_in"])  # [B,T,k,V]
    h = m.features(m.encode(b["src"]), b["tgt_in"])
    w = head_weights("weighted", list(range(k)), decay=0.8)
    loss, per = bpd_loss(m.head_logits, h, b["tgt_out"], list(range(k)), w, PAD, label_smoothing=0.1)
    expect = []
    for i in range(k):
        T = b["tgt_out"].size(1)
        lg, tg = full[:, : T - i, i], b["tgt_out"][:, i:]
        mask = tg.ne(PAD)
        expect.append(torch.nn.functional.cross_entropy(lg[mask], tg[mask], label_smoothing=0.1))
        assert torch.allclose(per[i], expect[-1], atol=1e-5)
    assert torch.allclose(loss, sum(wi * e for wi, e in zip(w, expect)), atol=1e-5)
    assert math.isclose(sum(w), 1.0) and w[0] > w[1] > w[2]


def test_recompute_gives_same_loss_and_gradients():
    m, b = tiny(), batch()
    heads = list(range(4))
    w = head_weights("mean", heads)
    grads = []
    for recompute in (False, True):
        m.zero_grad()
        h = m.features(m.encode(b["src"]), b["tgt_in"])
        loss, _ = bpd_loss(m.head_logits, h, b["tgt_out"], heads, w, PAD, 0.1, recompute=recompute)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in m.parameters()]))
    assert torch.allclose(grads[0][0], grads[1][0])
    for g0, g1 in zip(grads[0][1], grads[1][1]):
        assert torch.allclose(g0, g1, atol=1e-6)


def test_head_weights_explicit_and_errors():
    assert head_weights("weighted", [1, 2], weights=[0.0, 3.0, 1.0]) == [0.75, 0.25]
    assert head_weights("mean", [0, 1, 2]) == [1 / 3] * 3
    with pytest.raises(ValueError):
        head_weights("weighted", [0], weights=[0.0])


def test_head_stats_expected_accepted_by_hand():
    """A fake 'model' whose heads are right or wrong where we say: check acc and the consecutive-run estimate."""
    tgt = torch.tensor([[5, 6, 7, 2, 0]])  # 4 real positions
    V, k = 9, 3
    right = {0: [1, 1, 0, 1, 0], 1: [1, 0, 1, 0, 0], 2: [0, 1, 0, 0, 0]}  # per head, per position (valid ones)

    def head_logits(h, i):
        tg = head_targets(tgt, i, PAD)
        pred = torch.where(torch.tensor(right[i]).bool(), tg, torch.full_like(tg, 8))
        return torch.nn.functional.one_hot(pred, V).float() * 10

    s = head_stats(head_logits, torch.zeros(1, 5, 4), tgt, k, PAD)
    assert s["count"].tolist() == [4, 3, 2]
    assert s["correct"].tolist() == [3, 2, 1]
    # runs per position: t0: h1 ok, h2 ok, h3 wrong -> 2; t1: h1 ok, h2 wrong -> 1; t2: h1 wrong -> 0; t3: 1
    assert s["accepted_sum"].item() == 4 and s["positions"].item() == 4


def test_schedules():
    f = lr_lambda("inverse_sqrt", warmup_steps=4)
    assert [round(f(s), 4) for s in range(6)] == [
        0.25,
        0.5,
        0.75,
        1.0,
        round(math.sqrt(4 / 5), 4),
        round(math.sqrt(4 / 6), 4),
    ]
    c = lr_lambda("cosine", warmup_steps=2, total_steps=10, min_lr_ratio=0.1)
    assert c(1) == 1.0 and abs(c(9) - 0.1) < 1e-9 and 0.1 < c(5) < 1.0
    assert lr_lambda("constant", 0)(100) == 1.0
    with pytest.raises(ValueError):
        lr_lambda("linear", 0)


def _module(regime: dict, k=4, head_loss="random", loss: dict | None = None, **kw) -> BPDLightningModule:
    cfg = tiny(k=k).config.to_dict()
    reg = {"name": "t", "block_size": k, "head_loss": head_loss, **regime}
    optim = {
        "optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-2, "weight_decay": 0.1},
        "head_lr_mult": 3.0,
        "schedule": {"name": "constant", "warmup_steps": 0},
    }
    return BPDLightningModule(cfg, reg, optim, {"label_smoothing": 0.1, **(loss or {})}, seed=3, **kw)


def test_frozen_module_freezes_backbone_and_skips_head1():
    m = _module({"trainable": "heads", "init_from": "x"})
    assert all(not p.requires_grad for p in m.model.backbone_parameters())
    assert all(p.requires_grad for p in m.model.head_parameters())
    assert m.train_heads == [1, 2, 3]
    groups = param_groups(
        m.model.backbone_parameters(), m.model.head_parameters(), lr=1.0, weight_decay=0.1, head_lr_mult=3.0
    )
    in_opt = {id(p) for g in groups for p in g["params"]}
    assert not in_opt & {id(p) for p in m.model.backbone_parameters()}
    assert {g["name"] for g in groups} == {"heads", "heads_no_decay"} and all(g["lr"] == 3.0 for g in groups)


def test_frozen_training_steps_leave_backbone_bit_identical():
    m = _module({"trainable": "heads", "init_from": "x"}, head_loss="mean")
    before = {n: p.detach().clone() for n, p in m.model.named_parameters() if not n.startswith("heads.")}
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    m.train()
    for s in range(3):
        loss, _ = m.compute_loss(batch(seed=s), *m.heads_for_step(0))
        loss.backward()
        opt.step()
        opt.zero_grad()
    for n, p in m.model.named_parameters():
        if not n.startswith("heads."):
            assert torch.equal(p, before[n]), n


def test_random_head_is_a_function_of_seed_and_step():
    m = _module({"trainable": "all"})
    picks = [m.heads_for_step(0)[0] for _ in range(2)]
    assert picks[0] == picks[1] and len(picks[0]) == 1
    assert mix_seed(3, 7919, 0, 0) == mix_seed(3, 7919, 0, 0) != mix_seed(3, 7919, 1, 0)
    draws = {mix_seed(3, 7919, s, 0) % 4 for s in range(64)}
    assert draws == {0, 1, 2, 3}


def test_head1_alone_still_touches_the_bpd_layer():
    """finetune + random drawing head 1: the BPD layer gets (zero) gradients, as DDP needs."""
    m = _module({"trainable": "all"})
    loss, per = m.compute_loss(batch(), [0], [1.0])
    loss.backward()
    assert list(per) == [0]
    assert all(p.grad is not None and not p.grad.any() for p in m.model.head_parameters())


def test_checkpoint_meta_layout():
    m = _module({"trainable": "all"}, tokenizer_hash="abc", tokenizer_file="/x/tok.model", data_name="c")
    ck: dict = {}
    m.on_save_checkpoint(ck)
    meta = ck["bpd"]
    assert meta["model_config"] == m.model.config.to_dict()
    assert meta["tokenizer_hash"] == "abc" and meta["regime"] == "t" and meta["block_size"] == 4
    assert set(m.state_dict()) == {"model." + n for n in m.model.state_dict()}


def test_copy_weights_backbone_exact_heads_of_other_k_skipped():
    import dataclasses

    from bpd_train.training.run import TrainError, copy_weights

    src = tiny(k=8)
    dst = BPDModel(dataclasses.replace(src.config, block_size=4))
    report = copy_weights(dst, src)
    head_ids = {id(p) for p in dst.head_parameters()}
    assert report["skipped"] and set(report["new"]) == {n for n, p in dst.named_parameters() if id(p) in head_ids}
    for n, t in src.state_dict().items():
        if n in report["copied"]:
            assert torch.equal(dst.state_dict()[n], t)
    with pytest.raises(TrainError, match="does not fit"):
        copy_weights(BPDModel(dataclasses.replace(src.config, d_ff=64, block_size=4)), src)


def test_p1_weight_gives_head1_its_share_and_the_rest_keeps_its_proportions():
    assert head_weights("mean", [0, 1, 2, 3], p1_weight=0.5) == pytest.approx([0.5, 1 / 6, 1 / 6, 1 / 6])
    w = head_weights("weighted", [0, 1, 2], decay=0.5, p1_weight=0.6)
    assert w == pytest.approx([0.6, 0.4 * 0.5 / 0.75, 0.4 * 0.25 / 0.75]) and sum(w) == pytest.approx(1.0)
    # frozen backbone (head 1 not trained) and the base model (k = 1): nothing to share
    assert head_weights("mean", [1, 2, 3], p1_weight=0.5) == head_weights("mean", [1, 2, 3])
    assert head_weights("mean", [0], p1_weight=0.5) == [1.0]
    for bad in (0.0, 1.0, -0.2):
        with pytest.raises(ValueError, match="p1_weight"):
            head_weights("mean", [0, 1], p1_weight=bad)
    with pytest.raises(ValueError, match="p1_weight"):
        BPDLightningModule(tiny().config.to_dict(), {"name": "t", "block_size": 4}, {}, {"p1_weight": 1.5})


def test_p1_weight_in_the_module_and_the_random_draw(monkeypatch):
    m = _module({"trainable": "all"}, head_loss="mean")
    m.loss_cfg["p1_weight"] = 0.7
    assert m.heads_for_step(0) == ([0, 1, 2, 3], pytest.approx([0.7, 0.1, 0.1, 0.1]))
    r = _module({"trainable": "all"})
    r.loss_cfg["p1_weight"] = 0.7
    picks = []
    for step in range(400):
        monkeypatch.setattr(type(r), "global_step", property(lambda self, s=step: s))
        heads, weights = r.heads_for_step(0)
        assert len(heads) == 1 and weights == [1.0]
        picks.append(heads[0])
    assert 0.6 < picks.count(0) / len(picks) < 0.8 and set(picks) == {0, 1, 2, 3}


# ----------------------------------------------------------------------------- word-level distillation (KD)
def test_kd_weight_zero_is_todays_loss_exactly():
    m, b = tiny(), batch()
    h = m.features(m.encode(b["src"]), b["tgt_in"])
    w = head_weights("mean", [0, 1, 2, 3], p1_weight=0.5)
    plain, per = bpd_loss(m.head_logits, h, b["tgt_out"], [0, 1, 2, 3], w, PAD, 0.1)
    teacher = torch.randn(*b["tgt_out"].shape, 23)
    same, per0 = bpd_loss(
        m.head_logits,
        h,
        b["tgt_out"],
        [0, 1, 2, 3],
        w,
        PAD,
        0.1,
        teacher_logits=teacher,
        kd_weight=0.0,
        kd_temperature=2.0,
    )
    assert torch.equal(plain, same) and all(torch.equal(per[i], per0[i]) for i in per)
    mod = _module({"trainable": "all"}, head_loss="mean")  # the config default (kd_weight absent): no teacher needed
    assert mod.kd_weight == 0.0 and mod.compute_loss(b, [0, 1], [0.5, 0.5])[0].isfinite()


def test_kd_with_the_student_as_teacher_is_zero_with_zero_gradient():
    import copy

    m = _module({"trainable": "all", "init_from": "x"}, head_loss="mean", loss={"kd_weight": 1.0})
    m.attach_teacher(copy.deepcopy(m.model))  # dropout 0: the student's train mode computes what the teacher does
    m.train()
    loss, per = m.compute_loss(batch(), [0], [1.0])
    loss.backward()
    assert abs(loss.item()) < 1e-6 and abs(m._kd_stat.item()) < 1e-6
    grads = [p.grad for p in m.model.parameters() if p.grad is not None]
    assert grads and max(g.abs().max().item() for g in grads) < 1e-6
    assert not any(p.requires_grad for p in m._teacher.parameters())
    assert not any(k.startswith("_teacher") for k in m.state_dict())  # never part of a checkpoint


@pytest.mark.parametrize("recompute", [False, True])
def test_kd_loss_is_the_mixture_of_ce_and_kl(recompute):
    """Head 1: (1-λ)·CE + λ·T²·KL(softmax(z_t/T) || softmax(z_s/T)), token means over non-pad targets; the other
    heads' terms unchanged; the same with and without recomputation."""
    m, b = tiny(), batch()
    h = m.features(m.encode(b["src"]), b["tgt_in"])
    teacher = torch.randn(*b["tgt_out"].shape, 23, generator=torch.Generator().manual_seed(5)) * 3
    lam, temp = 0.3, 2.0
    w = [0.5, 0.25, 0.25]
    loss, per = bpd_loss(
        m.head_logits,
        h,
        b["tgt_out"],
        [0, 1, 2],
        w,
        PAD,
        0.1,
        recompute=recompute,
        teacher_logits=teacher,
        kd_weight=lam,
        kd_temperature=temp,
    )
    ref, rper = bpd_loss(m.head_logits, h, b["tgt_out"], [0, 1, 2], w, PAD, 0.1)
    mask = b["tgt_out"].ne(PAD)
    s = torch.log_softmax(m.head_logits(h, 0)[mask] / temp, -1)
    p = torch.softmax(teacher[mask] / temp, -1)
    kl = (p * (p.log() - s)).sum(-1).mean() * temp**2
    head1 = (1 - lam) * rper[0] + lam * kl
    assert per[0].item() == pytest.approx(head1.item(), rel=1e-5)
    assert per[1].item() == pytest.approx(rper[1].item()) and per[2].item() == pytest.approx(rper[2].item())
    assert loss.item() == pytest.approx((ref + w[0] * (head1 - rper[0])).item(), rel=1e-5)
    loss.backward()  # differentiable through the recomputed head


def test_kd_settings_are_checked():
    with pytest.raises(ValueError, match="kd_weight"):
        BPDLightningModule(tiny().config.to_dict(), {"name": "t", "block_size": 4}, {}, {"kd_weight": 1.5})
    with pytest.raises(ValueError, match="kd_temperature"):
        BPDLightningModule(
            tiny().config.to_dict(), {"name": "t", "block_size": 4}, {}, {"kd_weight": 0.5, "kd_temperature": -1}
        )
    with pytest.raises(ValueError, match="head 1"):  # frozen backbone + identity_p1: head 1 does not train
        BPDLightningModule(
            tiny().config.to_dict(),
            {"name": "t", "block_size": 4, "trainable": "heads", "init_from": "x"},
            {},
            {"kd_weight": 0.5},
        )
    m = BPDLightningModule(tiny().config.to_dict(), {"name": "t", "block_size": 4}, {}, {"kd_weight": 0.5})
    with pytest.raises(RuntimeError, match="no teacher"):
        m.compute_loss(batch(), [0], [1.0])
    with pytest.raises(ValueError, match="vocabulary"):
        m.attach_teacher(tiny(vocab=31))


def test_kd_settings_fail_early_and_refuse_sharding_strategies():
    from omegaconf import OmegaConf

    from bpd_train.training.run import TrainError, check_kd_settings

    for target in (
        "lightning.pytorch.strategies.FSDPStrategy",
        "lightning.pytorch.strategies.DeepSpeedStrategy",
        "bpd_train.training.zero_cpu.CPUDeepSpeedStrategy",
    ):
        cfg = OmegaConf.create({"loss": {"kd_weight": 0.5}, "strategy": {"_target_": target}})
        with pytest.raises(TrainError, match="strategy=auto or ddp"):
            check_kd_settings(cfg)
        check_kd_settings(OmegaConf.create({"loss": {"kd_weight": 0.0}, "strategy": {"_target_": target}}))
    check_kd_settings(
        OmegaConf.create(
            {"loss": {"kd_weight": 0.5}, "strategy": {"_target_": "lightning.pytorch.strategies.DDPStrategy"}}
        )
    )
    check_kd_settings(OmegaConf.create({"loss": {"kd_weight": 0.5}, "strategy": {"name": "auto"}}))
    with pytest.raises(TrainError, match="kd_weight must be in"):
        check_kd_settings(OmegaConf.create({"loss": {"kd_weight": 1.5}, "strategy": {"name": "auto"}}))


@pytest.mark.parametrize("recompute", [False, True])
def test_self_targets_teach_heads_head1s_own_choices(recompute):
    """loss.head_targets=self: head i at position t scores head 1's argmax at t+i (teacher-forced, pads kept) instead
    of tgt_out[t+i]; head 1 still scores the data. Gradients flow only through each head's own logits."""
    m, b = tiny(), batch()
    k, T = m.config.block_size, b["tgt_out"].size(1)
    full = m(b["src"], b["tgt_in"])  # [B,T,k,V]
    own = full[:, :, 0].argmax(-1).masked_fill(b["tgt_out"].eq(PAD), PAD)
    assert not torch.equal(own, b["tgt_out"])  # random weights: head 1 disagrees with the data somewhere
    h = m.features(m.encode(b["src"]), b["tgt_in"])
    heads = list(range(k))
    w = head_weights("mean", heads)
    loss, per = bpd_loss(m.head_logits, h, b["tgt_out"], heads, w, PAD, recompute=recompute, self_targets=True)
    for i in heads:
        tg = (b["tgt_out"] if i == 0 else own)[:, i:]
        lg, mask = full[:, : T - i, i], (b["tgt_out"] if i == 0 else own)[:, i:].ne(PAD)
        assert torch.allclose(per[i], torch.nn.functional.cross_entropy(lg[mask], tg[mask]), atol=1e-5), i
    plain, per_plain = bpd_loss(m.head_logits, h, b["tgt_out"], heads, w, PAD, recompute=recompute)
    assert torch.allclose(per[0], per_plain[0]) and not torch.allclose(per[1], per_plain[1])
    loss.backward()  # the targets are constants: no error, finite gradients
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in m.parameters())


def test_head_targets_setting_is_checked():
    assert _module({"trainable": "all", "source": "gold"}, loss={"head_targets": "self"}).self_targets
    assert not _module({"trainable": "all", "source": "gold"}).self_targets
    with pytest.raises(ValueError, match="head_targets"):
        _module({"trainable": "all", "source": "gold"}, loss={"head_targets": "teacher"})


@pytest.mark.parametrize("recompute", [False, True])
def test_self_kd_mixes_each_future_head_with_head1s_own_distribution_ahead(recompute):
    """loss.self_kd_weight = μ: head i > 0 at t scores (1-μ)·CE(tgt_out[t+i]) + μ·KL(p_head1(t+i) ‖ p_head_i(t)),
    head 1 (detached) teacher-forced; head 1's own loss is unchanged; μ = 0 is today's loss bit for bit."""
    m, b = tiny(), batch()
    k, T = m.config.block_size, b["tgt_out"].size(1)
    full = m(b["src"], b["tgt_in"])  # [B,T,k,V]
    h = m.features(m.encode(b["src"]), b["tgt_in"])
    heads, mu = list(range(k)), 0.4
    w = head_weights("mean", heads)
    loss, per = bpd_loss(m.head_logits, h, b["tgt_out"], heads, w, PAD, 0.1, recompute=recompute, self_kd_weight=mu)
    ref, rper = bpd_loss(m.head_logits, h, b["tgt_out"], heads, w, PAD, 0.1, recompute=recompute)
    zero, zper = bpd_loss(m.head_logits, h, b["tgt_out"], heads, w, PAD, 0.1, recompute=recompute, self_kd_weight=0.0)
    assert torch.equal(zero, ref) and all(torch.equal(zper[i], rper[i]) for i in heads)
    assert torch.equal(per[0], rper[0])
    for i in heads[1:]:
        mask = b["tgt_out"][:, i:].ne(PAD)  # head i's valid targets (positions t < T - i)
        p = torch.softmax(full[:, i:, 0][mask], -1)  # head 1 at t + i
        s = torch.log_softmax(full[:, : T - i, i][mask], -1)  # head i at t
        kl = (p * (p.log() - s)).sum(-1).mean()
        want = (1 - mu) * rper[i] + mu * kl
        assert per[i].item() == pytest.approx(want.item(), rel=1e-5), i
        assert kl.item() > 1e-3  # random heads: a real term, not a no-op
    loss.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in m.parameters())
    with pytest.raises(ValueError, match="self_kd_weight"):
        _module({"trainable": "all", "source": "gold"}, loss={"self_kd_weight": 1.5})
    assert _module({"trainable": "all", "source": "gold"}, loss={"self_kd_weight": 0.5}).self_kd_weight == 0.5


def chained(k=4, vocab=23) -> BPDModel:
    torch.manual_seed(0)
    m = BPDModel(
        BPDConfig(
            vocab_size=vocab,
            d_model=16,
            n_heads=2,
            n_encoder_layers=1,
            n_decoder_layers=1,
            d_ff=32,
            dropout=0.0,
            block_size=k,
            head_chain=True,
        )
    )
    for p in m.head_parameters():
        if not p.any():
            torch.nn.init.normal_(p, std=0.3)
    return m


@pytest.mark.parametrize("self_targets", [False, True])
def test_chained_heads_learn_teacher_forced_on_the_token_before_their_own(self_targets):
    """Head i reads the token before its target: the data's (head 1's own choices under self targets), shifted
    by i-1 -- each head's loss is its CE given that token, and every head parameter (the token map too) learns."""
    m, b = chained(), batch()
    h = m.features(m.encode(b["src"]), b["tgt_in"])
    y = b["tgt_out"]
    loss, per = bpd_loss(
        m.head_logits, h, y, [0, 1, 2, 3], [0.25] * 4, PAD, recompute=False, self_targets=self_targets, chain=True
    )
    series = m.head_logits(h, 0).argmax(-1).masked_fill(y.eq(PAD), PAD) if self_targets else y
    for i in range(1, 4):
        tgt = head_targets(series, i, PAD)
        logits = m.head_logits(h, i, head_targets(series, i - 1, PAD))
        want = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten(), ignore_index=PAD)
        assert torch.allclose(per[i], want, atol=1e-5), i
        # not what the head gives on its own greedy chain
        assert not torch.allclose(logits, m.head_logits(h, i))
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in m.head_parameters())


def test_chained_head_stats_condition_on_the_targets_and_count_runs():
    m, b = chained(), batch()
    with torch.no_grad():
        h = m.features(m.encode(b["src"]), b["tgt_in"])
    y = b["tgt_out"]
    st = head_stats(m.head_logits, h, y, 4, PAD, chain=True)
    run = torch.ones_like(y, dtype=torch.bool)
    acc = torch.zeros_like(y, dtype=torch.float64)
    for i in range(4):
        tgt = head_targets(y, i, PAD)
        lg = m.head_logits(h, i, head_targets(y, i - 1, PAD)) if i else m.head_logits(h, 0)
        hit = (lg.argmax(-1) == tgt) & tgt.ne(PAD)
        assert st["correct"][i] == hit.sum()
        run &= hit
        acc += run
    assert st["accepted_sum"].item() == acc[y.ne(PAD)].sum().item()


def test_chained_config_needs_identity_p1_and_copy_weights_keeps_the_backbone():
    from bpd_train.training.run import copy_weights

    with pytest.raises(ValueError, match="head_chain needs identity_p1"):
        BPDConfig(vocab_size=23, block_size=4, head_chain=True, identity_p1=False)
    src, dst = tiny(), chained()
    got = copy_weights(dst, src)  # BPD heads -> chained heads: backbone only
    assert all(not n.startswith("heads.") for n in got["copied"]) and "heads.tok" in got["new"]
    for n, t in src.state_dict().items():
        if not n.startswith("heads."):
            assert torch.equal(dst.state_dict()[n], t)
