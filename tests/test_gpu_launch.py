"""GPU launch settings checked on CPU: srun's CPUs per task, TF32 for training only, distillation workers spread
over the GPUs, FSDP's per-layer wrapping, beam search's host copies."""

import os
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["slurm/train.sbatch", "slurm/evaluate.sbatch", "slurm/distill.sbatch"])
def test_sbatch_hands_cpus_per_task_to_srun(script, tmp_path):
    # SLURM 22.05-23.02: srun ignores the job's --cpus-per-task unless SRUN_CPUS_PER_TASK says it
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    srun = bin_ / "srun"
    srun.write_text('#!/bin/bash\necho "${SRUN_CPUS_PER_TASK:-unset}" > "$FAKE_DIR/srun_cpus"\n')
    srun.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_"))}
    env.update(
        PATH=f"{bin_}:{env['PATH']}",
        FAKE_DIR=str(tmp_path),
        SLURM_JOB_ID="7",
        SLURM_SUBMIT_DIR=str(REPO),
        SLURM_CPUS_PER_TASK="6",
        SLURM_JOB_NUM_NODES="1",
        SLURM_NTASKS_PER_NODE="1",
        SLURM_NTASKS="1",
        PYTHON="python",
        STRATEGY="auto",
    )
    p = subprocess.run(
        ["bash", str(REPO / script), "+regime=base", "experiment=smoke"],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert (tmp_path / "srun_cpus").read_text().strip() == "6"


def test_tf32_on_cuda_training_only(monkeypatch):
    from bpd_train.training.trainer import enable_tf32

    before = torch.get_float32_matmul_precision()
    try:
        assert not enable_tf32("gpu") or torch.cuda.is_available()  # no GPU here: nothing changes
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert not enable_tf32("cpu") and torch.get_float32_matmul_precision() == before
        assert enable_tf32("gpu") and torch.get_float32_matmul_precision() == "high"
    finally:
        torch.set_float32_matmul_precision(before)


def test_distill_workers_spread_over_gpus():
    from bpd_train.data.distilled import DistillError
    from bpd_train.distillation.workers import Worker, worker_device

    w = [Worker(i, 8, local_rank=i % 4) for i in range(8)]
    assert [worker_device("cuda", x, 4) for x in w] == [f"cuda:{i % 4}" for i in range(8)]
    assert [worker_device("auto", x, 2) for x in w[:4]] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert worker_device("auto", w[3], 0) == "cpu"
    assert worker_device("cuda:1", w[0], 4) == "cuda:1" and worker_device("cpu", w[2], 4) == "cpu"
    with pytest.raises(DistillError, match="no CUDA device"):
        worker_device("cuda", w[0], 0)


def test_fsdp_strategy_wraps_each_layer():
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from bpd_train.model import BPDConfig, BPDModel, LMConfig, LMModel
    from bpd_train.model.layers import DecoderLayer, EncoderLayer
    from bpd_train.model.lm.model import Layer

    with initialize_config_dir(str(REPO / "conf"), version_base="1.3", job_name="t"):
        cfg = compose("train", overrides=["+regime=base", "experiment=smoke", "strategy=fsdp"])
    policy = instantiate(cfg.strategy.auto_wrap_policy)
    wrapped = policy._module_classes
    assert {EncoderLayer, DecoderLayer, Layer} <= set(wrapped)
    # every layer of both families is a unit of its own; embeddings and heads stay in the root unit
    ed = BPDModel(
        BPDConfig(vocab_size=20, d_model=8, n_heads=2, n_encoder_layers=2, n_decoder_layers=2, d_ff=8, block_size=2)
    )
    lm = LMModel(LMConfig(vocab_size=20, d_model=8, n_heads=2, n_layers=2, d_ff=8, block_size=2))
    for model, n in ((ed, 4), (lm, 2)):
        assert sum(isinstance(m, tuple(wrapped)) for m in model.modules()) == n


def test_beam_search_copies_only_ending_hypotheses(monkeypatch):
    # when hypotheses end, only their rows go to the host, not all batch x beam rows
    from bpd_train.decoding.beam import beam_search
    from bpd_train.model import BPDConfig, BPDModel

    torch.manual_seed(0)
    model = BPDModel(
        BPDConfig(vocab_size=12, d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=16, dropout=0.0)
    ).eval()
    src = torch.randint(4, 12, (3, 6))
    src[1, 3:] = 0  # shorter sources reach their max_len (forced EOS) first, while the others go on
    src[2, 2:] = 0
    ref = beam_search(model, src, beam_size=3, max_len=(1.0, 6))
    rows = []
    real = torch.Tensor.tolist

    def spy(t):
        if t.dim() == 2 and t.dtype == torch.long:
            rows.append(t.shape[0])
        return real(t)

    monkeypatch.setattr(torch.Tensor, "tolist", spy)
    out = beam_search(model, src, beam_size=3, max_len=(1.0, 6))
    monkeypatch.undo()
    assert out.tokens == ref.tokens and out.scores == ref.scores
    # the first hypotheses to end belong to one sentence of three: its rows alone, not all 3 x 3
    assert rows and rows[0] <= 3 < 3 * 3


def test_bench_gpu_chains_compose_and_summarise():
    # bench/gpu.py's training chains (run on a lent GPU) compose as configs, and the markdown summary renders
    import importlib.util

    from hydra import compose, initialize_config_dir

    spec = importlib.util.spec_from_file_location("bench_gpu", REPO / "bench" / "gpu.py")
    gpu = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu)
    assert set(gpu.TRAIN_CHAINS) == {"deepspeed_zero2", "deepspeed_zero3", "fsdp"}
    for group, extra in gpu.TRAIN_CHAINS.values():
        with initialize_config_dir(str(REPO / "conf"), version_base="1.3", job_name="t"):
            cfg = compose(
                "train",
                overrides=[
                    "+regime=frozen",
                    "experiment=smoke",
                    *gpu.GPU_TRAINER,
                    f"strategy={group}",
                    *extra,
                    "steps.base=20",
                ],
            )
        assert cfg.trainer.precision == "bf16-mixed"
        if group == "deepspeed_zero3":
            assert cfg.strategy.param_persistence_threshold == 0
    md = gpu.markdown_summary(
        {
            "ok": False,
            "gpu": "X",
            "sections": {
                "exactness": {"ok": True, "mismatched_rows": 0, "cases": 9, "s": 1.0},
                "train": {"ok": False, "fsdp": {"ok": False, "backbone_identical": True, "val_agreement": [100.0]}},
                "compile": {"skipped": "CUDA only"},
            },
            "errors": {"train": "boom"},
        }
    )
    assert "| exactness | ok |" in md and "| train | FAILED |" in md and "error in train: boom" in md
