"""transformers' own generate() decodes with the heads of an `export.format=hf` folder, for both families:
custom_generate/generate.py (bpd_train/hf_generate), which the export writes beside bpd_heads.safetensors, gives
exactly transformers' greedy output (do_sample=False, a plain load of the same folder), with as many decoder forward
passes per row as bpd-train's own blockwise decoder makes decoder calls (with its prefill): the heads propose what
bpd-train's heads propose. Decoder-only (Llama / Qwen2 folders) and encoder-decoder (Marian, Pegasus for this
project's own translation models, M2M100 with its forced target-language token)."""

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

PROMPTS = [[1, 5, 6, 7], [1, 9, 3], [1, 11, 12, 13, 14, 15]]
MAX_NEW = 20


def _export(tmp_path, kind: str, init: str, identity_p1: bool = True):
    from bpd_train.model.lm.config import LMConfig
    from bpd_train.model.lm.model import LMModel
    from bpd_train.sources.convert.hf.lm import to_hf_lm

    torch.manual_seed(0)
    cfg = LMConfig(
        vocab_size=40,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_positions=128,
        block_size=4,
        heads=kind,
        eos_id=2,
        bos_id=1,
        identity_p1=identity_p1,
    )
    model = LMModel(cfg).eval()
    with torch.no_grad():
        for p in model.head_parameters():
            # zero: every head proposes head 1's token (accepted where the output repeats); small: mostly that,
            # sometimes not; random: rarely right
            if init != "zero":
                p.normal_(0, {"small": 0.02, "random": 0.3}[init])
    out = to_hf_lm(model, tmp_path / f"{kind}-{init}")
    assert (out / "custom_generate" / "generate.py").is_file()  # written with the heads
    return model, out


def _padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.mark.parametrize(
    "kind,init", [("bpd", "zero"), ("bpd", "small"), ("bpd", "random"), ("medusa", "zero"), ("medusa", "random")]
)
def test_generate_with_heads_is_transformers_greedy(tmp_path, kind, init):
    from transformers import AutoModelForCausalLM

    from bpd_train.decoding import blockwise

    model, folder = _export(tmp_path, kind, init)
    ids, mask = _padded(PROMPTS)
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        want = plain.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0
        )
    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    got = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, pad_token_id=0)
    assert torch.equal(got, want)
    # the same passes as bpd-train's blockwise decoder, row by row: the heads are computed as bpd-train computes them
    total = 0
    for p in PROMPTS:
        r = blockwise(model, [p], max_len=MAX_NEW)
        out = hf.generate(input_ids=torch.tensor([p]), max_new_tokens=MAX_NEW, pad_token_id=0)
        assert out[0, len(p) :].tolist()[: len(r.tokens[0])] == r.tokens[0]
        assert hf.bpd_stats["passes"] == r.calls + r.prefill_calls, (hf.bpd_stats, r.calls)  # + the prompt's
        total += hf.bpd_stats["passes"]
    if init == "zero":
        assert total < len(PROMPTS) * MAX_NEW / 2  # heads accepted: fewer passes than tokens


def test_custom_generate_on_a_plain_load_and_heads_not_first_head(tmp_path):
    """generate(custom_generate=folder) on a model loaded without remote code; heads whose head 1 is not the LM's
    own (identity_p1=false) only propose: the output is still transformers' greedy."""
    from transformers import AutoModelForCausalLM

    _, folder = _export(tmp_path, "bpd", "small", identity_p1=False)
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids, mask = _padded(PROMPTS)
    with torch.no_grad():
        want = plain.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0
        )
    got = plain.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=MAX_NEW,
        pad_token_id=0,
        custom_generate=str(folder),
        trust_remote_code=True,
    )
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="num_beams=1"):
        plain.generate(
            input_ids=ids, max_new_tokens=4, num_beams=2, custom_generate=str(folder), trust_remote_code=True
        )
    with pytest.raises(ValueError, match="typical_p"):  # a sampling option this decoder does not apply: refused
        plain.generate(
            input_ids=ids,
            max_new_tokens=4,
            do_sample=True,
            typical_p=0.5,
            custom_generate=str(folder),
            trust_remote_code=True,
        )
    with pytest.raises(ValueError, match="repetition_penalty"):  # would change greedy's choices: refused
        plain.generate(
            input_ids=ids, max_new_tokens=4, repetition_penalty=1.3, custom_generate=str(folder), trust_remote_code=True
        )


