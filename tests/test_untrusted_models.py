"""Model folders are not trusted: an hf: folder or bundle whose config.json disagrees with its weights, asks for
huge buffers, lists token ids the model does not have, holds a damaged safetensors file, or links / indexes files
outside itself is refused in one line before anything is built, allocated or copied."""

import json
import shutil
import struct

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses:UserWarning")

from _eval_tiny import build_tiny  # noqa: E402
from _lm_tiny import make_tokenizer  # noqa: E402

from bpd_train.app.export import export_checkpoint, export_hf, load_bundle  # noqa: E402
from bpd_train.io import sha256_file  # noqa: E402
from bpd_train.sources.bundle import BundleError  # noqa: E402
from bpd_train.sources.convert.hf import ConvertError, load_hf  # noqa: E402
from bpd_train.sources.convert.hf.lm import load_hf_lm, to_hf_lm  # noqa: E402

TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a stitch in time saves nine",
    "hello world how are you",
    "der schnelle braune fuchs springt",
    "guten tag wie geht es dir",
    "machine translation is fun",
]


@pytest.fixture(scope="module")
def marian(tmp_path_factory):
    """A tiny random Marian model saved by transformers, with its tokenizer files."""
    import sentencepiece as spm

    tmp = tmp_path_factory.mktemp("marian")
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
    sp = spm.SentencePieceProcessor(model_file=str(tmp / "sp.model"))
    vocab = {"</s>": 0, "<unk>": 1}
    for i in range(sp.get_piece_size()):
        if not (sp.is_control(i) or sp.is_unknown(i)) and sp.id_to_piece(i) not in vocab:
            vocab[sp.id_to_piece(i)] = len(vocab)
    vocab["<pad>"] = len(vocab)
    folder = tmp / "model"
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(vocab))
    shutil.copy(tmp / "sp.model", folder / "source.spm")
    shutil.copy(tmp / "sp.model", folder / "target.spm")
    transformers.MarianTokenizer(
        str(folder / "source.spm"), str(folder / "target.spm"), str(folder / "vocab.json")
    ).save_pretrained(folder)
    cfg = transformers.MarianConfig(
        vocab_size=len(vocab),
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=64,
        pad_token_id=vocab["<pad>"],
        eos_token_id=0,
        decoder_start_token_id=vocab["<pad>"],
        forced_eos_token_id=None,
    )
    torch.manual_seed(0)
    transformers.MarianMTModel(cfg).eval().save_pretrained(folder)
    load_hf(folder)  # the untouched folder loads
    return folder


def _copy(folder, tmp_path, name="m"):
    dst = tmp_path / name
    shutil.copytree(folder, dst)
    return dst


def _edit_json(path, **changes):
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


# ----------------------------------------------------------------------------------------- sizes vs weights
def test_d_model_that_disagrees_with_the_weights(marian, tmp_path):
    m = _copy(marian, tmp_path)
    _edit_json(m / "config.json", d_model=32)
    with pytest.raises(ConvertError, match="does not fit the model config: shape mismatch"):
        load_hf(m)


@pytest.mark.parametrize("positions", [2_000_000, 20_000_000, 1_000_000_000])
def test_huge_max_position_embeddings_is_refused_before_allocation(marian, tmp_path, positions):
    m = _copy(marian, tmp_path)
    _edit_json(m / "config.json", max_position_embeddings=positions)
    with pytest.raises(ConvertError, match=f"max_positions={positions} would allocate"):
        load_hf(m)


@pytest.mark.parametrize("value", ["sixteen", [16], None])
def test_config_values_of_the_wrong_type(marian, tmp_path, value):
    m = _copy(marian, tmp_path)
    _edit_json(m / "config.json", d_model=value)
    with pytest.raises(ConvertError, match="config.json"):
        load_hf(m)


