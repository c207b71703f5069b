"""python -m bpd_train.translate: streaming, batched, blockwise by default; output == greedy with exact."""

import io
import subprocess
import sys

import pytest

from _eval_tiny import build_tiny, read_pairs

from bpd_train.app.export import export_checkpoint


@pytest.fixture(scope="session")
def bundle(tmp_path_factory):
    tiny = build_tiny(tmp_path_factory)
    return export_checkpoint(tiny["run"], tmp_path_factory.mktemp("translate") / "bundle")


def _run(argv, text):
    from bpd_train.app.translate import main

    out, err = io.StringIO(), io.StringIO()
    rc = main(argv, stdin=io.StringIO(text), stdout=out, stderr=err)
    return rc, out.getvalue(), err.getvalue()


def test_round_trip_equals_greedy(bundle):
    lines = [s for s, _ in read_pairs("validation", 7)]
    lines.insert(3, "")  # an empty line stays an empty line
    text = "\n".join(lines) + "\n"
    args = ["--bundle", str(bundle), "--max-len", "1", "5"]
    rc, blockwise_out, err = _run(args + ["--batch-size", "3"], text)
    assert rc == 0
    out_lines = blockwise_out.split("\n")[:-1]
    assert len(out_lines) == len(lines) and out_lines[3] == "" and all(out_lines[i] for i in (0, 1, 2, 4))
    assert "k̂=" in err and "blockwise k=4 exact adaptive" in err and "sent/s" in err
    rc, greedy_out, err = _run(args + ["--greedy", "--batch-size", "2"], text)
    assert rc == 0 and greedy_out == blockwise_out and "greedy" in err
    rc, int8_props_out, err = _run(
        args + ["--proposal-dtype", "int8", "--draft-vocab", "50", "--batch-size", "1"], text
    )
    assert rc == 0 and int8_props_out == greedy_out  # cheaper proposals, the same fp32 output
    rc, top2_out, err = _run(args + ["--accept", "top2", "--block-size", "2", "--batch-size", "8"], text)
    assert rc == 0 and len(top2_out.split("\n")) == len(lines) + 1 and "blockwise k=2 top2" in err


def test_bad_arguments(bundle, tmp_path):
    rc, out, err = _run(["--bundle", str(bundle), "--block-size", "9"], "hello\n")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "block size 9 is above the k = 4 heads" in err
    rc, out, err = _run(["--bundle", str(bundle), "--proposal-dtype", "fp8"], "hello\n")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "fp8" in err
    rc, _, err = _run(["--bundle", str(bundle), "--accept", "sometimes"], "hello\n")
    assert rc == 2 and "unknown acceptance rule" in err
    rc, _, err = _run(["--bundle", str(tmp_path / "missing")], "hello\n")
    assert rc == 2 and "does not exist" in err


def test_cli_subprocess(bundle):
    """The real command line: stdin -> stdout, summary on stderr."""
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "bpd_train.translate",
            "--bundle",
            str(bundle),
            "--batch-size",
            "2",
            "--max-len",
            "1",
            "3",
        ],
        input="In the beginning.\nAnd God said.\n\n",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.split("\n")) == 4 and res.stdout.endswith("\n\n")
    assert "translated 3 lines" in res.stderr


def test_readme_python_api_snippet_runs(bundle, capsys, tmp_path):
    """The README's Python API block is run as written (only the bundle's and the GGUF file's paths differ: a tiny
    chat model stands for SmolLM2): it stays true."""
    import re
    from pathlib import Path

    from _gguf_files import write_tiny_chat_llama

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Python API", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert 'Translator.from_pretrained("artifacts/demo/bible_en_fr/export/best")' in code
    write_tiny_chat_llama(tmp_path / "tiny.gguf")
    code = code.replace("artifacts/demo/bible_en_fr/export/best", str(bundle))
    code = code.replace("gguf:SmolLM2-135M-Instruct.Q4_1.gguf", f"gguf:{tmp_path / 'tiny.gguf'}")
    scope: dict = {}
    exec(compile(code, "README.md#python-api", "exec"), scope)
    out, lm = scope["out"], scope["lm"]
    assert len(out.texts) == 2 and out.calls >= 1 and out.mean_accepted >= 1.0
    assert lm.settings.dtype == "auto" and lm.dtype == "fp32"  # (the tiny file's matrices are mostly F32)
    assert capsys.readouterr().out.count("[") >= 2  # both print lines ran


def test_non_utf8_input_keeps_every_other_line(bundle):
    """A line that is not UTF-8 used to crash the run and lose its batch: now strict leaves that one output line
    empty, names it and exits 2; replace translates it with U+FFFD."""
    from bpd_train.app.translate import main

    good = [s for s, _ in read_pairs("validation", 3)]
    data = "\n".join(good[:2]).encode() + b"\ncaf\xe9 au lait\n" + good[2].encode() + b"\n"
    args = ["--bundle", str(bundle), "--max-len", "1", "3", "--batch-size", "4"]
    ref_rc, ref, _ = _run(args, "\n".join(good[:2] + [""] + good[2:]) + "\n")
    assert ref_rc == 0
    for policy in ("strict", "replace"):
        stdin = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")  # what sys.stdin is: text over a byte buffer
        out, err = io.StringIO(), io.StringIO()
        rc = main(args + ["--errors", policy], stdin=stdin, stdout=out, stderr=err)
        lines, ref_lines = out.getvalue().split("\n"), ref.split("\n")
        assert len(lines) == 5 and [lines[i] for i in (0, 1, 3)] == [ref_lines[i] for i in (0, 1, 3)]
        if policy == "strict":
            assert rc == 2 and lines[2] == "" and "line 3 (byte 3)" in err.getvalue()
            assert err.getvalue().count("error:") == 1
        else:
            assert rc == 0 and lines[2] != "" and "1 input line(s) were not valid UTF-8" in err.getvalue()


def test_bad_decode_settings_are_one_line_naming_the_option(bundle):
    # checked once (bpd_train/decode_settings.py), before the bundle loads: the same words as Translator's
    for args, message in (
        (["--dtype", "fp16"], "dtype='fp16': expected one of fp32, bf16, int8"),
        (["--adaptive", "--accept", "top0"], "accept='top0': "),
        (["--draft-vocab", "lots"], "draft_top_tokens='lots': expected a number of tokens"),  # the old flag too
        (["--max-new-tokens", "0"], "max_new_tokens='0': expected an int >= 1"),
        (["--max-len", "1", "inf"], "max_len=['1', 'inf']: expected finite numbers"),
    ):
        rc, out, err = _run(["--bundle", str(bundle), *args], "hello\n")
        assert rc == 2 and out == "" and err.count("\n") == 1 and err.startswith(f"error: {message}"), err
