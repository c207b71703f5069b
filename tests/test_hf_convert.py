"""transformers Marian / M2M100 checkpoints <-> BPDModel: logits, greedy, beam, blockwise and export parity
against transformers itself, on tiny random-weight models and a sentencepiece model trained here."""

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses:UserWarning")

from bpd_train.data.hf_tokenizer import HFTokenizer, TokenizerError  # noqa: E402
from bpd_train.decoding import Exact, beam_search, blockwise, greedy  # noqa: E402
from bpd_train.sources.convert.hf import HEADS_FILE, ConvertError, from_hf, load_hf, to_hf  # noqa: E402

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine",
    "hello world how are you",
    "der schnelle braune fuchs springt",
    "guten tag wie geht es dir",
    "machine translation is fun",
]
SOURCES = ["the quick fox", "hello world how are you and the lazy dog", "nine", "guten tag wie geht es"]
MAX_NEW = 24


def _spm(tmp):
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS * 20),
        model_prefix=str(tmp / "sp"),
        vocab_size=48,
        model_type="unigram",
        character_coverage=1.0,
        bos_id=-1,
        eos_id=1,
        unk_id=2,
        pad_id=-1,
        minloglevel=2,
    )
    return spm.SentencePieceProcessor(model_file=str(tmp / "sp.model"))


def _pieces(sp, specials):
    vocab = dict(specials)
    for i in range(sp.get_piece_size()):
        if not (sp.is_control(i) or sp.is_unknown(i)) and sp.id_to_piece(i) not in vocab:
            vocab[sp.id_to_piece(i)] = len(vocab)
    return vocab


