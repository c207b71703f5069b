"""bench/real.py's results page and bench/llama_peer.py's guard, without the model or llama.cpp (both are bench-only)."""

import importlib.util

from conftest import REPO_ROOT


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO_ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_results_page_has_a_table_per_kind_of_row_with_its_numbers():
    real = _load("real")
    rows = [
        {"what": "greedy: native fp32 vs transformers generate", "threads": 1, "native_tok_s": 40.0,
         "transformers_tok_s": 16.0, "ratio": 2.5, "identical": True},
        {"what": "step cost k=4 int8", "threads": 2, "greedy_tok_s": 90.0, "ratio": 0.5, "k_hat": 0.55,
         "identical": True, "step_in_greedy_steps": 1.1, "batch": 1, "blockwise_tok_s": 45.0,
         "phases": {"greedy": {"ms_per_step": 12.0, "embed": 0.0, "decoder linears": 10.0, "attention": 0.5,
                               "norms etc.": 0.2, "head 1": 1.25, "heads FFN": 0.0, "proposal proj": 0.0,
                               "screen": {"rows": 256, "full_pass": 0, "candidates_per_row": 6.5}}}},
        {"what": "run k=8 int8 lookup=3", "threads": 2, "lookup": 3, "batch": 1, "greedy_tok_s": 90.0,
         "blockwise_tok_s": 180.0, "k_hat": 2.4, "ratio": 2.0, "identical": True},
        {"what": "run k=8 int8 lookup=3", "threads": 2, "lookup": 3, "batch": 8, "greedy_tok_s": 300.0,
         "blockwise_tok_s": 330.0, "k_hat": 9.0, "ratio": 1.1, "identical": True},
        {"what": "llama.cpp Q8_0", "dtype": "int8", "threads": 2, "greedy_tok_s": 60.0, "lookup3_tok_s": 70.0,
         "lookup3_identical": False, "ours_greedy_tok_s": 90.0, "ours_greedy_vs_llama": 1.5, "ours_blockwise_tok_s": 180.0,
         "ours_blockwise_vs_llama": 3.0},
        {"what": "llama.cpp BF16", "dtype": "bf16", "threads": 2, "greedy_tok_s": 50.0, "ours_greedy_tok_s": 75.0,
         "ours_greedy_vs_llama": 1.5, "ours_blockwise_tok_s": 100.0, "ours_blockwise_vs_llama": 2.0,
         "ours_identical": False},
        {"what": "llama.cpp Q4_1 (the file)", "dtype": "file", "threads": 2, "greedy_tok_s": 50.0,
         "ours_greedy_tok_s": 100.0, "ours_greedy_vs_llama": 2.0},
    ]  # fmt: skip
    md = real.page({"command": "python bench/real.py --threads 2", "cpu": "Test CPU", "torch": "2.13.0",
                    "date": "2026-12-04", "rows": rows})  # fmt: skip
    assert "`python bench/real.py --threads 2` on Test CPU" in md
    assert "| 1 | 40.0 | 16.0 | 2.50x | True |" in md
    assert "| 2 | k=4 int8 | 90.0 | 1.10 |" in md
    assert "| 2 | run k=8 int8 lookup=3 | 1 | 90.0 | 180.0 | 2.40 | 2.00x | True |" in md
    assert "| 2 | run k=8 int8 lookup=3 | 8 | 300.0 | 330.0 | - | 1.10x | True |" in md  # k-hat: batch 1 only
    assert "| 2 | greedy int8 | 0.00 | 10.00 | 0.50 | 0.20 | 1.25 | 0.00 | 0.00 | 0 / 256, 6.5 |" in md
    assert "its lookup3 tok/s" in md
    assert "| 2 | Q8_0 | 60.0 | 70.0 (output changed) | 90.0 | 1.50x | 180.0 | 3.00x |" in md
    assert "| 2 | BF16 | 50.0 | - | 75.0 | 1.50x | 100.0 (output changed) | 2.00x |" in md  # re-timed, not greedy's
    assert "| 2 | Q4_1 (the file) | 50.0 | - | 100.0 | 2.00x | - | - |" in md  # greedy only


def test_llama_cpp_guard_names_the_extra_when_missing():
    lc = _load("llama_peer")
    why = lc.available()
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        assert why is not None and "[bench-llama]" in why
    else:
        assert why is None


def test_every_bench_precision_has_its_llama_cpp_file_type():
    lc = _load("llama_peer")
    assert {d: name for d, (name, _) in lc.FTYPES.items()} == {"fp32": "F32", "bf16": "BF16", "int8": "Q8_0"}
    try:
        import llama_cpp
    except ImportError:
        return
    for _, ftype in lc.FTYPES.values():  # the requantizer's constants exist in the installed bindings
        assert isinstance(getattr(llama_cpp, ftype), int)


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

    from bpd_train.loading import load

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
