"""Medusa heads -> vLLM's `medusa` checkpoint: replay vLLM's config and weight loading on the exported folder
(fails on any tensor vLLM would skip or any parameter it would leave unloaded) and vLLM's Medusa forward on
the exported tensors against our heads' logits.

The replay is re-implemented from reading vLLM (not imported: vLLM is not a dependency):
  vllm/model_executor/models/medusa.py        at commit 01dbb08195ca9c70ac9044786a906a353e07fcdf
      ResidualBlock: num_hidden_layers Linear(hidden, hidden, bias=config.medusa_fc_bias or False), x + SiLU(Wx+b);
      Medusa: blocks.{j} for j < num_heads; original_lm_head -> one lm_head shared by all heads, else lm_heads.{j};
      load_weights: strips "medusa_heads.", token_map kept only if truncated_vocab_size < vocab_size,
      "lm_heads.0.weight" -> "lm_head.weight" under original_lm_head, every other unknown name skipped silently;
      lm_head rows sliced by token_map; logits scattered back into the full vocabulary (-inf elsewhere).
  vllm/transformers_utils/configs/medusa.py   at commit 0531c2226a6a25cd96ccc856f3bda3f0bb4efb5f
      config keys containing "num" and "heads" -> num_heads, "num" and "layers" -> num_hidden_layers;
      truncated_vocab_size defaults to vocab_size.
"""

import json

import pytest
import torch
import torch.nn.functional as F

from bpd_train.model import LMConfig, LMModel
from bpd_train.sources.convert.hf import ConvertError
from bpd_train.sources.convert.vllm_medusa import export_medusa


def vllm_config(folder):
    """MedusaConfig.from_pretrained: the key renaming, then the constructor's defaults."""
    d = json.loads((folder / "config.json").read_text())
    for k in list(d):
        if "num" in k:
            if "heads" in k:
                d["num_heads"] = d.pop(k)
            elif "layers" in k:
                d["num_hidden_layers"] = d.pop(k)
    d.setdefault("num_heads", 5)
    d.setdefault("num_hidden_layers", 1)
    d.setdefault("hidden_size", 4096)
    d.setdefault("vocab_size", 32001)
    if d.get("truncated_vocab_size") is None:
        d["truncated_vocab_size"] = d["vocab_size"]
    return d


def vllm_load(folder):
    """Medusa.__init__'s parameter names and load_weights -> (params, token_map, skipped, missing)."""
    from safetensors.torch import load_file

    cfg = vllm_config(folder)
    h, v, tv = cfg["hidden_size"], cfg["vocab_size"], cfg["truncated_vocab_size"]
    bias = bool(cfg.get("medusa_fc_bias", False))
    shapes = {}
    for j in range(cfg["num_heads"]):
        for layer in range(cfg["num_hidden_layers"]):
            shapes[f"blocks.{j}.layers.{layer}.weight"] = (h, h)
            if bias:
                shapes[f"blocks.{j}.layers.{layer}.bias"] = (h,)
    if cfg.get("original_lm_head", False):
        shapes["lm_head.weight"] = (tv, h)
    else:
        shapes.update({f"lm_heads.{j}.weight": (tv, h) for j in range(cfg["num_heads"])})
    token_map, loaded, skipped = None, {}, []
    for name, w in load_file(str(folder / "model.safetensors")).items():
        name = name.replace("medusa_heads.", "")
        if name == "token_map":
            if tv < v:
                token_map = w
            else:
                skipped.append(name)
        elif name in shapes:
            loaded[name] = w
        elif cfg.get("original_lm_head", False) and name == "lm_heads.0.weight":
            loaded["lm_head.weight"] = w
        else:
            skipped.append(name)
    assert tv == v or token_map is not None, "vLLM asserts a token_map when truncated_vocab_size < vocab_size"
    for name, w in loaded.items():
        if "lm_head" in name and token_map is not None and w.shape[0] > token_map.shape[0]:
            loaded[name] = w[token_map]
        # ParallelLMHead pads its rows (vocab padding); the loaded rows must fit and be complete up to tv
        want = shapes[name]
        assert tuple(loaded[name].shape) == want, (name, tuple(loaded[name].shape), want)
    return cfg, loaded, token_map, skipped, sorted(set(shapes) - set(loaded))