def _randomize(model, std=0.35, seed=0):
    """transformers initialises with std 0.02: every logit ~0. Wider weights give peaked, diverse outputs."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    sp = _spm(tmp)
    torch.manual_seed(0)
    # Marian: pieces + </s> 0, <unk> 1, <pad> last (the decoder start token), post-norm, swish, final_logits_bias
    mar = tmp / "marian"
    mar.mkdir()
    vocab = _pieces(sp, {"</s>": 0, "<unk>": 1})
    vocab["<pad>"] = len(vocab)
    (mar / "vocab.json").write_text(json.dumps(vocab))
    shutil.copy(tmp / "sp.model", mar / "source.spm")
    shutil.copy(tmp / "sp.model", mar / "target.spm")
    mtok = transformers.MarianTokenizer(str(mar / "source.spm"), str(mar / "target.spm"), str(mar / "vocab.json"))
    mtok.save_pretrained(mar)
    pad = vocab["<pad>"]
    # encoder and decoder differ in heads and FFN size (transformers allows it; so does BPDConfig)
    cfg = transformers.MarianConfig(
        vocab_size=len(vocab),
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=4,
        encoder_ffn_dim=32,
        decoder_ffn_dim=24,
        max_position_embeddings=64,
        activation_function="swish",
        scale_embedding=True,
        pad_token_id=pad,
        eos_token_id=0,
        decoder_start_token_id=pad,
        forced_eos_token_id=None,
    )
    m = _randomize(transformers.MarianMTModel(cfg).eval())
    with torch.no_grad():
        m.final_logits_bias.normal_(0, 0.5)
        m.final_logits_bias[0, 0] += 1.5  # EOS now and then: outputs of different lengths
    m.generation_config.bad_words_ids = [[pad]]  # as opus-mt models ship it
    m.save_pretrained(mar)
    # M2M100: </s>=2 decoder start, language tokens after the pieces, pre-norm, relu, fairseq positions
    mm = tmp / "m2m100"
    mm.mkdir()
    v2 = _pieces(sp, {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3})
    (mm / "vocab.json").write_text(json.dumps(v2))
    shutil.copy(tmp / "sp.model", mm / "sentencepiece.bpe.model")
    ttok = transformers.M2M100Tokenizer(
        str(mm / "vocab.json"), str(mm / "sentencepiece.bpe.model"), src_lang="en", tgt_lang="de"
    )
    ttok.save_pretrained(mm)
    cfg2 = transformers.M2M100Config(
        vocab_size=len(v2) + 100 + 8,  # pieces, languages, madeup words
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
        pad_token_id=1,
        eos_token_id=2,
        bos_token_id=0,
        decoder_start_token_id=2,
    )
    m2 = _randomize(transformers.M2M100ForConditionalGeneration(cfg2).eval(), seed=1)
    with torch.no_grad():
        m2.model.shared.weight[2] *= 2.0  # a stronger EOS, and a final-norm bias towards it: different lengths
        e = m2.model.shared.weight[2]
        m2.model.decoder.layer_norm.bias.copy_(1.5 * e / e.norm())
    m2.save_pretrained(mm)
    return {"marian": (mar, mtok, None), "m2m100": (mm, ttok, ttok.get_lang_id("de"))}


def _hf(folder):
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(folder).eval()
    return model


def _ours(folders, fam, **kw):
    folder, _, _ = folders[fam]
    langs = {"src_lang": "en", "tgt_lang": "de"} if fam == "m2m100" else {}
    return load_hf(folder, **langs, **kw)


def _hf_batch(tok, texts):
    enc = tok(texts, return_tensors="pt", padding=True)
    return enc["input_ids"], enc["attention_mask"]


def _strip(row, fam, eos, pad):
    """HF generate output -> our token list: drop the decoder start (and M2M100's forced language token),
    cut at EOS."""
    row = row.tolist()[2 if fam == "m2m100" else 1 :]
    out = []
    for t in row:
        if t == eos:
            break
        out.append(t)
    assert pad not in out or fam == "marian"
    return out


@pytest.mark.parametrize("fam", ["marian", "m2m100"])
def test_tokenizer_ids_match_transformers(folders, fam):
    folder, ttok, _ = folders[fam]
    ours = HFTokenizer(folder, src_lang="en", tgt_lang="de") if fam == "m2m100" else HFTokenizer(folder)
    for text in SOURCES + ["unseen ZQX words"]:
        assert ours.source_ids(text) == ttok(text)["input_ids"]
        ids = ours.source_ids(text)
        # language codes are special in the hub's M2M100 tokenizers, but not in one built from files as here
        assert ours.detok(ids) == ttok.decode(ids[1:] if fam == "m2m100" else ids, skip_special_tokens=True)
    if fam == "m2m100":
        assert ours.tgt_lang_id == ttok.get_lang_id("de") == ours.bos_id()
    # a stand-in for the sentencepiece processor the evaluation code uses (ids are the model's)
    from bpd_train.decoding.settings import draft_vocabulary
    from bpd_train.decoding.text import SpmText

    text = SpmText(ours, ours.eos_id(), ours.pad_id())
    assert text.source_ids(SOURCES[1]) == ttok(SOURCES[1])["input_ids"]
    assert ours.encode(SOURCES[:2]) == [ttok(t)["input_ids"][:-1] for t in SOURCES[:2]]
    draft = draft_vocabulary(ours, 10, ours.eos_id())
    assert len(draft) == 11 and ours.eos_id() in draft and ours.pad_id() not in draft
    assert all(0 <= i < ours.get_piece_size() for i in draft)


@pytest.mark.parametrize("fam", ["marian", "m2m100"])
def test_logits_match_transformers(folders, fam):
    folder, ttok, lang = folders[fam]
    hf = _hf(folder)
    model, tok, meta = _ours(folders, fam)
    assert meta["family"] == ("marian" if fam == "marian" else "m2m_100")
    src, mask = _hf_batch(ttok, SOURCES)
    ours_src = torch.nn.utils.rnn.pad_sequence(
        [torch.tensor(tok.source_ids(t)) for t in SOURCES], batch_first=True, padding_value=model.config.pad_id
    )
    assert torch.equal(ours_src, src)
    g = torch.Generator().manual_seed(0)
    y = torch.randint(4, 40, (len(SOURCES), 7), generator=g)
    c = model.config
    start = hf.config.decoder_start_token_id
    dec_in = torch.cat([torch.full((len(SOURCES), 1), start), y], 1)
    if lang is not None:
        dec_in = torch.cat([dec_in[:, :1], torch.full((len(SOURCES), 1), lang), y], 1)
    with torch.no_grad():
        ref = hf(input_ids=src, attention_mask=mask, decoder_input_ids=dec_in).logits
        got = model(src, torch.cat([torch.full((len(SOURCES), 1), c.bos_id), y], 1))[:, :, 0]
    ref = ref[:, 1:] if lang is not None else ref
    assert got.shape == ref.shape
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("fam", ["marian", "m2m100"])
def test_greedy_and_blockwise_match_generate(folders, fam):
    folder, ttok, lang = folders[fam]
    hf = _hf(folder)
    model, tok, _ = _ours(folders, fam, block_size=4)
    torch.manual_seed(3)
    with torch.no_grad():  # random heads: blockwise must still give greedy's tokens exactly
        model.heads.fc2.weight.normal_(0, 0.3)
    src, mask = _hf_batch(ttok, SOURCES)
    extra = {"forced_bos_token_id": lang} if lang is not None else {}
    with torch.no_grad():
        out = hf.generate(
            input_ids=src, attention_mask=mask, num_beams=1, do_sample=False, max_new_tokens=MAX_NEW, **extra
        )
    # HF counts the forced language token among the new tokens
    cap = MAX_NEW - (1 if lang is not None else 0)
    want = [_strip(r, fam, model.config.eos_id, model.config.pad_id) for r in out]
    got = greedy(model, src, max_len=cap)
    assert got.tokens == want
    assert len({len(t) for t in want}) > 1  # sources of different lengths end at different steps
    bw = blockwise(model, src, accept=Exact(), max_len=cap)
    assert bw.tokens == want
    one = [greedy(model, src[i : i + 1, : int(mask[i].sum())], max_len=cap).tokens[0] for i in range(len(SOURCES))]
    assert one == want  # batch and padding change nothing


def _less_eos(hf, model):
    """The same EOS demotion in both M2M100 models: with length_penalty=0 beam search otherwise prefers
    ending at once. (The random Marian model's hypotheses end at once or never, whatever the shift; there the
    comparison covers the step-0 candidates and the scores.)"""
    with torch.no_grad():
        e = hf.model.shared.weight[2]
        hf.model.decoder.layer_norm.bias.sub_(0.5 * e / e.norm())
        model.decoder_norm.bias.sub_(0.5 * e / e.norm())


@pytest.mark.parametrize("fam", ["marian", "m2m100"])
@pytest.mark.parametrize("suppress", [True, False])
def test_beam_search_matches_generate_without_length_penalty(folders, fam, suppress):
    """transformers normalises finished beams by len**length_penalty (its len counts the forced language token)
    and, by default (early_stopping=False), stops on a heuristic; ours uses GNMT's ((5+len)/6)**alpha and
    fairseq's stop (beam_size finished hypotheses). With length_penalty=0 and early_stopping=True both are
    plain log-probability beam search and must pick the same hypotheses with the same scores. transformers
    applies bad_words_ids after log_softmax, ours before (suppressed tokens get no probability mass), so with
    Marian's suppressed pad the scores differ by design and only the hypotheses are compared."""
    folder, ttok, lang = folders[fam]
    hf = _hf(folder)
    model, tok, _ = _ours(folders, fam)
    if not suppress:
        hf.generation_config.bad_words_ids = None
        model.config.suppress_ids = ()  # before the first decode builds the decode weights
    if fam == "m2m100":
        _less_eos(hf, model)
    src, mask = _hf_batch(ttok, SOURCES)
    extra = {"forced_bos_token_id": lang} if lang is not None else {}
    with torch.no_grad():
        out = hf.generate(
            input_ids=src,
            attention_mask=mask,
            num_beams=4,
            do_sample=False,
            length_penalty=0.0,
            early_stopping=True,
            max_new_tokens=60,
            output_scores=True,
            return_dict_in_generate=True,
            **extra,
        )
    eos = model.config.eos_id
    finished = [eos in r.tolist()[1:] for r in out.sequences]
    want = [_strip(r, fam, eos, model.config.pad_id) for r in out.sequences]
    got = beam_search(model, src, beam_size=4, length_penalty=0.0, max_len=58)
    compared = 0
    for i, ok in enumerate(finished):
        if ok:  # hypotheses cut at max_length end without EOS in transformers, with a forced EOS in ours
            assert got.tokens[i] == want[i]
            if not (suppress and model.config.suppress_ids):
                assert abs(got.scores[i] - out.sequences_scores[i].item()) < 1e-4
            compared += 1
    assert compared >= 3
    assert fam == "marian" or max(len(t) for t in want) >= 3


@pytest.mark.parametrize("fam", ["marian", "m2m100"])
def test_export_back_round_trip(folders, fam, tmp_path):
    folder, ttok, lang = folders[fam]
    model, tok, _ = _ours(folders, fam, block_size=3)
    torch.manual_seed(5)
    with torch.no_grad():
        model.heads.fc2.weight.normal_(0, 0.3)
        model.decoder_layers[0].ffn.fc1.bias.add_(0.05)  # "fine-tuned": differs from the imported weights
    out = to_hf(model, tmp_path / "exported", tokenizer_folder=folder, tokenizer_files=tok.files())
    assert (out / HEADS_FILE).is_file() and (out / "model.safetensors").is_file()
    hf = _hf(out)
    src, mask = _hf_batch(ttok, SOURCES)
    with torch.no_grad():  # generation_config.json carries the forced language token: no extra arguments
        gen = hf.generate(input_ids=src, attention_mask=mask, num_beams=1, do_sample=False, max_new_tokens=MAX_NEW)
    cap = MAX_NEW - (1 if lang is not None else 0)
    want = [_strip(r, fam, model.config.eos_id, model.config.pad_id) for r in gen]
    assert greedy(model, src, max_len=cap).tokens == want
    back, tok2, meta = load_hf(out)  # k, heads and target language come back from the export
    assert meta["heads_loaded"] and back.config == model.config
    for (k1, v1), (k2, v2) in zip(sorted(model.state_dict().items()), sorted(back.state_dict().items())):
        assert k1 == k2 and torch.equal(v1, v2)
    assert blockwise(back, src, max_len=cap).tokens == want
    assert tok2.source_ids(SOURCES[0]) == tok.source_ids(SOURCES[0])


def test_untied_output_exports_every_embedding_name(folders, tmp_path):
    """An encoder and decoder sharing one embedding beside a separate output projection (tie_output=False): the
    export writes that embedding under every name transformers reads (model.shared and both embed_tokens), since
    transformers then ties nothing; MarianMTModel loads the folder whole and computes our logits."""
    from bpd_train.model import BPDConfig, BPDModel

    folder, ttok, _ = folders["marian"]
    base, tok, _ = _ours(folders, "marian")
    model = BPDModel(BPDConfig.from_dict({**base.config.to_dict(), "tie_output": False})).eval()
    missing, unexpected = model.load_state_dict(base.state_dict(), strict=False)
    assert missing == ["lm_head.weight"] and not unexpected
    with torch.no_grad():
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(3)))
    out = to_hf(model, tmp_path / "untied", tokenizer_folder=folder, tokenizer_files=tok.files())
    hf = transformers.MarianMTModel.from_pretrained(out).eval()
    assert not hf.config.tie_word_embeddings
    src, mask = _hf_batch(ttok, SOURCES)
    y = torch.randint(4, 40, (len(SOURCES), 7), generator=torch.Generator().manual_seed(0))
    c = model.config
    with torch.no_grad():
        ref = hf(
            input_ids=src,
            attention_mask=mask,
            decoder_input_ids=torch.cat([torch.full((len(SOURCES), 1), hf.config.decoder_start_token_id), y], 1),
        ).logits
        got = model(src, torch.cat([torch.full((len(SOURCES), 1), c.bos_id), y], 1))[:, :, 0]
    assert got.shape == ref.shape and (got - ref).abs().max().item() < 1e-4
    back, _, _ = load_hf(out)  # and it reads back as it was
    for (k1, v1), (k2, v2) in zip(sorted(model.state_dict().items()), sorted(back.state_dict().items())):
        assert k1 == k2 and torch.equal(v1, v2)