def test_generate_file_needs_only_torch_safetensors_transformers():
    """The file runs where bpd-train is not installed: it imports nothing of bpd_train."""
    import ast

    from bpd_train.hf_generate import TEMPLATE

    tree = ast.parse(TEMPLATE.read_text(encoding="utf-8"))
    roots = {
        (n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        for a in (n.names if isinstance(n, ast.Import) else [n])
    }
    assert roots <= {
        "__future__",
        "json",
        "os",
        "inspect",
        "typing",
        "torch",
        "safetensors",
        "transformers",
        "huggingface_hub",
    }, roots


def test_written_where_the_export_is(tmp_path):
    from bpd_train.hf_generate import TEMPLATE, write_custom_generate

    dest = write_custom_generate(tmp_path / "x")
    assert dest == tmp_path / "x" / "custom_generate" / "generate.py"
    assert dest.read_bytes() == TEMPLATE.read_bytes()
    shutil.rmtree(tmp_path / "x")


def test_docs_block_runs(tmp_path):
    """docs/decoder-only.md's block on transformers' generate runs as written."""
    from conftest import REPO_ROOT

    from bpd_train.model.lm.config import LMConfig
    from bpd_train.model.lm.model import LMModel
    from bpd_train.sources.convert.hf.lm import to_hf_lm

    text = (REPO_ROOT / "docs" / "decoder-only.md").read_text(encoding="utf-8")
    code = text.split("## transformers' own `generate()` with the heads", 1)[1].split("```python\n", 1)[1]
    code = code.split("```", 1)[0]
    torch.manual_seed(0)
    cfg = LMConfig(
        vocab_size=40,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_positions=128,
        block_size=3,
        heads="medusa",
        eos_id=2,
        bos_id=1,
    )
    folder = to_hf_lm(LMModel(cfg).eval(), tmp_path / "hf")
    ids, mask = _padded(PROMPTS)
    scope = {"folder": folder, "ids": ids, "mask": mask}
    exec(compile(code, "docs/decoder-only.md#transformers-own-generate-with-the-heads", "exec"), scope)
    assert scope["out"].shape[0] == len(PROMPTS) and scope["model"].bpd_stats["tokens"] > 0


# ------------------------------------------------------------------------------------------- encoder-decoder
SOURCES = [[5, 6, 7, 8, 9, 2], [11, 12, 2], [13, 14, 15, 16, 17, 18, 19, 20, 2], [21, 22, 23, 2]]
MT_FAMILIES = {  # BPDConfig options -> the transformers architecture to_hf writes
    "marian": dict(
        pre_norm=False,
        final_norm=False,
        pos_layout="marian",
        logits_bias=True,
        norm_eps=1e-5,
        activation="swish",
        pad_id=39,
        bos_id=39,
        eos_id=2,
        unk_id=1,
        suppress_ids=(39,),
    ),
    "pegasus": dict(pad_id=0, bos_id=1, eos_id=2, unk_id=3),  # this project's own models (permuted)
    "m2m_100": dict(
        pos_layout="fairseq", pos_offset=2, norm_eps=1e-5, pad_id=1, eos_id=2, unk_id=3, bos_id=30, decoder_prefix=(2,)
    ),  # forced target-language token 30 after the decoder start </s>
}
ARCH = {
    "marian": "MarianMTModel",
    "pegasus": "PegasusForConditionalGeneration",
    "m2m_100": "M2M100ForConditionalGeneration",
}


def _mt_model(fam: str, init: str, k: int = 4, vocab: int = 40):
    """A tiny random translation model of the family's architecture, heads as in _export."""
    from bpd_train.model import BPDConfig, BPDModel

    torch.manual_seed(0)
    cfg = BPDConfig(
        vocab_size=vocab,
        d_model=32,
        n_heads=2,
        n_encoder_layers=2,
        n_decoder_layers=2,
        d_ff=32,
        block_size=k,
        dropout=0.0,
        max_positions=64,
        **MT_FAMILIES[fam],
    )
    model = BPDModel(cfg).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # wide layers, small (tied) embeddings: outputs that do not just repeat the last token
        for name, p in model.named_parameters():
            if not name.startswith("heads."):
                std = (0.1 if "embed" in name else 0.5) if p.dim() == 2 else 0.1
                one = 1.0 if "norm" in name and name.endswith("weight") else 0.0
                p.copy_(one + std * torch.randn(p.shape, generator=g))
        if cfg.suppress_ids:
            model.logits_bias[list(cfg.suppress_ids)] += 3.0  # what suppression keeps out would often win
        for p in model.head_parameters():
            if init != "zero" and p.dim() == 2:
                p.normal_(0, {"small": 0.05, "random": 0.3}[init])
    return model


def _sources():
    width = max(map(len, SOURCES))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in SOURCES])  # right padding, as translation tokenizers
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in SOURCES])
    return ids, mask


