"""transformers LlamaForCausalLM / Qwen2ForCausalLM -> LMModel: logits, greedy (batch of different-length
prompts, left-padded on the transformers side) and blockwise parity against transformers itself, on tiny
random-weight models, and the tokenizer (tokenizer.json + chat template) against transformers' tokenizer."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from _lm_tiny import WORDS, make_tokenizer  # noqa: E402
from _lm_tiny import randomize as _randomize  # noqa: E402

from bpd_train.decoding import Distance, Exact, TopK, blockwise, greedy  # noqa: E402
from bpd_train.sources.convert.hf import ConvertError  # noqa: E402
from bpd_train.sources.convert.hf.lm import family_of, load_hf_lm  # noqa: E402

PROMPTS = ["the quick brown fox", "hello", "a stitch in time saves nine and the lazy dog", "how are"]
MAX_NEW = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    # Llama: GQA (4 query heads on 2 key/value heads), separate output projection, BOS added by the tokenizer
    f = tmp_path_factory.mktemp("llama")
    v = make_tokenizer(f, bos=True)
    cfg = transformers.LlamaConfig(
        vocab_size=v,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=500.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    _randomize(transformers.LlamaForCausalLM(cfg).eval(), 0, 2).save_pretrained(f)
    out["llama"] = f
    # Qwen2: q/k/v biases, tied embeddings, one key/value head, no BOS, EOS = <|im_end|>
    f = tmp_path_factory.mktemp("qwen2")
    v = make_tokenizer(f, bos=False)
    cfg = transformers.Qwen2Config(
        vocab_size=v,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        eos_token_id=4,
        bos_token_id=None,
    )
    torch.manual_seed(1)
    _randomize(transformers.Qwen2ForCausalLM(cfg).eval(), 1, 4).save_pretrained(f)
    out["qwen2"] = f
    # Llama 3.x rotary scaling, every bias Llama allows, tied embeddings
    f = tmp_path_factory.mktemp("llama3")
    v = make_tokenizer(f, bos=True)
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    cfg = transformers.LlamaConfig(
        vocab_size=v,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        rope_parameters=rope,
        attention_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(2)
    _randomize(transformers.LlamaForCausalLM(cfg).eval(), 2, 2).save_pretrained(f)
    out["llama3"] = f
    # Mistral without a sliding window, explicit head_dim != hidden/heads
    f = tmp_path_factory.mktemp("mistral")
    v = make_tokenizer(f, bos=True)
    cfg = transformers.MistralConfig(
        vocab_size=v,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        max_position_embeddings=64,
        sliding_window=None,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(3)
    _randomize(transformers.MistralForCausalLM(cfg).eval(), 3, 2).save_pretrained(f)
    out["mistral"] = f
    return out


def _hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def _htok(folder):
    # the generic tokenizers backend: AutoTokenizer would pick Qwen2Tokenizer by model_type, which rebuilds a
    # byte-level BPE that this word-level test vocabulary is not
    return transformers.PreTrainedTokenizerFast.from_pretrained(folder)


def _cut(row, eos):
    out = []
    for t in row:
        if t == eos:
            break
        out.append(t)
    return out


@pytest.mark.parametrize("name", ["llama", "qwen2", "llama3", "mistral"])
def test_logits_match_transformers(folders, name):
    model, tok, meta = load_hf_lm(folders[name])
    fam = {"llama3": "llama"}.get(name, name)
    assert meta["family"] == fam and family_of(folders[name]) == fam
    assert (model.lm_head is None) == (name in ("qwen2", "llama3"))  # tied / untied both covered
    assert model.config.kv_heads < model.config.n_heads  # GQA
    if name == "llama3":
        assert model.config.rope_scaling["rope_type"] == "llama3" and model.config.o_bias and model.config.mlp_bias
    hf = _hf(folders[name])
    texts = PROMPTS + [" ".join(WORDS * 2)]  # 50 tokens: past llama3's original 16 positions
    for text in texts:
        ids = torch.tensor([tok.encode(text)])
        with torch.no_grad():
            want = hf(ids).logits
            got = model(ids)[:, :, 0]
        assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("fam", ["llama", "qwen2"])
def test_greedy_matches_generate_on_a_padded_batch(folders, fam):
    model, tok, _ = load_hf_lm(folders[fam], block_size=3)
    hf = _hf(folders[fam])
    eos = model.config.eos_id
    htok = _htok(folders[fam])
    htok.pad_token, htok.padding_side = "<unk>", "left"
    enc = htok(PROMPTS, return_tensors="pt", padding=True)
    assert [
        [t for t, m in zip(r, mk) if m] for r, mk in zip(enc["input_ids"].tolist(), enc["attention_mask"].tolist())
    ] == tok.encode(PROMPTS)
    with torch.no_grad():
        gen = hf.generate(
            **enc, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=htok.pad_token_id
        )
    want = [_cut(r, eos) for r in gen[:, enc["input_ids"].shape[1] :].tolist()]
    assert len({len(w) for w in want}) > 1, "test model should give outputs of different lengths"
    prompts = tok.encode(PROMPTS)
    got = greedy(model, prompts, max_len=MAX_NEW)
    assert got.tokens == want
    # random heads on the imported model: exact blockwise is greedy, token for token
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.head_parameters():
            p.normal_(0, 0.3)
    for rule in (Exact(), TopK(1), Distance(0.0)):
        assert blockwise(model, prompts, accept=rule, max_len=MAX_NEW).tokens == want, rule


def test_several_eos_ids_stop_like_generate(folders, tmp_path):
    """A generation_config.json listing two EOS ids (Llama 3 instruct's [<|end_of_text|>, <|eot_id|>]): they are
    imported, and greedy, blockwise, sampling at temperature 0 and beam size 1 stop where transformers' generate
    (reading the same generation_config) stops, on a batch of different-length prompts; the export writes the list
    back."""
    import shutil

    from bpd_train.decoding import beam_search
    from bpd_train.decoding.sampling import sample
    from bpd_train.sources.convert.hf.lm import to_hf_lm

    f = tmp_path / "m"
    shutil.copytree(folders["llama"], f)
    hf = _hf(f)
    htok = _htok(f)
    htok.pad_token, htok.padding_side = "<unk>", "left"
    enc = htok(PROMPTS, return_tensors="pt", padding=True)
    with torch.no_grad():
        one = hf.generate(**enc, do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=2, pad_token_id=0)
    outs = [_cut(r, 2) for r in one[:, enc["input_ids"].shape[1] :].tolist()]
    # the second EOS: a token some rows produce before their end and others never (so both ids end some row)
    counts = {}
    for r in outs:
        for t in set(r[1:]):
            counts[t] = counts.get(t, 0) + 1
    second = min((t for t, n in counts.items() if n < len(outs) and t != 2), key=lambda t: (-counts[t], t))
    gen = json.loads((f / "generation_config.json").read_text())
    (f / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, second]}))
    hf = _hf(f)
    assert hf.generation_config.eos_token_id == [2, second]
    with torch.no_grad():
        ref = hf.generate(**enc, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)
    new = ref[:, enc["input_ids"].shape[1] :].tolist()
    want = []
    for r in new:
        cut = next((i for i, t in enumerate(r) if t in (2, second)), len(r))
        want.append(r[:cut])
    ends = {r[len(w)] for r, w in zip(new, want) if len(w) < len(r)}
    assert ends == {2, second}, "both EOS ids should end some row"
    assert want != outs

    model, tok, _ = load_hf_lm(f, block_size=3)
    assert (model.config.eos_id, model.config.eos_ids) == (2, [2, second])
    prompts = tok.encode(PROMPTS)
    assert greedy(model, prompts, max_len=MAX_NEW).tokens == want
    assert sample(model, prompts, max_len=MAX_NEW, temperature=0.0).tokens == want
    assert beam_search(model, prompts, beam_size=1, max_len=MAX_NEW).tokens == want
    torch.manual_seed(3)
    with torch.no_grad():
        for p in model.head_parameters():
            p.normal_(0, 0.3)
    for rule in (Exact(), TopK(1)):  # TopK(1): the rule path (verdicts computed), same output
        assert blockwise(model, prompts, accept=rule, max_len=MAX_NEW).tokens == want, rule
        assert [blockwise(model, [p], accept=rule, max_len=MAX_NEW).tokens[0] for p in prompts] == want, rule
    assert blockwise(model, prompts, max_len=MAX_NEW, adaptive=True).tokens == want
    out = to_hf_lm(model, tmp_path / "out", tokenizer_folder=f)
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == [2, second]
    assert load_hf_lm(out)[0].config == model.config


def test_tokenizer_matches_transformers(folders):
    for fam in ("llama", "qwen2"):
        _, tok, _ = load_hf_lm(folders[fam])
        htok = _htok(folders[fam])
        for text in PROMPTS:
            assert tok.encode(text) == htok(text)["input_ids"]
        ids = tok.encode(PROMPTS[2])
        assert tok.decode(ids) == htok.decode(ids, skip_special_tokens=True)
        chat = [{"role": "system", "content": "good morning"}, {"role": "user", "content": "how are you"}]
        want = htok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        assert tok.render_chat(chat) == want
        assert tok.chat_ids(chat) == htok.apply_chat_template(
            chat, tokenize=True, add_generation_prompt=True, return_dict=False
        )
        assert (tok.eos_id, tok.bos_id) == ((2, 1) if fam == "llama" else (4, None))


def test_refusals(folders, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    f = tmp_path / "m"
    shutil.copytree(folders["llama"], f)
    cfg = json.loads((f / "config.json").read_text())
    # an unsupported rope scaling: one line, before any weight is read
    bad = {**cfg, "rope_parameters": {"rope_type": "yarn", "rope_theta": 500.0, "factor": 4.0}}
    (f / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConvertError, match="rope scaling type 'yarn'"):
        load_hf_lm(f)
    # an architecture we do not import
    for arch in ("GPT2LMHeadModel", "GemmaForCausalLM"):
        (f / "config.json").write_text(json.dumps({**cfg, "architectures": [arch]}))
        with pytest.raises(ConvertError, match=f"unsupported decoder-only architecture {arch}"):
            family_of(f)
    (f / "config.json").write_text(json.dumps({**cfg, "architectures": ["MarianMTModel"]}))
    assert family_of(f) is None
    # a tensor the map does not know is never skipped
    (f / "config.json").write_text(json.dumps(cfg))
    sd = load_file(str(f / "model.safetensors"))
    sd["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    save_file(sd, str(f / "model.safetensors"))
    with pytest.raises(ConvertError, match="q_norm"):
        load_hf_lm(f)
    # chats need a template
    (f / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    from bpd_train.data.hf_tokenizer import TokenizerError
    from bpd_train.data.lm.tokenizer import LMTokenizer

    with pytest.raises(TokenizerError, match="no chat template"):
        LMTokenizer(f).chat_ids([{"role": "user", "content": "hello"}])


@pytest.mark.parametrize("name,heads", [("llama", "medusa"), ("qwen2", "bpd")])
def test_export_round_trip(folders, tmp_path, name, heads):
    """to_hf_lm writes a folder transformers loads (same logits) and load_hf_lm reads back with its heads."""
    from bpd_train.sources.convert.hf.lm import to_hf_lm

    model, tok, _ = load_hf_lm(folders[name], block_size=3, heads=heads)
    torch.manual_seed(4)
    with torch.no_grad():
        for p in model.head_parameters():
            p.normal_(0, 0.2)
    out = to_hf_lm(model, tmp_path / "out", tokenizer_folder=folders[name])
    ids = torch.tensor([tok.encode(PROMPTS[2])])
    with torch.no_grad():
        assert (_hf(out)(ids).logits - model(ids)[:, :, 0]).abs().max().item() < 1e-4
    back, _, meta = load_hf_lm(out)
    assert meta["heads_loaded"] and back.config == model.config
    with torch.no_grad():
        assert torch.equal(back(ids), model(ids))
    fresh, _, meta = load_hf_lm(out, block_size=2)  # another k: fresh heads, same backbone
    assert not meta["heads_loaded"] and fresh.config.block_size == 2


def test_docs_python_block_runs(folders, tmp_path):
    """docs/decoder-only.md's Python API block runs as written (on the tiny Llama folder)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "decoder-only.md").read_text(encoding="utf-8")
    code = text.split("## Python API", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(code, "docs/decoder-only.md#python-api", "exec"), {"folder": folders["llama"], "out": tmp_path})
    assert (tmp_path / "medusa" / "model.safetensors").is_file() and (tmp_path / "hf" / "config.json").is_file()


def test_chained_heads_are_refused_by_the_hf_export_and_kept_by_a_bundle(folders, tmp_path):
    """Chained heads (model.heads=chain) have no transformers heads-file format: export.format=hf says so in one
    line and writes nothing; a bundle keeps them (same proposals after loading)."""
    from bpd_train.sources.bundle import load_bundle, write_bundle
    from bpd_train.sources.convert.hf.lm import to_hf_lm

    model, tok, _ = load_hf_lm(folders["llama"], block_size=3, heads="chain")
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.head_parameters():
            p.normal_(0, 0.2)
    with pytest.raises(ConvertError, match="chained heads.*export.format=bundle"):
        to_hf_lm(model, tmp_path / "out", tokenizer_folder=folders["llama"])
    assert not (tmp_path / "out").exists()
    ids = torch.tensor([tok.encode(PROMPTS[2])])
    with torch.no_grad():
        want = model(ids)
    write_bundle(model, folders["llama"], tmp_path / "bundle")
    back_model, _, _ = load_bundle(tmp_path / "bundle")
    assert back_model.config.heads == "chain"
    with torch.no_grad():
        assert torch.equal(back_model(ids), want)