def test_refusals(folders, tmp_path, monkeypatch):
    bart = tmp_path / "bart"
    bart.mkdir()
    (bart / "config.json").write_text(
        json.dumps({"architectures": ["BartForConditionalGeneration"], "model_type": "bart"})
    )
    with pytest.raises(
        ConvertError,
        match="unsupported architecture BartForConditionalGeneration.*MarianMTModel.*M2M100ForConditionalGeneration",
    ):
        from_hf(bart)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConvertError, match="HF_HUB_OFFLINE"):
        load_hf("no-such-org/no-such-model-bpd")
    folder = folders["marian"][0]
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    (broken / "target.spm").unlink()
    with pytest.raises(ConvertError, match="lacks the tokenizer file.*target.spm"):
        load_hf(broken)
    vocab = json.loads((folder / "vocab.json").read_text())
    vocab["extra_piece"] = len(vocab)
    (broken / "vocab.json").write_text(json.dumps(vocab))
    shutil.copy(folder / "target.spm", broken / "target.spm")
    with pytest.raises(ConvertError, match="different models"):
        load_hf(broken)
    with pytest.raises(ConvertError, match="give src_lang and tgt_lang"):
        _no_langs(folders["m2m100"][0], tmp_path)
    with pytest.raises(TokenizerError, match="not a language token"):
        HFTokenizer(folders["m2m100"][0], src_lang="en", tgt_lang="xx")


