"""bench/real.py's results page and bench/llama_peer.py's guard, without the model or llama.cpp (both are bench-only)."""

from _bench_fakes import load_bench as _load


def test_llama_cpp_guard_names_the_extra_when_missing():
    lc = _load("llama_peer")
    why = lc.available()
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        assert why is not None and "[bench-llama]" in why
    else:
        assert why is None


def test_prompts_are_chat_records_or_lines_of_text_and_bad_files_are_one_error(tmp_path, capsys):
    import json

    import pytest

    real = _load("real")
    chat = tmp_path / "chat.jsonl"
    recs = [{"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]},
            {"messages": [{"role": "user", "content": "2 + 2?"}]}]  # fmt: skip
    chat.write_text("".join(json.dumps(r) + "\n" for r in recs) + "\n")
    assert real.user_turns(chat) == ["Hi?", "2 + 2?"]
    text = tmp_path / "asks.txt"
    text.write_text("What is BPD?\n\n42\nName three colours.\n")
    assert real.user_turns(text) == ["What is BPD?", "42", "Name three colours."]
    for path, content, says in (
        (tmp_path / "missing.jsonl", None, "no such file"),
        (tmp_path / "empty.txt", "\n\n", "empty"),
        (tmp_path / "nouser.jsonl", json.dumps({"messages": [{"role": "system", "content": "x"}]}) + "\n", "no chat"),
    ):
        if content is not None:
            path.write_text(content)
        with pytest.raises(SystemExit) as e:
            real.user_turns(path)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1


def test_the_draft_vocabulary_follows_the_bench_setting(tmp_path, monkeypatch):
    from _gguf_files import write_tiny_chat_llama

    from bpd_train.sources.loading import load

    real = _load("real")
    write_tiny_chat_llama(tmp_path / "tiny.gguf")
    loaded = load(f"gguf:{tmp_path / 'tiny.gguf'}")
    model, tok = loaded.model, loaded.tokenizer()
    eos = model.config.eos_ids or model.config.eos_id
    stops = {eos} if isinstance(eos, int) else set(eos)
    monkeypatch.setattr(real, "DRAFT_VOCAB", "16")
    draft = real.options(model, tok, "fp32").draft_vocab
    assert 16 <= len(draft) <= 16 + len(stops) and stops <= set(draft)  # the 16 most frequent ids and the stops
    monkeypatch.setattr(real, "DRAFT_VOCAB", "auto")
    assert real.options(model, tok, "fp32").draft_vocab != draft
