"""bench/hf.py, bench/engine_ct2.py and bench/engine.py time their engine comparisons with bench/protocol.py's
measure(): driven here with fake engines and fake clocks (or tiny models), a pass that is far faster than the others
must show only in the spread, never as the reported number (a best-of-reps timer would report it)."""

import sys

import pytest
from _bench_fakes import Clock, timed
from _bench_fakes import load_bench as _load

from conftest import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT))
from bench.protocol import Run  # noqa: E402


def fake(clock, seconds, tokens=4, log=None, name=None, out=7):
    """An engine that 'takes' seconds(call number) on the clock per unit and answers `tokens` ids per request."""
    n = {"i": 0}

    def run(unit):
        s = seconds(n["i"]) if callable(seconds) else seconds
        n["i"] += 1
        clock.now += s
        if log is not None:
            log.append((name, unit))
        reqs = unit if isinstance(unit, list) else [unit]
        return Run([[out(r) if callable(out) else out] * tokens for r in reqs])

    return run


def fast_first_pass(units, fast, slow):
    """seconds(call): calls 0..units-1 are the warm-up, units..2*units-1 the first timed pass (made fast)."""
    return lambda i: fast if units <= i < 2 * units else slow


class PairClock:
    """A clock for timers that read it twice around each timed call: the k-th pair is `seconds(k)` apart."""

    def __init__(self, seconds):
        self.seconds, self.calls, self.now = seconds, 0, 0.0

    def __call__(self):
        if self.calls % 2:
            self.now += self.seconds(self.calls // 2)
        self.calls += 1
        return self.now


def test_hf_bench_reports_the_median_pass_and_ratios_over_batches():
    hf = _load("hf")
    clock, log = Clock(), []
    batches = [[[1, 2], [3]], [[4], [5, 6]], [[7], [8]]]  # 3 batches of 2 sentences
    engines = {
        "transformers": fake(clock, 2.0, tokens=8, log=log, name="t"),
        "ctranslate2": fake(clock, 1.0, tokens=8, log=log, name="c"),
        # ours: its first timed pass 10x faster than the others
        "ours": fake(clock, fast_first_pass(3, 0.05, 0.5), tokens=8, log=log, name="o"),
    }
    row = hf.time_batches(engines, batches, 3, 8, clock=clock)
    assert [n for n, _ in log].count("o") == [n for n, _ in log].count("t") == 3 * 4  # warm-up + 3 timed passes
    assert row["reps"] == 3 and row["sentences"] == 6
    assert row["ours_tok_s"] == pytest.approx(32.0)  # 48 tokens in 1.5 s: the median pass, not the 10x one
    assert row["tok_s_spread"]["ours"]["max"] == pytest.approx(320.0)
    assert row["transformers_tok_s"] == pytest.approx(8.0) and row["ctranslate2_tok_s"] == pytest.approx(16.0)
    assert row["ours_vs_ctranslate2"]["median"] == pytest.approx(2.0)
    assert row["ours_vs_transformers"]["median"] == pytest.approx(4.0)
    assert set(row["ours_vs_transformers"]) == {"median", "p25", "p75", "min", "max"}
    assert row["lengths_equal"] and row["stable"] and row["identical_ours_vs_transformers"] == 1.0


def test_hf_bench_refuses_fewer_than_three_passes(capsys):
    hf = _load("hf")
    with pytest.raises(SystemExit) as e:
        hf.main(["--reps", "2"])
    assert e.value.code == 2 and "at least 3" in capsys.readouterr().err


def test_ct2_cell_is_the_median_pass_and_compares_outputs():
    ct2 = _load("engine_ct2")
    clock = Clock()
    batches = [[1, 2], [3, 4]]
    ours = fake(clock, fast_first_pass(2, 0.01, 1.0), tokens=5, out=lambda r: r)
    peer = fake(clock, 2.0, tokens=5, out=lambda r: r if r == 1 else 0)  # agrees on 1 sentence of 4
    row = ct2.ours_vs_ct2(ours, peer, batches, reps=3, clock=clock)
    assert row["ours_tok_s"] == pytest.approx(10.0)  # 20 tokens in 2 s, not the 100x pass
    assert row["tok_s_spread"]["ours"]["max"] == pytest.approx(1000.0)
    assert row["ct2_tok_s"] == pytest.approx(5.0)
    assert row["ratio"] == pytest.approx(2.0) and row["ratio_spread"]["median"] == pytest.approx(2.0)
    assert row["identical"] == pytest.approx(0.25) and row["reps"] == 3
    with pytest.raises(ValueError, match="at least 3"):
        ct2.ours_vs_ct2(ours, peer, batches, reps=2, clock=clock)


def test_bundle_decoders_are_timed_alike_with_ctranslate2_and_compared_by_precision():
    ct2 = _load("engine_ct2")
    clock = Clock()
    srcs = [10, 11, 12]
    fns = {
        "CTranslate2 greedy float32": fake(clock, 1.0, tokens=6),
        "CTranslate2 greedy int8": fake(clock, 0.5, tokens=6),
        "greedy fp32": fake(clock, 1.0, tokens=6),
        "blockwise k=4 exact fp32": fake(clock, fast_first_pass(3, 0.001, 0.5), tokens=6),
        "greedy int8": fake(clock, 0.5, tokens=6, out=8),
        "blockwise k=4 exact int8": fake(clock, 0.25, tokens=6, out=8),
    }
    rows = {r["decoder"]: r for r in ct2.time_decoders(fns, srcs, reps=3, clock=clock)}
    blk = rows["blockwise k=4 exact fp32"]
    assert blk["tok_s"] == pytest.approx(12.0) and blk["tok_s_spread"]["max"] == pytest.approx(6000.0)
    assert blk["vs_ct2"]["median"] == pytest.approx(2.0) and blk["same_as_greedy"] == 1.0
    assert rows["blockwise k=4 exact int8"]["vs_ct2"]["median"] == pytest.approx(2.0)  # over CTranslate2 int8
    assert rows["greedy int8"]["same_as_greedy"] == 1.0  # against our greedy int8, not fp32
    assert rows["CTranslate2 greedy int8"]["same_as_greedy"] == 0.0 and "vs_ct2" not in rows["CTranslate2 greedy int8"]


def test_ct2_bench_end_to_end_on_a_tiny_model():
    pytest.importorskip("ctranslate2")
    import torch

    ct2 = _load("engine_ct2")
    from bpd_train.model import BPDConfig, BPDModel

    def make():
        torch.manual_seed(0)
        return BPDModel(
            BPDConfig(vocab_size=300, d_model=32, n_heads=2, n_encoder_layers=1, n_decoder_layers=1, d_ff=64,
                      block_size=1, dropout=0.0)
        ).eval()  # fmt: skip

    rows = ct2.bench_ct2(make, [1], [2], n_sent=4, size="tiny", reps=3)
    assert [(r["dtype"], r["batch"], r["reps"]) for r in rows] == [("fp32", 2, 3), ("int8", 2, 3)]
    for r in rows:
        for who in ("ours", "ct2"):
            s = r["tok_s_spread"][who]
            assert s["min"] <= r[f"{who}_tok_s"] == s["median"] <= s["max"]
    assert rows[0]["identical"] == 1.0  # fp32: the same weights give the same ids


def test_lm_decode_bench_reports_medians_under_the_protocol():
    eng = _load("engine")
    # every timed call 1 s, except the whole first timed pass (12 calls: 2 prompts x 6 decoders at most) 100x faster
    n = {"runs": 0}

    def seconds(k):
        n["runs"] += 1
        return 0.01 if k < n_first else 1.0

    from bpd_train.engine.fastlinear import native_kernels

    n_first = 2 * 2 * (1 + (native_kernels() is not None))
    rows = eng.bench_lm_decode(["lm-demo"], 1, ["fp32"], n_prompts=2, max_len=6, passes=3, clock=PairClock(seconds))
    assert n["runs"] == n_first * 3  # three timed passes, nothing else read the clock
    for r in rows:
        assert r["reps"] == 3 and r["seconds"] == pytest.approx(2.0)  # the median pass: 2 prompts x 1 s
        assert r["tokens_per_s"] == r["tok_s_spread"]["median"] < r["tok_s_spread"]["max"]
        assert r["tok_s_spread"]["max"] == pytest.approx(100 * r["tok_s_spread"]["median"], rel=0.01)
    torch_greedy = next(r for r in rows if (r["engine"], r["decoder"]) == ("torch", "greedy"))
    assert torch_greedy["speedup_vs_torch_greedy"] == 1.0 and torch_greedy["vs_torch_greedy"]["p25"] == 1.0


def test_kernel_timings_are_the_median_round():
    eng = _load("engine")
    row = eng.kernel_row("demo", 8, 4, 1, "fp32", 1, [5.0, 0.5, 9.0])
    assert (row["us"], row["us_min"], row["us_max"], row["rounds"]) == (5.0, 0.5, 9.0, 3)


def test_argmax_kernel_bench_keeps_the_median_of_its_rounds(monkeypatch):
    from bpd_train.engine.fastlinear import native_kernels

    if native_kernels() is None:
        pytest.skip("native kernels not built")
    eng = _load("engine")
    n, k, r = 300, 40, 1
    inner = max(1, int(2e6 // (n * k * r)))
    # 3 rounds x 2 kernels: the first round of each 100x faster
    clock = PairClock(lambda p: (0.01 if p < 2 else 1.0) * inner * 1e-6)
    monkeypatch.setattr(eng.time, "perf_counter", clock)
    rows = eng.bench_argmax("demo", n, k, 1, (r,), 3)
    assert clock.calls == 2 * 2 * 3
    for row in rows:
        assert row["us"] == pytest.approx(1.0) and row["us_min"] == pytest.approx(0.0, abs=0.05)


def test_bundle_bench_end_to_end_on_a_tiny_bundle(tmp_path_factory):
    from _eval_tiny import build_tiny

    from bpd_train.app.export import export_checkpoint

    ct2 = _load("engine_ct2")
    bundle = export_checkpoint(build_tiny(tmp_path_factory)["run"], tmp_path_factory.mktemp("bundles") / "b")
    rows = {r["decoder"]: r for r in ct2.bench_bundle(str(bundle), n_sent=3, draft_vocab=50, reps=3)}
    assert {"greedy fp32", "greedy int8"} <= set(rows) and all(r["reps"] == 3 for r in rows.values())
    for name, r in rows.items():
        s = r["tok_s_spread"]
        assert s["min"] <= r["tok_s"] == s["median"] <= s["max"]
        if "exact" in name:  # exact blockwise: the ids of our greedy of that precision
            assert r["same_as_greedy"] == 1.0
        if "CTranslate2 greedy float32" in rows and not name.startswith("CTranslate2"):
            assert set(r["vs_ct2"]) == {"median", "p25", "p75", "min", "max"}


def decoder(clock, seconds, log, name, tokens=3, out=7, hist=None, calls=2):
    """A decoder as the MT scripts call it: batch (a list of source ids) -> DecodeResult, `seconds(call)` on the
    clock, logging (name, batch)."""
    from bpd_train.decoding import DecodeResult

    n = {"i": 0}

    def run(batch):
        s = seconds(n["i"]) if callable(seconds) else seconds
        n["i"] += 1
        clock.now += s
        log.append((name, tuple(batch)))
        rows = [[out(r) if callable(out) else out] * tokens for r in batch]
        return DecodeResult(rows, calls, accepted_hist=dict(hist or {1: tokens * len(batch)}))

    return run


def assert_protocol_order(log, names, batches):
    """A full untimed warm-up pass of every decoder first, then passes in which the decoders take turns batch by
    batch, no decoder always first."""
    per_batch = len(names)
    warm = log[: per_batch * len(batches)]
    assert sorted(warm) == sorted((n, tuple(b)) for n in names for b in batches)
    timed = log[per_batch * len(batches) :]
    assert len(timed) == 3 * per_batch * len(batches)
    turns = [timed[i : i + per_batch] for i in range(0, len(timed), per_batch)]
    for turn in turns:  # every decoder on one batch, back to back, before the next batch
        assert {n for n, _ in turn} == set(names) and len({b for _, b in turn}) == 1
    firsts = [turn[0][0] for turn in turns]
    assert len(set(firsts)) == len(names)


def test_regimes_bench_reports_median_speedups_over_batches_under_the_protocol():
    reg = _load("engine_regimes")
    clock, log = Clock(), []
    batches = [[1, 2], [3, 4], [5, 6], [7, 8]]
    fns = {
        "greedy": decoder(clock, 1.0, log, "greedy"),
        # its first timed pass (calls 4-7) 100x faster: a best-of-passes timer would report it
        "plain": decoder(clock, fast_first_pass(4, 0.005, 0.5), log, "plain", hist={4: 1, 2: 1}),
        # accepts proposals greedy would not have chosen: one sentence (source 3) comes out differently
        "plain top2": decoder(clock, 0.25, log, "plain top2", out=lambda r: 9 if r == 3 else 7),
        "greedy fp32": decoder(clock, 2.0, log, "greedy fp32"),
        "prefill": decoder(clock, 0.2, log, "prefill"),
    }
    t, hist = reg.time_regime(fns, batches, reps=3, clock=clock)
    assert_protocol_order(log, list(fns), batches)
    rows = {r["decoder"]: r for r in reg.regime_rows(t, hist, fp32=True)}
    assert set(rows) == {"greedy", "plain", "plain top2", "greedy fp32"}  # the prefill is no decoder's row
    plain = rows["plain"]
    assert plain["speedup"] == pytest.approx(2.0) and plain["speedup_spread"]["max"] == pytest.approx(2.0)
    assert plain["seconds"] == pytest.approx(2.0)  # the median pass: 4 batches x 0.5 s
    assert sorted(plain["pass_speedups"])[1] == pytest.approx(2.0) and max(plain["pass_speedups"]) == pytest.approx(
        200.0
    )  # the fast pass shows only here, as the noise it is
    assert plain["steps_speedup"] == pytest.approx((1.0 - 0.2) / (0.5 - 0.2), abs=1e-3)  # rounded to 3 places
    assert plain["prefill_share"] == pytest.approx(0.2) and plain["reps"] == 3
    assert plain["khat"] == pytest.approx(3.0) and plain["same"] == 1.0
    assert plain["speedup_vs_fp32_greedy"] == pytest.approx(4.0)
    assert rows["plain top2"]["same"] == pytest.approx(7 / 8) and rows["plain top2"]["speedup"] == pytest.approx(4.0)
    assert rows["greedy"]["speedup"] == 1.0
    with pytest.raises(ValueError, match="at least 3"):
        reg.time_regime(fns, batches, reps=2, clock=clock)


def test_regimes_bench_refuses_fewer_than_three_passes(capsys):
    eng = _load("engine")
    with pytest.raises(SystemExit) as e:
        eng.main(["--regimes", "some-run", "--passes", "2"])
    assert e.value.code == 2 and "at least 3" in capsys.readouterr().err


def test_decode_bench_times_its_decoders_under_the_protocol():
    dec = _load("decode")
    clock, log = Clock(), []
    batches = [[1], [2], [3]]
    fns = {
        "greedy": decoder(clock, 1.0, log, "greedy", out=lambda r: r),
        "blockwise": decoder(clock, fast_first_pass(3, 0.001, 0.25), log, "blockwise", out=lambda r: r,
                             hist={4: 1}),
        "adaptive": decoder(clock, lambda i: [0.5, 0.5, 2.0][i % 3], log, "adaptive", out=lambda r: r),
    }  # fmt: skip
    t, res = dec.race(fns, batches, 3, clock=clock)
    assert_protocol_order(log, list(fns), batches)
    assert res["blockwise"].tokens == [[1] * 3, [2] * 3, [3] * 3]  # merged in batch order
    assert res["blockwise"].mean_accepted == pytest.approx(4.0) and res["blockwise"].calls == 6
    sp = dec.speeds(t)
    assert sp["speedup"] == pytest.approx(4.0) and sp["speedup_spread"]["max"] == pytest.approx(4.0)  # not 1000x
    assert sp["greedy_s"] == pytest.approx(3.0) and sp["blockwise_s"] == pytest.approx(0.75)
    # adaptive: batches 0 and 1 twice as fast as greedy, batch 2 half as fast: the median over batches
    assert sp["adaptive_speedup"] == pytest.approx(2.0) and sp["adaptive_s"] == pytest.approx(3.0)
    assert sp["speedup_spread"]["min"] == pytest.approx(4.0) and sp["reps"] == 3


def test_decode_bench_refuses_fewer_than_three_passes(monkeypatch, capsys):
    dec = _load("decode")
    monkeypatch.setattr(sys, "argv", ["decode.py", "--repeats", "2"])
    with pytest.raises(SystemExit) as e:
        dec.main()
    assert e.value.code == 2 and "at least 3" in capsys.readouterr().err


def turns_of(log, names, per_pass, passes=3):
    """Split a log of (name, unit) into the warm-up pass and the timed turns, checking the protocol's order: every
    engine over every unit untimed first, then per unit every engine back to back, the first rotating."""
    n = len(names)
    warm, timed = log[: n * per_pass], log[n * per_pass :]
    assert sorted(warm, key=repr) == sorted(((a, u) for a in names for u in range(per_pass)), key=repr)
    assert len(timed) == passes * n * per_pass
    turns = [timed[i : i + n] for i in range(0, len(timed), n)]
    for turn in turns:
        assert {a for a, _ in turn} == set(names) and len({u for _, u in turn}) == 1
    return turns


def stepper(clock, log, name, seconds):
    """A step function of no argument for engine_kernels.rounds(): `seconds(call)` on the clock, logging its name
    with the call number within its pass (read back from the log's length for that name)."""
    n = {"i": 0}

    def f():
        s = seconds(n["i"]) if callable(seconds) else seconds
        n["i"] += 1
        clock.now += s
        log.append((name, None))

    return f


def test_step_costs_are_median_ratios_over_calls_under_the_protocol():
    eng = _load("engine")
    clock, log = Clock(), []
    per_pass = 2  # reps=6 over 3 passes
    fns = {
        # greedy's first timed pass (calls 2-3) 100x faster: a best-of timer would report 0.01 s
        "greedy": stepper(clock, log, "greedy", fast_first_pass(per_pass, 0.01, 1.0)),
        2: stepper(clock, log, 2, 1.5),
        4: stepper(clock, log, 4, fast_first_pass(per_pass, 0.02, 2.0)),
        "loop greedy": stepper(clock, log, "loop greedy", 16.0),
        ("loop", 2): stepper(clock, log, ("loop", 2), 8.0),
        ("loop", 4): stepper(clock, log, ("loop", 4), 32.0),
    }
    t = eng.rounds(fns, reps=6, passes=3, clock=clock)
    units = [u for rep in range(4) for u in range(per_pass) for _ in fns]  # the unit of each logged call, in order
    turns = turns_of([(n, units[i]) for i, (n, _) in enumerate(log)], list(fns), per_pass)
    assert len({turn[0][0] for turn in turns}) == len(turns)  # 6 turns, 6 steps: each went first once
    gms, ratio, loop = eng.step_table(t, [2, 4], loop_steps=16)
    assert gms["median"] == pytest.approx(1000.0) and gms["min"] == pytest.approx(10.0)  # the fast pass: spread only
    assert ratio[2]["median"] == pytest.approx(1.5)
    assert ratio[4]["median"] == pytest.approx(2.0) and ratio[4]["max"] == pytest.approx(2.0)  # per-call medians
    assert loop["greedy_ms"]["median"] == pytest.approx(1000.0)
    assert loop[2]["median"] == pytest.approx(0.5) and loop[4]["median"] == pytest.approx(2.0)
    fields = eng._cost_fields(gms, ratio)
    assert (fields["greedy_ms"], fields["k2"], fields["k4"]) == (1000.0, 1.5, 2.0)
    assert fields["greedy_ms_range"] == [10.0, 1000.0] and set(fields["k4_spread"]) == {
        "median",
        "p25",
        "p75",
        "min",
        "max",
    }
    with pytest.raises(ValueError, match="at least 3"):
        eng.rounds(fns, reps=6, passes=2, clock=clock)


def test_step_cost_rows_on_demo_models_time_only_the_protocols_passes():
    import torch

    eng = _load("engine")
    from bpd_train.engine.packed import DecodeOptions

    models = {k: eng.make_model("demo", k) for k in (2, 4)}
    clock = PairClock(lambda p: 1e-3)
    gms, ratio, loop = eng.step_costs(models, DecodeOptions(), reps=3, loop_steps=2, clock=clock)
    n_steps = 3 + (3 if loop else 0)  # greedy, k=2, k=4 (and the native loops' three)
    assert clock.calls == 2 * n_steps * 3  # 3 timed passes of 1 call each; the warm-up pass never reads the clock
    assert gms["median"] == pytest.approx(1.0) and ratio[4]["median"] == pytest.approx(1.0)
    threads = torch.get_num_threads()
    try:
        rows = eng.bench_steps(["demo"], [1], reps=3)
    finally:
        torch.set_num_threads(threads)
    assert rows and all(r["passes"] == 3 and r["calls_per_pass"] == 1 for r in rows)
    for r in rows:
        assert r["greedy_ms_range"][0] <= r["greedy_ms"] <= r["greedy_ms_range"][1]
        assert r["k8_spread"]["min"] - 0.01 <= r["k8"] <= r["k8_spread"]["max"] + 0.01


def test_engine_bench_refuses_fewer_than_three_passes_in_every_mode(capsys):
    eng = _load("engine")
    for argv in (
        ["--passes", "2"],
        ["--kernels", "--passes", "1"],
        ["--lm-decode", "--sizes", "lm-demo", "--passes", "2"],
    ):
        with pytest.raises(SystemExit) as e:
            eng.main(argv)
        assert e.value.code == 2 and "at least 3" in capsys.readouterr().err


def test_kernel_rounds_warm_up_and_take_turns():
    kern = _load("engine_kernels")
    clock, log = Clock(), []
    fns = {n: stepper(clock, log, n, s) for n, s in (("fp32", 2e-3), ("int8", fast_first_pass(4, 1e-6, 1e-3)))}
    t = kern.rounds(fns, reps=10, passes=3, clock=clock)  # ceil(10 / 3) = 4 rounds per pass
    units = [u for rep in range(4) for u in range(4) for _ in fns]
    turns = turns_of([(n, units[i]) for i, (n, _) in enumerate(log)], list(fns), 4)
    assert [turn[0][0] for turn in turns[:2]] == ["fp32", "int8"]  # who goes first rotates call by call
    row = kern.kernel_row("demo", 8, 4, 1, "int8", 1, kern._us(t["int8"], inner=10), passes=3)
    assert row["us"] == pytest.approx(100.0) and row["us_min"] == pytest.approx(0.1) and row["rounds"] == 12
    assert row["passes"] == 3


def test_train_bench_times_frozen_and_finetune_under_the_protocol():
    train = _load("train")
    clock, log = Clock(), []

    def engine(name, seconds):
        return timed(clock, log, name, seconds, lambda step: Run([[0] * 100]))  # 100 training tokens a step

    engines = {
        "frozen": engine("frozen", fast_first_pass(3, 0.01, 1.0)),  # first timed pass 100x faster
        "finetune": engine("finetune", 2.0),
    }
    out = train.compare(engines, steps=3, passes=3, clock=clock)
    turns = turns_of(log, list(engines), 3)
    firsts = [turn[0][0] for turn in turns]
    assert all(a != b for a, b in zip(firsts, firsts[1:]))  # who goes first alternates step by step
    assert out["frozen_tokens_per_s"] == pytest.approx(100.0) and out["finetune_tokens_per_s"] == pytest.approx(50.0)
    assert out["tok_s_spread"]["frozen"]["max"] == pytest.approx(10000.0)  # the fast pass, only as the spread
    assert out["ratio"] == pytest.approx(2.0) and out["met"] and out["ratio_spread"]["max"] == pytest.approx(2.0)
    assert out["steps_each"] == 9 and out["passes"] == 3


def test_train_bench_refuses_fewer_than_three_passes(capsys):
    train = _load("train")
    with pytest.raises(SystemExit) as e:
        train.main(["--passes", "2"])
    assert e.value.code == 2 and "at least 3" in capsys.readouterr().err


def test_data_bench_compares_tokenization_runs_by_their_median():
    data = _load("data")
    clock, log = Clock(), []
    fns = {1: stepper(clock, log, 1, 2.0), 2: stepper(clock, log, 2, fast_first_pass(1, 0.01, 1.0))}
    out = data.tokenize_race(fns, examples=1000, repeats=3, clock=clock)
    turns = turns_of([(n, 0) for n, _ in log], [1, 2], 1)
    assert [turn[0][0] for turn in turns] == [2, 1, 2]  # the two alternate going first
    assert out["examples_per_s_num_proc_1"] == 500 and out["examples_per_s_num_proc_2"] == 1000  # not the best run
    assert out["examples_per_s_spread"]["2"]["max"] == 100000
    assert out["speedup_2_over_1"] == pytest.approx(2.0) and out["speedup_spread"]["max"] == pytest.approx(200.0)
    assert out["runs_s"] == {"1": [2.0, 2.0, 2.0], "2": [0.01, 1.0, 1.0]} and out["repeats"] == 3


def test_data_bench_refuses_fewer_than_three_repeats(capsys):
    data = _load("data")
    with pytest.raises(SystemExit) as e:
        data.main(["--repeats", "2"])
    assert e.value.code == 2 and "at least 3" in capsys.readouterr().err


def test_distill_bench_reports_the_median_run_of_every_config():
    distill = _load("distill")
    clock, log = Clock(), []

    def config(name, seconds):
        f = stepper(clock, log, name, seconds)
        return lambda: (f(), [([5, 6, 2], -1.0), ([7, 2], -0.5)])[1]

    fns = {
        "beam4_batch64": config("beam4_batch64", fast_first_pass(1, 0.01, 1.0)),
        "beam4_batch1": config("beam4_batch1", 4.0),
        "greedy_batch64": config("greedy_batch64", 0.5),
        "greedy_batch1": config("greedy_batch1", 2.0),
    }
    sps, spreads, outputs = distill.race(fns, sentences=2, reps=3, clock=clock)
    turns = turns_of([(n, 0) for n, _ in log], list(fns), 1)
    assert len({turn[0][0] for turn in turns}) == 3  # a different config first in each pass
    assert sps["beam4_batch64"] == pytest.approx(2.0) and spreads["beam4_batch64"]["max"] == pytest.approx(200.0)
    assert sps["beam4_batch1"] == pytest.approx(0.5) and sps["greedy_batch64"] == pytest.approx(4.0)
    assert outputs["greedy_batch1"] == [([5, 6, 2], -1.0), ([7, 2], -0.5)]
    with pytest.raises(ValueError, match="at least 3"):
        distill.race(fns, sentences=2, reps=2, clock=clock)


def test_distill_bench_refuses_fewer_than_three_reps(capsys):
    distill = _load("distill")
    with pytest.raises(SystemExit) as e:
        distill.main(["--reps", "2"])
    assert e.value.code == 2 and "at least 3" in capsys.readouterr().err