def _no_langs(folder, tmp_path):
    """An M2M100 folder whose tokenizer_config names no languages."""
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    cfg = json.loads((bare / "tokenizer_config.json").read_text())
    cfg.pop("src_lang", None)
    cfg.pop("tgt_lang", None)
    (bare / "tokenizer_config.json").write_text(json.dumps(cfg))
    return load_hf(bare)


def test_native_model_exports_as_pegasus_and_back(tmp_path):
    """This project's own architecture has no exact transformers twin: it goes out as Pegasus with the model
    dimension permuted (LayerNorm eps 1e-5 there vs our 1e-6: logits agree to ~1e-5, greedy tokens equal)
    and comes back bit for bit."""
    import sentencepiece as spm

    from bpd_train.model import BPDConfig, BPDModel

    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(TEXTS * 20),
        model_prefix=str(tmp_path / "tokenizer"),
        vocab_size=48,
        model_type="unigram",
        character_coverage=1.0,
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=3,
        minloglevel=2,
    )
    torch.manual_seed(0)
    model = BPDModel(
        BPDConfig(
            vocab_size=48,
            d_model=16,
            n_heads=2,
            n_encoder_layers=2,
            n_decoder_layers=2,
            d_ff=32,
            block_size=3,
            dropout=0.0,
            max_positions=64,
        )
    ).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    out = to_hf(model, tmp_path / "exported", tokenizer_folder=tmp_path, tokenizer_files=["tokenizer.model"])
    hf = _hf(out)
    assert type(hf).__name__ == "PegasusForConditionalGeneration"
    back, tok, meta = load_hf(out)
    assert meta["heads_loaded"] and back.config == model.config and tok.kind == "spm"
    for (k1, v1), (k2, v2) in zip(sorted(model.state_dict().items()), sorted(back.state_dict().items())):
        assert k1 == k2 and torch.equal(v1, v2)
    src = torch.nn.utils.rnn.pad_sequence([torch.tensor(tok.source_ids(t)) for t in SOURCES], batch_first=True)
    mask = (src != 0).long()
    y = torch.randint(4, 48, (len(SOURCES), 6), generator=torch.Generator().manual_seed(1))
    tgt = torch.cat([torch.ones(len(SOURCES), 1, dtype=torch.long), y], 1)
    with torch.no_grad():
        ref = hf(input_ids=src, attention_mask=mask, decoder_input_ids=tgt).logits
        diff = (model(src, tgt)[:, :, 0] - ref).abs().max().item()
        assert diff < 1e-3
        gen = hf.generate(input_ids=src, attention_mask=mask, num_beams=1, do_sample=False, max_new_tokens=MAX_NEW)
    want = [_strip(r, "pegasus", 2, 0) for r in gen]
    assert greedy(model, src, max_len=MAX_NEW).tokens == want
    assert blockwise(back, src, max_len=MAX_NEW).tokens == want


