"""Translate text with an exported bundle, or generate with a decoder-only (LM) bundle; blockwise by default.

    python -m bpd_train.translate --bundle DIR [--block-size k] [--accept exact|top2] [--batch-size n] \
        < in.txt > out.txt
    python -m bpd_train.translate --bundle LM_DIR [--chat] [--langs en:fr] [--input prompts.txt] \
        [--context-policy truncate_left|refuse] [--max-new-tokens N] > responses.txt

Streaming: reads stdin (or --input) in chunks of --batch-size lines, writes (and flushes) each chunk's outputs in
input order, one line per input line (an empty line gives an empty line; an answer's own line breaks become spaces,
or --jsonl writes {"text": ...} per line with them kept). k̂ and speed go to stderr at the end.
An LM bundle answers each line as a prompt: as it is, as the user's message of a chat (--chat: the tokenizer's
chat template), or as a prompt-format translation prompt (--langs en:fr: "English: <line>\nFrench:", the format
the LM demo trains on). Exact blockwise and greedy give the same output.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Iterable, Iterator, TextIO

from bpd_train.app.cli import USER_ERRORS, report
from bpd_train.decode_settings import DecodeError, DecodeSettings, add_arguments, as_int, carried, from_args
from bpd_train.decoding.result import DecodeStats
from bpd_train.scoring import one_line


class _Lines:
    """Input lines as text under an --errors policy; undecodable line numbers are kept for the final report.

    A real stdin is read as bytes (its .buffer): Python's own text layer would raise mid-stream (or, under a C
    locale, smuggle surrogates into sentencepiece). An in-memory text stream is taken as it is."""

    def __init__(self, stream, errors: str, progress=None):
        self.stream, self.errors = getattr(stream, "buffer", stream), errors
        self.progress = progress
        self.bad: list[tuple[int, int]] = []  # (line number, byte offset) of undecodable lines
        self.replaced = 0

    def __iter__(self) -> Iterator[str | None]:
        for lineno, line in enumerate(self.stream, start=1):
            if self.progress is not None:
                self.progress.read = lineno
            raw = line.encode("utf-8", "surrogateescape") if isinstance(line, str) else line
            raw = raw.rstrip(b"\r\n")
            try:
                yield raw.decode("utf-8")
            except UnicodeDecodeError as e:
                if self.errors == "replace":
                    self.replaced += 1
                    yield raw.decode("utf-8", "replace")
                else:
                    self.bad.append((lineno, e.start))
                    yield None  # no translation, but its output line is kept (empty) so the lines stay aligned


def _chunks(lines: Iterable[str | None], n: int) -> Iterator[list[str | None]]:
    buf: list[str | None] = []
    for line in lines:
        buf.append(line)
        if len(buf) == n:
            yield buf
            buf = []
    if buf:
        yield buf


def parse_args(argv=None) -> argparse.Namespace:
    return parser().parse_args(argv)


def parser() -> argparse.ArgumentParser:
    """The command line: its decode flags are derived from the declared settings (bpd_train/decode_settings.py, one
    `--<name>` per DecodeSettings field, each also a Translator keyword); the rest say where text comes from and
    goes."""
    p = argparse.ArgumentParser(prog="python -m bpd_train.translate", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--bundle", required=True, help="bundle folder written by export.py (a checkpoint or run folder loads too)"
    )
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto (default)")
    p.add_argument("--greedy", action="store_true", help="plain greedy decoding (--method greedy)")
    p.add_argument(
        "--max-new-tokens", default=None, metavar="N", help="generate at most N tokens per line (--max-len N)"
    )
    add_arguments(p)
    p.add_argument(
        "--errors",
        choices=("strict", "replace"),
        default="strict",
        help="input that is not UTF-8: strict (default) leaves that line's output empty, translates the "
        "rest and exits 2 naming the lines; replace translates it with U+FFFD for the bad bytes",
    )
    p.add_argument("--input", default=None, metavar="FILE", help="read the lines from FILE instead of stdin")
    p.add_argument(
        "--jsonl",
        action="store_true",
        help='write one JSON object per input line, {"text": ...}, the text as decoded (line breaks kept); '
        "without it each output is one line (line breaks become spaces)",
    )
    lm = p.add_argument_group("decoder-only (LM) bundles")
    lm.add_argument(
        "--chat",
        action="store_true",
        help="each line is the user's message of a chat, rendered with the tokenizer's chat template",
    )
    lm.add_argument(
        "--langs",
        default=None,
        metavar="SRC:TGT",
        help="each line is a source sentence, prompted as 'English: <line>\\nFrench:' (e.g. en:fr)",
    )
    lm.add_argument(
        "--context-policy",
        choices=("truncate_left", "refuse"),
        default="truncate_left",
        help="a prompt longer than the context: keep its newest tokens (default, counted) or stop with an error",
    )
    p.add_argument("--quiet", action="store_true", help="no summary on stderr")
    return p


EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command stopped by Ctrl-C


class _Progress:
    read = written = 0  # input lines read so far; lines whose output is written (whole chunks, in order)
    total: int | None = None  # the input's line count, when it is a file


def main(argv=None, stdin: TextIO | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    """Ctrl-C stops it with one line on stderr and status 130; the output written so far is the first N lines'."""
    progress = _Progress()
    try:
        return _main(argv, stdin, stdout, stderr, progress)
    except KeyboardInterrupt:
        of = progress.total if progress.total is not None else progress.read
        print(f"interrupted: {progress.written} of {of} lines written", file=stderr or sys.stderr, flush=True)
        return EXIT_INTERRUPTED