@pytest.mark.parametrize(
    "fam,init",
    [("marian", "zero"), ("marian", "small"), ("pegasus", "small"), ("m2m_100", "zero"), ("m2m_100", "random")],
)
def test_translation_generate_with_heads_is_transformers_greedy(tmp_path, fam, init):
    from transformers import AutoModelForSeq2SeqLM

    from bpd_train.decoding import blockwise
    from bpd_train.sources.convert.hf import to_hf

    model = _mt_model(fam, init)
    folder = to_hf(model, tmp_path / fam)
    assert json.loads((folder / "config.json").read_text())["architectures"] == [ARCH[fam]]
    assert (folder / "custom_generate" / "generate.py").is_file()
    ids, mask = _sources()
    plain = AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    with torch.no_grad():
        want = plain.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW)
    got = plain.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=MAX_NEW, custom_generate=str(folder), trust_remote_code=True
    )
    assert torch.equal(got, want)
    if fam == "m2m_100":
        assert (want[:, 1] == 30).all()  # the forced language token, as transformers puts it
    if fam == "marian":  # the pad (favoured by the logits bias) is never generated: bad_words_ids, as opus-mt's
        assert all(39 not in row[1 : row.index(2) + 1 if 2 in row else None] for row in want.tolist())
    # the same decoder passes as bpd-train's blockwise decoder, row by row
    hf = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
    forced = 1 if fam == "m2m_100" else 0
    total, tokens = 0, 0
    for s in SOURCES:
        r = blockwise(model, torch.tensor([s]), max_len=MAX_NEW - forced)
        out = hf.generate(input_ids=torch.tensor([s]), max_new_tokens=MAX_NEW)[0, 1 + forced :].tolist()
        assert out[: len(r.tokens[0])] == r.tokens[0]
        assert hf.bpd_stats["passes"] == r.calls + r.prefill_calls, (hf.bpd_stats, r.calls, r.prefill_calls)
        total += hf.bpd_stats["passes"]
        tokens += hf.bpd_stats["tokens"]
    if init == "zero":
        assert total < tokens  # heads accepted where the output repeats: fewer passes than tokens


def test_translation_heads_that_are_right_decode_in_blocks(tmp_path):
    """Heads that propose exactly the model's next tokens (a model whose output is one token, repeated, and heads
    that equal head 1): every proposal is accepted, k tokens a pass."""
    from transformers import MarianMTModel

    from bpd_train.sources.convert.hf import to_hf

    model = _mt_model("marian", "zero", k=4)
    with torch.no_grad():
        model.logits_bias[7] = 50.0  # the model's greedy output: 7 7 7 ...
    folder = to_hf(model, tmp_path / "m")
    hf = MarianMTModel.from_pretrained(folder, trust_remote_code=True).eval()
    out = hf.generate(input_ids=torch.tensor([SOURCES[0]]), max_new_tokens=17)
    assert out[0, 1:].tolist() == [7] * 17
    assert hf.bpd_stats == {"passes": 1 + 4, "tokens": 17}  # 1 + 4*4: one token, then four blocks of k=4


