"""Model families (bpd_train/families): which family a config, model or name belongs to, what each builds, and
that the pipeline asks the family instead of checking the model's kind itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from bpd_train.engine.weights import default_weights
from bpd_train.families import ModelFamily, families, family_of, get_family
from bpd_train.model import BPDConfig, BPDModel, LMConfig, LMModel, build_model, config_from_dict

ROOT = Path(__file__).resolve().parent.parent


def _lm_config(**kw) -> LMConfig:
    return LMConfig(
        vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_ff=32, max_positions=16, bos_id=1, eos_id=2, **kw
    )


def _mt_config() -> BPDConfig:
    return BPDConfig(
        vocab_size=32, d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32, max_positions=16
    )


def test_family_of_every_kind_of_thing():
    lm, mt = get_family("lm"), get_family("mt")
    assert family_of({}) is mt and family_of({"arch": None}) is mt and family_of({"arch": "lm"}) is lm
    assert family_of("lm") is lm and family_of(lm) is lm
    c = _lm_config()
    assert family_of(c) is lm and family_of(c.to_dict()) is lm and family_of(build_model(c)) is lm
    m = _mt_config()
    assert family_of(m) is mt and family_of(m.to_dict()) is mt and family_of(BPDModel(m)) is mt
    from omegaconf import OmegaConf

    assert family_of(OmegaConf.create({"arch": "lm", "d_model": 8})) is lm
    assert family_of(OmegaConf.create({"d_model": 8})) is mt
    with pytest.raises(ValueError, match="unknown model arch"):
        family_of({"arch": "rnn"})
    with pytest.raises(ValueError, match="unknown model family"):
        get_family("rnn")
    assert [f.name for f in families()] == ["lm", "mt"]  # the hf: import asks the more specific family first


def test_each_family_builds_and_reads_back_its_own_configs():
    for config, model_cls in ((_lm_config(block_size=2), LMModel), (_mt_config(), BPDModel)):
        fam = family_of(config)
        assert isinstance(fam, ModelFamily) and fam.config_class is type(config) and fam.model_class is model_cls
        assert config_from_dict(config.to_dict()) == config
        model = fam.build(config)
        assert isinstance(model, model_cls)
        layers = {type(m) for m in model.modules() if isinstance(m, fam.layer_classes)}
        assert layers == set(fam.layer_classes)  # FSDP wraps each of them
        assert set(fam.head_fields) >= {"block_size", "head_d_hidden", "identity_p1"}
    assert get_family("lm").medusa_draft_problem(_lm_config(block_size=2, heads="medusa")) is None
    assert get_family("mt").medusa_draft_problem(_mt_config()) == "an encoder-decoder model"


def test_the_pipeline_does_not_check_the_models_kind_itself():
    """Outside families/ and model/ only the two `is_lm` properties remain (LoadedModel's and Translator's, kept
    for callers of the earlier API); nothing compares a config's arch."""
    hits = []
    for path in sorted((ROOT / "bpd_train").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(("bpd_train/families/", "bpd_train/model/")):
            continue
        for no, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if re.search(r"is_lm|\barch\b[^\n]*[!=]=|[\"']arch[\"']", line):
                hits.append(f"{rel}:{no}: {line.strip()}")
    assert [h.split(":")[0] for h in hits] == ["bpd_train/app/api.py", "bpd_train/sources/loading.py"], "\n".join(hits)


def test_models_and_the_decode_engine_live_apart():
    """bpd_train/model holds the model definitions (pure torch); the decode engine -- the step protocol, each
    family's step weights, packed linears, the packed-weight cache a decoder owns, the C++ kernels and native loops --
    is bpd_train/engine. The models import nothing from it: a decoder hands them their step weights."""
    engine = sorted(
        p.relative_to(ROOT / "bpd_train" / "engine").as_posix()
        for p in (ROOT / "bpd_train" / "engine").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    )
    assert [f for f in engine if not f.startswith("csrc/")] == [
        "__init__.py",
        "fastlinear.py",
        "lm.py",
        "mt.py",
        "packed.py",
        "q4blocks.py",
        "step.py",
        "weights.py",
    ]
    assert "csrc/linear.cpp" in engine and all(f.endswith((".cpp", ".h")) for f in engine if f.startswith("csrc/"))
    model = ROOT / "bpd_train" / "model"
    assert not (model / "csrc").exists()
    for path in sorted(model.rglob("*.py")):
        assert "bpd_train.engine" not in path.read_text(encoding="utf-8"), path.name


def test_both_families_decode_through_one_step_protocol():
    """Every decoder calls a model's decode weights through engine/step.py's DecodeStep; each family implements it
    once (DecodeWeights, LMDecodeWeights), every member defined on the class itself, not left to duck typing."""
    import inspect

    import torch

    from bpd_train.engine.lm import LMDecodeWeights
    from bpd_train.engine.mt import DecodeWeights
    from bpd_train.engine.step import DecodeStep
    from bpd_train.model import BPDConfig, BPDModel, LMConfig, LMModel

    torch.manual_seed(0)
    models = {
        DecodeWeights: BPDModel(
            BPDConfig(
                vocab_size=11, d_model=16, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=32, block_size=2
            )
        ),
        LMDecodeWeights: LMModel(
            LMConfig(vocab_size=11, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, d_ff=32, block_size=2, eos_id=2)
        ),
    }
    members = [n for n in dir(DecodeStep) if not n.startswith("_")] + list(DecodeStep.__annotations__)
    for cls, model in models.items():
        assert DecodeStep in cls.__mro__  # declared, not duck-typed
        w = default_weights(model.eval()).get(model)
        assert type(w) is cls and isinstance(w, DecodeStep)
        for name in members:
            assert hasattr(w, name), (cls.__name__, name)
            if callable(getattr(DecodeStep, name, None)):
                assert getattr(cls, name) is not getattr(DecodeStep, name), (cls.__name__, name)  # its own
                assert (
                    list(inspect.signature(getattr(cls, name)).parameters)[:3]
                    == list(inspect.signature(getattr(DecodeStep, name)).parameters)[:3]
                ), (cls.__name__, name)