def _main(argv, stdin, stdout, stderr, progress: _Progress) -> int:
    args = parse_args(argv)
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    import torch

    from bpd_train.decoding.serving import decode_texts, prepare
    from bpd_train.sources.loading import load

    try:
        settings = decode_settings(args)  # every decode value checked once, by the declaration
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(auto if args.device == "auto" else args.device)
        if args.input is not None:
            stdin = _input_file(args.input)
            data = stdin.getvalue()
            progress.total = data.count(b"\n") + (not data.endswith(b"\n"))
        loaded = load(args.bundle, map_location=device)  # bpd_train/sources/loading.py: a bundle (or any other source)
        own, why = carried(loaded.meta, f"bundle {args.bundle}")
        if own:  # the bundle's own settings (its evaluation's fastest), under every flag given here
            settings = decode_settings(args, own)
            mine, default = DecodeSettings(**own).as_config(), DecodeSettings().as_config()
            shown = " ".join(f"{k}={mine[k]}" for k in sorted(own) if k == "method" or mine[k] != default[k])
            print(f"decode settings from the bundle: {shown} ({why or 'no reason given'}); flags override", file=stderr)
        model, sp = loaded.model, loaded.tokenizer()
        text = _text(args, loaded, sp)
        decoder = prepare(model, sp, settings, device, where=f"bundle {args.bundle}", weight_type=loaded.weight_type)
    except USER_ERRORS as e:
        return report(e, stderr)
    chat = args.chat  # only a prompted family got this far with --chat (_text)
    stats, n_sent, seconds = DecodeStats(), 0, 0.0
    source = _Lines(stdin, args.errors, progress)
    # one context around the whole stream: a Ctrl-C that another thread received is raised in this thread at its
    # next Python call, here the context's exit at the latest, so inside main() even when stdin ends meanwhile
    with torch.inference_mode():
        for lines in _chunks(source, settings.batch_size):
            items = [[{"role": "user", "content": s}] if chat and s is not None and s.strip() else s for s in lines]
            try:
                out = decode_texts(decoder, text, items, stats, where=lambda i: f"line {n_sent + i + 1}", first=n_sent)
            except USER_ERRORS as e:  # an LM prompt too long under --context-policy refuse
                return report(e, stderr)
            if decoder.precision and not n_sent:  # dtype auto: which precision and why, once the input decodes
                print(f"{decoder.precision}; --dtype overrides", file=stderr)
            seconds += out.seconds
            stdout.write("".join(_line(o, args.jsonl) for o in out.texts))
            stdout.flush()
            n_sent += len(lines)
            progress.written = n_sent
    if not args.quiet:
        khat = f"k̂={stats.mean_accepted:.2f}, " if decoder.blockwise else ""
        rate = f"{n_sent / seconds:.1f} sent/s, {stats.tokens / seconds:.1f} tok/s" if seconds > 0 else "no decoding"
        print(
            f"{loaded.family.verb} {n_sent} lines ({decoder.label}, batch {settings.batch_size}, {device.type}): {khat}"
            f"decoder calls={stats.calls}, {rate}, {seconds:.2f}s decoding"
            + (
                f", {text.truncated} source(s) truncated to {model.config.max_positions} positions"
                if text.truncated
                else ""
            ),
            file=stderr,
        )
    if source.replaced:
        print(
            f"warning: {source.replaced} input line(s) were not valid UTF-8; bad bytes were read as U+FFFD", file=stderr
        )
    if source.bad:
        where = ", ".join(f"line {n} (byte {b})" for n, b in source.bad[:5]) + (" ..." if len(source.bad) > 5 else "")
        return report(
            f"{len(source.bad)} input line(s) are not valid UTF-8: {where}; their output lines are empty, "
            "every other line was translated. Fix the input encoding or pass --errors replace",
            stderr,
        )
    return 0