def test_generate_refuses_what_is_not_greedy(tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    from bpd_train.sources.convert.hf import to_hf

    folder = to_hf(_mt_model("marian", "small"), tmp_path / "m")
    hf = AutoModelForSeq2SeqLM.from_pretrained(folder, trust_remote_code=True).eval()
    ids, mask = _sources()
    with pytest.raises(ValueError, match="greedy output"):
        hf.generate(input_ids=ids, attention_mask=mask, num_beams=2)
    with pytest.raises(ValueError, match="single tokens"):
        hf.generate(input_ids=ids, attention_mask=mask, bad_words_ids=[[5, 6]])


# ------------------------------------------------------------------------------------ export.format=hf, overwrite
def test_export_hf_writes_custom_generate_and_overwrites_only_its_own(tmp_path):
    """export.format=hf (export_hf) of either family writes custom_generate/; an earlier export is replaced with
    overwrite, a folder with anything of the user's in it (custom_generate/ included) never is."""
    import sentencepiece as spm
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    from bpd_train.app.export import export_hf
    from bpd_train.sources.convert.common import is_hf_export
    from bpd_train.sources.convert.hf import to_hf
    from bpd_train.sources.convert.hf.lm import to_hf_lm

    texts = ["the quick brown fox jumps over the lazy dog", "a stitch in time saves nine", "hello world"]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts * 20),
        model_prefix=str(tmp_path / "tokenizer"),
        vocab_size=32,
        model_type="unigram",
        character_coverage=1.0,
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=3,
        minloglevel=2,
    )
    sp = {"tokenizer.model": tmp_path / "tokenizer.model"}
    mt_src = to_hf(_mt_model("pegasus", "small", vocab=32), tmp_path / "mt-src", files=sp)
    lm_model, lm_src = _export(tmp_path, "medusa", "small")
    lm_src = to_hf_lm(lm_model, lm_src, files=sp, overwrite=True)  # with the tokenizer file hf: needs
    for name, src, auto, (ids, mask) in [
        ("mt", mt_src, AutoModelForSeq2SeqLM, _sources()),
        ("lm", lm_src, AutoModelForCausalLM, _padded(PROMPTS)),
    ]:
        out = export_hf(f"hf:{src}", tmp_path / f"{name}-out")
        assert (out / "custom_generate" / "generate.py").is_file() and is_hf_export(out)
        plain = auto.from_pretrained(out).eval()
        want = plain.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0
        )
        got = plain.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=MAX_NEW,
            pad_token_id=0,
            custom_generate=str(out),
            trust_remote_code=True,
        )
        assert torch.equal(got, want)
        with pytest.raises(FileExistsError, match="overwrite"):
            export_hf(f"hf:{src}", out)
        (out / "custom_generate" / "__pycache__").mkdir()  # as running the file from there leaves it
        assert export_hf(f"hf:{src}", out, overwrite=True) == out
        for foreign in (out / "notes.txt", out / "custom_generate" / "helper.py"):
            foreign.write_text("mine")
            with pytest.raises(FileExistsError, match="not a folder export.format=hf wrote"):
                export_hf(f"hf:{src}", out, overwrite=True)
            assert foreign.read_text() == "mine"
            foreign.unlink()
        shutil.rmtree(out / "custom_generate")
        (out / "custom_generate").write_text("not a folder")
        assert not is_hf_export(out)