def test_nllb_style_folder(tmp_path):
    """NLLB-200 is an M2M100 model whose tokenizer ships as tokenizer.json with language tokens like deu_Latn:
    ids, forced target language and greedy output as transformers' NllbTokenizer and generate give them."""
    from tokenizers import AddedToken, Tokenizer

    _spm(tmp_path)
    spm_dir, folder = tmp_path / "spm", tmp_path / "nllb"
    spm_dir.mkdir()
    shutil.copy(tmp_path / "sp.model", spm_dir / "sentencepiece.bpe.model")
    transformers.NllbTokenizer.from_pretrained(spm_dir).save_pretrained(folder)
    tk = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tk.add_special_tokens([AddedToken(c, special=True, normalized=False) for c in ("eng_Latn", "deu_Latn")])
    tk.save(str(folder / "tokenizer.json"))
    ttok = transformers.NllbTokenizer.from_pretrained(folder, src_lang="eng_Latn", tgt_lang="deu_Latn")
    cfg = transformers.M2M100Config(
        vocab_size=len(ttok),
        d_model=16,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
        pad_token_id=1,
        eos_token_id=2,
        bos_token_id=0,
        decoder_start_token_id=2,
    )
    torch.manual_seed(0)
    hf = _randomize(transformers.M2M100ForConditionalGeneration(cfg).eval(), seed=2)
    hf.save_pretrained(folder)
    model, tok, meta = load_hf(folder, src_lang="eng_Latn", tgt_lang="deu_Latn", block_size=2)
    assert tok.kind == "tokenizers" and meta["tokenizer"]["tgt_lang"] == "deu_Latn"
    lang = ttok.convert_tokens_to_ids("deu_Latn")
    assert model.config.bos_id == lang and model.config.decoder_prefix == (2,)
    for text in SOURCES:
        assert tok.source_ids(text) == ttok(text)["input_ids"]
    src, mask = _hf_batch(ttok, SOURCES)
    with torch.no_grad():
        gen = hf.generate(
            input_ids=src,
            attention_mask=mask,
            num_beams=1,
            do_sample=False,
            max_new_tokens=MAX_NEW,
            forced_bos_token_id=lang,
        )
    want = [_strip(r, "m2m100", 2, 1) for r in gen]
    assert greedy(model, src, max_len=MAX_NEW - 1).tokens == want
    assert tok.detok(want[0]) == ttok.decode(want[0], skip_special_tokens=True)