def decode_settings(args: argparse.Namespace, defaults: dict | None = None) -> DecodeSettings:
    """The command line's decode settings, as Translator takes them: the declared flags, --greedy (method=greedy)
    and --max-new-tokens N (max_len=N, which must be at least 1); flags not given take `defaults` (a bundle's)."""
    changes = {}
    if args.greedy:
        changes["method"] = "greedy"
    if args.max_new_tokens is not None:
        n = as_int(args.max_new_tokens)
        if n is None or n < 1:
            raise DecodeError(f"max_new_tokens={args.max_new_tokens!r}: expected an int >= 1")
        changes["max_len"] = n
    return from_args(args, defaults, **changes)


def _line(text: str, jsonl: bool) -> str:
    """One output line: the text as decoded in a JSON object (--jsonl), else flattened to one line."""
    return json.dumps({"text": text}, ensure_ascii=False) + "\n" if jsonl else one_line(text) + "\n"


def _input_file(path: str):
    """--input: the prompts (or sentences) file as a byte stream; missing or empty is a user error."""
    import io
    from pathlib import Path

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"--input {path} does not exist (or is not a file)")
    data = p.read_bytes()
    if not data.strip():
        raise ValueError(f"--input {path} is empty: give one prompt per line")
    return io.BytesIO(data)


def _text(args, loaded, tok):
    """The family's text adapter with this command line's options (--chat, --langs, --context-policy: only for a
    family that takes prompts; the family refuses them otherwise)."""
    fam = loaded.family
    fam.check_text_options(
        chat=args.chat,
        langs=bool(args.langs),
        context_policy=args.context_policy != "truncate_left",
        what=str(args.bundle),
    )
    if args.chat and args.langs:
        raise DecodeError("--chat and --langs exclude each other: a line is either a chat message or a source sentence")
    if args.chat and not tok.has_chat_template:
        raise DecodeError(
            f"--chat: the tokenizer of {args.bundle} has no chat template; give plain prompts (without --chat)"
        )
    src = tgt = None
    if args.langs:
        src, _, tgt = args.langs.partition(":")
        if not src or not tgt:
            raise DecodeError(f"--langs takes SRC:TGT language codes (e.g. en:fr), got {args.langs!r}")
    return fam.text_adapter(loaded, src, tgt, context_policy=args.context_policy, tokenizer=tok)


if __name__ == "__main__":
    sys.exit(main())
