"""Prompt/response records -> ids with the loss on the response: plain, chat (template), prompt-format
translation; context policy; bad records; collation."""

import json

import pytest
import torch

pytest.importorskip("tokenizers")

from _lm_tiny import make_tokenizer  # noqa: E402

from bpd_train.data.lm.processing import IGNORE, LMDataError, LMEncoder, collate_lm, load_lm_jsonl, translation_prompt  # noqa: E402
from bpd_train.data.lm.tokenizer import LMTokenizer  # noqa: E402


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    out = {}
    for name, bos in (("llama", True), ("qwen", False)):
        f = tmp_path_factory.mktemp(name)
        make_tokenizer(f, bos=bos)
        out[name] = LMTokenizer(f)
    return out


def test_plain_record_loss_on_response_only(toks):
    tok = toks["llama"]
    enc = LMEncoder(tok, max_positions=64)
    e = enc.encode({"prompt": "the quick brown fox", "response": "jumps over the lazy dog"})
    assert e["ids"][: e["prompt_len"]] == tok.encode("the quick brown fox")  # BOS + prompt
    assert e["ids"][e["prompt_len"] :] == tok.encode("jumps over the lazy dog", add_special_tokens=False) + [tok.eos_id]
    b = collate_lm([e, enc.encode({"prompt": "hello", "response": "world"})])
    t, y = b["tokens"], b["targets"]
    assert t.shape == y.shape and t[1, -1] == -1  # right-padded sentinel
    row = e["ids"]
    loss_pos = (y[0] != IGNORE).nonzero().flatten().tolist()
    assert loss_pos == list(range(e["prompt_len"] - 1, len(row) - 1))
    assert y[0, loss_pos].tolist() == row[e["prompt_len"] :]  # next tokens, EOS included
    assert b["prompts"][1] == tok.encode("hello")


def test_chat_records_use_the_template(toks):
    tok = toks["qwen"]
    enc = LMEncoder(tok, max_positions=64)
    chat = [{"role": "user", "content": "how are you"}, {"role": "assistant", "content": "good morning"}]
    e = enc.encode({"messages": chat})
    assert e["ids"][: e["prompt_len"]] == tok.chat_ids(chat[:1], add_generation_prompt=True)
    assert e["ids"] == tok.chat_ids(chat, add_generation_prompt=False)  # template's <|im_end|> = EOS
    with pytest.raises(LMDataError, match="empty"):
        enc.encode({"messages": chat[:1] + [{"role": "assistant", "content": " "}]})


def test_translation_records_as_prompts(toks):
    tok = toks["llama"]
    assert translation_prompt("the fox", "en", "fr") == "English: the fox\nFrench:"
    enc = LMEncoder(tok, max_positions=64, src_lang="en", tgt_lang="fr")
    e = enc.encode({"translation": {"en": "the fox", "fr": "le renard"}})
    assert tok.decode(e["ids"][e["prompt_len"] :]) == "le renard"


def test_context_policy_and_bad_records(toks, tmp_path, caplog):
    tok = toks["llama"]
    long = {"prompt": " ".join(["the quick brown fox"] * 5), "response": "hello world"}
    enc = LMEncoder(tok, max_positions=10)
    e = enc.encode(long)
    assert len(e["ids"]) == 10 and e["ids"][0] == tok.bos_id  # BOS kept, oldest words cut
    assert e["ids"][1 : e["prompt_len"]] == tok.encode(long["prompt"], add_special_tokens=False)[-6:]
    assert enc.truncated == 1 and enc.truncated_tokens == 14  # 20 words, 6 kept
    with caplog.at_level("WARNING"):
        enc.report()
    assert "truncated from the left" in caplog.text
    with pytest.raises(LMDataError, match="exceed the context"):
        LMEncoder(tok, max_positions=10, context_policy="refuse").encode(long)
    with pytest.raises(LMDataError, match="response alone"):
        LMEncoder(tok, max_positions=3).encode(long)
    with pytest.raises(LMDataError, match="row 7: the response is empty"):
        enc.encode({"prompt": "hello", "response": ""}, where="row 7")
    with pytest.raises(LMDataError, match="needs prompt"):
        enc.encode({"text": "hello"})
    with pytest.raises(LMDataError, match="context_policy"):
        LMEncoder(tok, max_positions=10, context_policy="drop")
    # chats need a template
    f = tmp_path / "nochat"
    f.mkdir()
    make_tokenizer(f, bos=True, chat_template=False)
    with pytest.raises(LMDataError, match="no chat template"):
        LMEncoder(LMTokenizer(f), 64).encode(
            {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}
        )


def test_jsonl_through_datasets(tmp_path):
    p = tmp_path / "train.jsonl"
    p.write_text(
        "\n".join(
            json.dumps(r) for r in [{"prompt": "hello", "response": "world"}, {"prompt": "how are", "response": "you"}]
        )
        + "\n"
    )
    dd = load_lm_jsonl({"train": str(p)})
    assert dd["train"][1] == {"prompt": "how are", "response": "you"}
    with pytest.raises(LMDataError, match="not found"):
        load_lm_jsonl({"validation": str(tmp_path / "nope.jsonl")})
    assert torch.is_tensor(collate_lm([{"ids": [1, 2, 3], "prompt_len": 1}])["tokens"])


def test_self_distillation_responses(toks):
    from bpd_train.decoding import greedy
    from bpd_train.distillation.self_lm import distilled_record, prompt_ids, respond_ids
    from bpd_train.model import LMConfig, LMModel

    tok = toks["qwen"]
    torch.manual_seed(0)
    m = LMModel(
        LMConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=48, eos_id=tok.eos_id)
    ).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.4)
    records = [
        {"prompt": "the quick brown fox"},
        {"prompt": "hello"},
        {"messages": [{"role": "user", "content": "how are you"}]},
        {"translation": {"en": "the fox", "fr": "le renard"}},
        {"prompt": "a stitch in time saves nine"},
    ]
    prompts = [prompt_ids(r, tok, src_lang="en", tgt_lang="fr") for r in records]
    assert prompts[2] == tok.chat_ids(records[2]["messages"])
    got = respond_ids(m, prompts, max_len=12, max_sentences=2)
    assert got == [greedy(m, [p], max_len=12).tokens[0] for p in prompts]
    ids = [f"r{i}" for i in range(len(records))]
    hot = respond_ids(m, prompts, max_len=12, temperature=1.0, seed=3, record_ids=ids, max_sentences=1)
    back = respond_ids(m, prompts[::-1], max_len=12, temperature=1.0, seed=3, record_ids=ids[::-1], max_sentences=4)
    assert hot == back[::-1] and hot != got  # seeds follow records, not batches
    enc = LMEncoder(tok, max_positions=64, src_lang="en", tgt_lang="fr")
    assert sum(bool(tok.decode(r).strip()) for r in got) >= 3
    for r, p, resp in zip(records, prompts, got):
        d = distilled_record(r, resp, tok, src_lang="en", tgt_lang="fr")
        if d is None:
            assert not tok.decode(resp).strip()
            continue
        e = enc.encode(d)
        assert e["ids"][: e["prompt_len"]] == p  # trained on the prompt it answered
        assert tok.decode(e["ids"][e["prompt_len"] :]) == tok.decode(resp)
    assert distilled_record(records[1], [], tok) is None
    assert distilled_record(records[2], prompts[0][:2], tok)["messages"][-1]["role"] == "assistant"