def test_legacy_marian_files(folders, tmp_path):
    """Older opus-mt folders: pytorch_model.bin (read with weights_only=True), the fixed position tables saved
    with the weights, bad_words_ids in config.json instead of generation_config.json."""
    from safetensors.torch import load_file

    folder = folders["marian"][0]
    config, state = from_hf(folder)
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    (old / "model.safetensors").unlink()
    (old / "generation_config.json").unlink()
    hf_cfg = json.loads((old / "config.json").read_text())
    hf_cfg["bad_words_ids"] = [[config.pad_id]]
    (old / "config.json").write_text(json.dumps(hf_cfg))
    sd = load_file(str(folder / "model.safetensors"))
    table = transformers.MarianMTModel.from_pretrained(folder).model.encoder.embed_positions.weight.detach()
    sd["model.encoder.embed_positions.weight"] = table.clone()
    torch.save(sd, old / "pytorch_model.bin")
    config2, state2 = from_hf(old)
    assert config2.suppress_ids == (config.pad_id,) and config2 == config
    assert sorted(state2) == sorted(state) and all(torch.equal(state[k], state2[k]) for k in state)
    sd["model.encoder.embed_positions.weight"] = torch.randn_like(table)  # learned positions: not ours
    torch.save(sd, old / "pytorch_model.bin")
    with pytest.raises(ConvertError, match="learned positions"):
        from_hf(old)
