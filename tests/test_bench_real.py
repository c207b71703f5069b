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

    args = _load("real_args")
    chat = tmp_path / "chat.jsonl"
    recs = [{"messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": "Hello."}]},
            {"messages": [{"role": "user", "content": "2 + 2?"}]}]  # fmt: skip
    chat.write_text("".join(json.dumps(r) + "\n" for r in recs) + "\n")
    assert args.user_turns(chat) == ["Hi?", "2 + 2?"]
    text = tmp_path / "asks.txt"
    text.write_text("What is BPD?\n\n42\nName three colours.\n")
    assert args.user_turns(text) == ["What is BPD?", "42", "Name three colours."]
    for path, content, says in (
        (tmp_path / "missing.jsonl", None, "no such file"),
        (tmp_path / "empty.txt", "\n\n", "empty"),
        (tmp_path / "nouser.jsonl", json.dumps({"messages": [{"role": "system", "content": "x"}]}) + "\n", "no chat"),
    ):
        if content is not None:
            path.write_text(content)
        with pytest.raises(SystemExit) as e:
            args.user_turns(path)
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


def test_sampling_engines_seed_each_request_alike_alone_or_in_a_batch(tmp_path):
    from _gguf_files import write_tiny_chat_llama

    from bpd_train.sources.loading import load

    real = _load("real")
    write_tiny_chat_llama(tmp_path / "tiny.gguf")
    loaded = load(f"gguf:{tmp_path / 'tiny.gguf'}")
    model, tok = loaded.model, loaded.tokenizer()
    heads = real.Heads("zero", real.with_zero_heads(model, 4), 4)
    base = {"engine": "ours", "dtype": "fp32"}
    how = real.Sampling(1.0, top_p=0.95)
    narrowed = real.Heads("zero", heads.model, 4, lookup=3, narrow=2)
    treed = real.Heads("zero", heads.model, 4, lookup=3, tree=((0,), (1,)))  # (trees act in a call of one row)
    settings = [heads, real.Heads("zero", heads.model, 4, lookup=3), narrowed, treed]
    engines = real.sampling_engines(model, tok, settings, "fp32", how, 12, base)
    assert list(engines) == [
        "ours fp32 sampling",
        "ours fp32 zero k=4 sampling",
        "ours fp32 zero k=4 lookup=3 sampling",
        "ours fp32 zero k=4 lookup=3 narrow=2 sampling",
        "ours fp32 zero k=4 lookup=3 tree=0;1 sampling",
    ]
    asked = [real.Asked(tok.chat_ids([{"role": "user", "content": q}]), s) for q, s in (("hi", 3), ("2 + 2?", 4))]
    for run, info in engines.values():
        alone = [run([a]) for a in asked]
        both = run(asked)
        assert both.tokens == [r.tokens[0] for r in alone]  # a request's answer depends on its own seed only
        assert run([asked[0]]).tokens == alone[0].tokens
        assert all(sum(r.accepted.values()) == r.calls for r in alone)  # batch 1: one row step a decoder call
        assert sum(both.accepted.values()) >= both.calls
        if info["decoder"] == "sampling":
            assert set(both.accepted) == {1}
        else:
            assert info["plain"] == "ours fp32 sampling" and max(both.accepted) <= 4


def test_sampling_times_every_heads_k_even_where_narrow_steps_leave_one_out():
    from types import SimpleNamespace

    real = _load("real")
    trained = SimpleNamespace(config=SimpleNamespace(block_size=8))
    args = SimpleNamespace(heads_k=[2, 4, 16], lookup=[3], narrow=[2], tree=[()])
    assert [h.k for h in real.head_settings([("h", trained)], args)] == [4]  # narrow 2 needs k > 2
    args.lookup, args.narrow = [0, 3], [0, 2]  # with and without prompt lookup and narrow steps
    got = [(h.k, h.lookup, h.narrow) for h in real.sampling_settings([("h", trained)], args)]
    assert got == [(2, 0, 0), (2, 3, 0), (4, 0, 0), (4, 3, 0), (4, 3, 2)]  # narrow: with lookup, below k
    args.tree = [(), ((0,), (1,)), ((0, 0, 0), (1,))]  # a tree replaces narrow steps, as deep as the heads allow
    got = [(h.k, h.lookup, h.narrow, h.tree) for h in real.sampling_settings([("h", trained)], args) if h.tree]
    assert got == [(2, 0, 0, ((0,), (1,))), (2, 3, 0, ((0,), (1,))), (4, 0, 0, ((0,), (1,))),
                   (4, 0, 0, ((0, 0, 0), (1,))), (4, 3, 0, ((0,), (1,))), (4, 3, 0, ((0, 0, 0), (1,)))]  # fmt: skip
    args.tree = [()]
    args.heads_k, args.lookup, args.narrow = [], [0], [0]
    assert [h.k for h in real.sampling_settings([("h", trained)], args)] == [8]  # default: the heads' own k