def vllm_logits(cfg, params, token_map, hidden):
    """Medusa.forward + compute_logits on the target model's final (normed) hidden states [N,D]."""
    out = []
    for j in range(cfg["num_heads"]):
        x = hidden
        for layer in range(cfg["num_hidden_layers"]):
            x = x + F.silu(
                F.linear(x, params[f"blocks.{j}.layers.{layer}.weight"], params.get(f"blocks.{j}.layers.{layer}.bias"))
            )
        head = params["lm_head.weight"] if cfg.get("original_lm_head") else params[f"lm_heads.{j}.weight"]
        lg = F.linear(x, head) * cfg.get("logit_scale", 1.0)
        if token_map is not None:
            full = torch.full((*lg.shape[:-1], cfg["vocab_size"]), -torch.inf)
            full[..., token_map] = lg
            lg = full
        out.append(lg)
    return torch.stack(out, dim=-2)  # [N,heads,V]


def _medusa(layers=2, tie=True):
    torch.manual_seed(0)
    m = LMModel(
        LMConfig(
            vocab_size=40,
            d_model=16,
            n_layers=1,
            n_heads=2,
            d_ff=24,
            block_size=4,
            heads="medusa",
            medusa_layers=layers,
            tie_output=tie,
        )
    ).eval()
    with torch.no_grad():
        for p in m.head_parameters():
            p.normal_(0, 0.3)
    return m


@pytest.mark.parametrize("layers,tie", [(1, True), (2, False)])
def test_vllm_loads_every_tensor_and_computes_our_heads(tmp_path, layers, tie):
    m = _medusa(layers, tie)
    out = export_medusa(m, tmp_path / "medusa")
    cfg, params, token_map, skipped, missing = vllm_load(out)
    assert skipped == [] and missing == []
    assert cfg["num_heads"] == 3 and cfg["num_hidden_layers"] == layers
    h = torch.randn(5, 16)
    with torch.no_grad():
        ours = m.heads_logits(h)[:, 1:]  # heads 2..k
        theirs = vllm_logits(cfg, params, token_map, m.norm(h))
    assert (ours - theirs).abs().max().item() < 1e-5
    # a draft vocabulary travels as token_map; vLLM then scores only those ids
    draft = [0, 3, 5, 7, 11, 30]
    out2 = export_medusa(m, tmp_path / "draft", draft_vocab=draft)
    cfg, params, token_map, skipped, missing = vllm_load(out2)
    assert skipped == [] and missing == [] and token_map.tolist() == draft
    with torch.no_grad():
        theirs = vllm_logits(cfg, params, token_map, m.norm(h))
    assert torch.equal(theirs.argmax(-1), torch.tensor(draft)[ours[..., draft].argmax(-1)])
    # overwrite replaces only a folder this exporter wrote
    export_medusa(m, out, overwrite=True)
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        export_medusa(m, tmp_path / "user", overwrite=True)


def test_replay_catches_what_vllm_would_drop(tmp_path):
    """The vLLM issue 8620 failure: without medusa_fc_bias vLLM builds bias-free blocks and skips our biases."""
    out = export_medusa(_medusa(), tmp_path / "m")
    cfg = json.loads((out / "config.json").read_text())
    assert not [k for k in cfg if "num" in k and k not in ("num_heads", "num_hidden_layers")]
    del cfg["medusa_fc_bias"]
    (out / "config.json").write_text(json.dumps(cfg))
    skipped = vllm_load(out)[3]
    assert skipped and all(s.endswith(".bias") for s in skipped)


def test_only_medusa_heads_export(tmp_path):
    bpd = LMModel(LMConfig(vocab_size=40, d_model=16, n_layers=1, n_heads=2, d_ff=24, block_size=3))
    with pytest.raises(ConvertError, match="heads=bpd"):
        export_medusa(bpd, tmp_path / "x")
    assert not (tmp_path / "x").exists()