def test_bundle_with_edited_sizes_and_recomputed_hashes(tmp_path_factory, tmp_path):
    tiny = build_tiny(tmp_path_factory)
    b = export_checkpoint(tiny["run"], tmp_path / "bundle")
    for key, value, msg in (
        ("max_positions", 2_000_000, "would allocate"),
        ("d_ff", 10_000_000, "does not fit the model config"),
        ("d_model", 4096, "does not fit the model config"),
    ):
        cfg = json.loads((b / "config.json").read_text())
        saved = dict(cfg["model"])
        cfg["model"][key] = value
        (b / "config.json").write_text(json.dumps(cfg))
        manifest = json.loads((b / "manifest.json").read_text())
        manifest["files"]["config.json"] = sha256_file(b / "config.json")
        (b / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises((BundleError, ValueError), match=msg):
            load_bundle(b)
        cfg["model"] = saved
        (b / "config.json").write_text(json.dumps(cfg))
        manifest["files"]["config.json"] = sha256_file(b / "config.json")
        (b / "manifest.json").write_text(json.dumps(manifest))
    load_bundle(b)


# ---------------------------------------------------------------------------------------------- token ids
@pytest.mark.parametrize("bad", [10_000, "5", 2.5, -1])
def test_vocab_json_ids_out_of_range_or_of_the_wrong_type(marian, tmp_path, bad):
    m = _copy(marian, tmp_path)
    _edit_json(m / "vocab.json", e=bad)  # an existing piece: as many entries as before
    msg = r"vocab\.json.*(not a token id|maps a piece to id 10000)"
    with pytest.raises(ConvertError, match=msg):
        load_hf(m)
    with pytest.raises(ValueError, match=msg):  # and export never packs it into a bundle
        export_checkpoint(f"hf:{m}", tmp_path / "bundle")
    assert not (tmp_path / "bundle").exists()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    f = tmp_path_factory.mktemp("llama")
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
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        rope_parameters=rope,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(f)
    return f


def test_tokenizer_json_id_past_the_embedding(llama, tmp_path):
    m = _copy(llama, tmp_path)
    tok = json.loads((m / "tokenizer.json").read_text())
    n = json.loads((m / "config.json").read_text())["vocab_size"]
    tok["model"]["vocab"]["."] = n + 100  # as many tokens as rows, but one id past them
    (m / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConvertError, match=f"token with id {n + 100}"):
        load_hf_lm(m)


# ------------------------------------------------------------------------------------------ damaged weights
def test_truncated_or_lying_safetensors(marian, tmp_path):
    m = _copy(marian, tmp_path)
    data = (m / "model.safetensors").read_bytes()
    (m / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ConvertError, match="not a readable safetensors file"):
        load_hf(m)
    n = struct.unpack("<Q", data[:8])[0]
    (m / "model.safetensors").write_bytes(struct.pack("<Q", n + 10**9) + data[8:])  # a header longer than the file
    with pytest.raises(ConvertError, match="not a readable safetensors file"):
        load_hf(m)


# ------------------------------------------------------------------------------- nothing outside the folder
def test_symlink_out_of_the_folder_is_refused(marian, tmp_path):
    secret = tmp_path / "secret"
    secret.mkdir()
    shutil.copy(marian / "vocab.json", secret / "vocab.json")  # outside, with content that would pass
    m = _copy(marian, tmp_path)
    (m / "vocab.json").unlink()
    (m / "vocab.json").symlink_to(secret / "vocab.json")
    with pytest.raises(ConvertError, match="outside"):
        load_hf(m)
    with pytest.raises(ValueError, match="outside"):
        export_checkpoint(f"hf:{m}", tmp_path / "bundle")
    with pytest.raises(ValueError, match="outside"):
        export_hf(f"hf:{m}", tmp_path / "hf-out")
    assert not (tmp_path / "bundle").exists() and not (tmp_path / "hf-out").exists()
    m2 = _copy(marian, tmp_path, "m2")
    shutil.move(m2 / "model.safetensors", secret / "weights.safetensors")
    (m2 / "model.safetensors").symlink_to(secret / "weights.safetensors")
    with pytest.raises(ConvertError, match="outside"):
        load_hf(m2)


@pytest.mark.parametrize("where", ["../outside.safetensors", "ABSOLUTE"])
def test_index_entries_outside_the_folder(marian, tmp_path, where):
    m = _copy(marian, tmp_path)
    outside = tmp_path / "outside.safetensors"
    shutil.move(m / "model.safetensors", outside)
    from safetensors import safe_open

    with safe_open(str(outside), framework="pt") as f:
        names = list(f.keys())
    target = str(outside) if where == "ABSOLUTE" else where
    (m / "model.safetensors.index.json").write_text(json.dumps({"weight_map": dict.fromkeys(names, target)}))
    with pytest.raises(ConvertError, match="not a plain relative name"):
        load_hf(m)


def test_hub_cache_snapshot_links_into_its_blobs(marian, tmp_path):
    """A hub cache snapshot's files are links into its repository's blobs/: inside, so they load."""
    repo = tmp_path / "models--someone--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    for p in marian.iterdir():
        shutil.copy(p, repo / "blobs" / p.name)
        (snap / p.name).symlink_to(f"../../blobs/{p.name}")
    load_hf(snap)


# ------------------------------------------------------------------------------------------- decoder-only
def test_mistral_sliding_window_is_refused(tmp_path):
    f = tmp_path / "mistral"
    f.mkdir()
    v = make_tokenizer(f, bos=True)
    cfg = transformers.MistralConfig(
        vocab_size=v,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        sliding_window=32,
        bos_token_id=1,
        eos_token_id=2,
    )
    transformers.MistralForCausalLM(cfg).eval().save_pretrained(f)
    with pytest.raises(ConvertError, match="sliding_window=32"):
        load_hf_lm(f)


def test_to_hf_lm_writes_rope_integers_as_integers(llama, tmp_path):
    model, _, _ = load_hf_lm(llama)
    out = to_hf_lm(model, tmp_path / "out", tokenizer_folder=llama)
    rope = json.loads((out / "config.json").read_text())["rope_parameters"]
    assert rope["original_max_position_embeddings"] == 16
    assert isinstance(rope["original_max_position_embeddings"], int) and isinstance(rope["factor"], float)
    again, _, _ = load_hf_lm(out)
    assert again.config.rope_scaling == model.config.rope_scaling


def test_bundle_file_linked_from_outside_is_refused(tmp_path_factory, tmp_path):
    tiny = build_tiny(tmp_path_factory)
    b = export_checkpoint(tiny["run"], tmp_path / "bundle")
    shutil.move(b / "tokenizer.model", tmp_path / "elsewhere.model")  # the right content, but outside the bundle
    (b / "tokenizer.model").symlink_to(tmp_path / "elsewhere.model")
    with pytest.raises(BundleError, match="outside the bundle folder"):
        load_bundle(b)