def test_models_docs_block_runs(tmp_path):
    """docs/models.md's block on transformers' generate for a translation export runs as written."""
    from conftest import REPO_ROOT

    from bpd_train.sources.convert.hf import to_hf

    text = (REPO_ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    code = text.split("## Export (`to_hf`) and the heads file", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    folder = to_hf(_mt_model("marian", "small"), tmp_path / "hf")
    ids, mask = _sources()
    scope = {"folder": folder, "ids": ids, "mask": mask}
    exec(compile(code, "docs/models.md#export-to_hf-and-the-heads-file", "exec"), scope)
    assert scope["out"].shape[0] == len(SOURCES) and scope["model"].bpd_stats["tokens"] > 0


def test_what_generate_does_not_return_is_refused(tmp_path):
    """Options asking for what this generate() does not produce (scores, a dict, several sequences) are refused in
    one line rather than silently dropped; their unset values pass."""
    from transformers import AutoModelForCausalLM

    _, folder = _export(tmp_path, "bpd", "small")
    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    ids = torch.tensor([PROMPTS[0]])
    for opt in ({"return_dict_in_generate": True}, {"output_scores": True}, {"num_return_sequences": 2}):
        with pytest.raises(ValueError, match=next(iter(opt))):
            hf.generate(input_ids=ids, max_new_tokens=4, **opt)
    out = hf.generate(input_ids=ids, max_new_tokens=4, output_scores=False, logits_processor=None, pad_token_id=0)
    assert out.shape == (1, len(PROMPTS[0]) + 4) or hf.bpd_stats["tokens"] < 4
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()  # max_length (prompt included) as transformers reads it
    want = plain.generate(input_ids=ids, max_length=9, do_sample=False, pad_token_id=0)
    assert torch.equal(hf.generate(input_ids=ids, max_length=9, pad_token_id=0), want)


# ------------------------------------------------------------------------------------ do_sample=True
def test_do_sample_draws_from_transformers_sampling_distribution(tmp_path):
    """do_sample=True with temperature / top_k / top_p: the heads draft, the model verifies with min(1, p/q), so
    the answers are distributed as transformers' own sampling makes them (its logits processors computed here):
    the first two tokens of 1,500 answers of one prompt (the second one drafted by a head) against the exact
    distribution, chi-square below its 1e-3 quantile; a residual that draws from p instead of max(0, p - q) fails
    it. top_k=1 is greedy; torch.manual_seed reproduces."""
    import math

    from transformers import AutoModelForCausalLM
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    _, folder = _export(tmp_path, "bpd", "random")
    hf = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids, mask = _padded(PROMPTS)
    greedy = plain.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)
    one = hf.generate(
        input_ids=ids, attention_mask=mask, do_sample=True, top_k=1, max_new_tokens=MAX_NEW, pad_token_id=0
    )
    assert torch.equal(one, greedy)  # p and q masked alike: top-1 sampling is blockwise greedy
    torch.manual_seed(3)
    a = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=MAX_NEW, pad_token_id=0)
    torch.manual_seed(3)
    assert torch.equal(
        a, hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, max_new_tokens=MAX_NEW, pad_token_id=0)
    )

    t, top_k, top_p, n = 1.5, 6, 0.9, 1500
    prompt = torch.tensor([PROMPTS[1]])
    warp = [TemperatureLogitsWarper(t), TopKLogitsWarper(top_k), TopPLogitsWarper(top_p)]

    def dist(ids):
        with torch.no_grad():
            x = plain(input_ids=ids).logits[:, -1]
        for w in warp:
            x = w(ids, x)
        return torch.softmax(x.double(), -1)

    exact = {}
    p1 = dist(prompt)[0]
    for a1 in torch.nonzero(p1).flatten().tolist():
        if a1 == 2:  # EOS ends the answer
            exact[(a1,)] = float(p1[a1])
            continue
        p2 = dist(torch.tensor([PROMPTS[1] + [a1]]))[0]
        for a2 in torch.nonzero(p2).flatten().tolist():
            exact[(a1, a2)] = float(p1[a1] * p2[a2])

    def chi2(hf) -> tuple[float, float]:
        torch.manual_seed(11)
        kw = dict(do_sample=True, temperature=t, top_k=top_k, top_p=top_p, max_new_tokens=3, pad_token_id=0)
        counts = {}
        out = hf.generate(input_ids=prompt.repeat(n, 1), **kw)[:, prompt.shape[1] : prompt.shape[1] + 2].tolist()
        for row in out:
            key = tuple(row[:1]) if row[0] == 2 else tuple(row)
            counts[key] = counts.get(key, 0) + 1
        assert set(counts) <= set(exact)
        e = {a: q * n for a, q in exact.items()}
        cells = [a for a in e if e[a] >= 5]
        rest_e, rest_o = sum(e[a] for a in e if e[a] < 5), sum(counts.get(a, 0) for a in e if e[a] < 5)
        stat = sum((counts.get(a, 0) - e[a]) ** 2 / e[a] for a in cells) + (
            (rest_o - rest_e) ** 2 / rest_e if rest_e > 0 else 0.0
        )
        df = len(cells) - (rest_e == 0)
        crit = df * (1 - 2 / (9 * df) + 3.090232306167813 * math.sqrt(2 / (9 * df))) ** 3
        return stat, crit

    stat, crit = chi2(hf)
    print(f"do_sample: chi2={stat:.1f} (crit {crit:.1f})")
    assert stat < crit, (stat, crit)
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    code = broken / "custom_generate" / "generate.py"
    right = "rest = (ps[a] - qs[a]).clamp(min=0.0) if a < len(props) else ps[a]"
    assert right in code.read_text()
    code.write_text(code.read_text().replace(right, "rest = ps[a]"))
    stat, crit = chi2(AutoModelForCausalLM.from_pretrained(broken, trust_remote_code=True).eval())
    print(f"do_sample, broken residual: chi2={stat:.1f} (crit {crit:.1f})")
    assert stat > crit, (stat, crit)
