"""Translate text with an exported bundle, blockwise by default.

    python -m bpd_train.translate --bundle DIR [--block-size k] [--accept exact|top2] [--batch-size n] \
        < in.txt > out.txt

Streaming: reads stdin in chunks of --batch-size lines, writes (and flushes) each chunk's translations in input
order, one line per input line (an empty line gives an empty line). k̂ and speed go to stderr at the end.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Iterable, Iterator, TextIO


class _Lines:
    """Input lines as text under an --errors policy; undecodable line numbers are kept for the final report.

    A real stdin is read as bytes (its .buffer): Python's own text layer would raise mid-stream (or, under a C
    locale, smuggle surrogates into sentencepiece). An in-memory text stream is taken as it is."""

    def __init__(self, stream, errors: str):
        self.stream, self.errors = getattr(stream, "buffer", stream), errors
        self.bad: list[tuple[int, int]] = []  # (line number, byte offset) of undecodable lines
        self.replaced = 0

    def __iter__(self) -> Iterator[str | None]:
        for lineno, line in enumerate(self.stream, start=1):
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
    p = argparse.ArgumentParser(prog="python -m bpd_train.translate", description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", required=True, help="bundle folder written by export.py")
    p.add_argument("--block-size", type=int, default=None, help="k for blockwise decoding (default: the model's k)")
    p.add_argument("--accept", default="exact", help="acceptance rule: exact | top<N> (e.g. top2) | distance:<eps>")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per batch (default 32)")
    p.add_argument("--greedy", action="store_true", help="plain greedy decoding (no blockwise)")
    p.add_argument("--max-len", type=float, nargs=2, default=(1.5, 10), metavar=("A", "B"),
                   help="generate at most A*source_len + B tokens (default 1.5 10)")
    p.add_argument("--device", default="auto", help="cpu | cuda | cuda:N | auto (default)")
    p.add_argument("--dtype", default="fp32", help="decode-step weights: fp32 (default) | bf16 | int8")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="heads 2..k propose among the N most frequent tokens (output unchanged)")
    p.add_argument("--adaptive", action="store_true", help="feed only proposals whose heads pay (output unchanged)")
    p.add_argument("--errors", choices=("strict", "replace"), default="strict",
                   help="input that is not UTF-8: strict (default) leaves that line's output empty, translates the "
                        "rest and exits 2 naming the lines; replace translates it with U+FFFD for the bad bytes")
    p.add_argument("--quiet", action="store_true", help="no summary on stderr")
    return p.parse_args(argv)


def main(argv=None, stdin: TextIO | None = None, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    args = parse_args(argv)
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    import torch

    from bpd_train.cli import USER_ERRORS, report
    from bpd_train.decoding import blockwise, greedy
    from bpd_train.evaluation.decode import (EvalError, SpmText, check_block_sizes, decode_options, max_len_arg,
                                             parse_rule)
    from bpd_train.evaluation.metrics import DecodeStats, length_sorted_batches, one_line
    from bpd_train.export import load_bundle

    try:
        if args.batch_size < 1:
            raise EvalError(f"--batch-size must be >= 1, got {args.batch_size}")
        auto = "cuda" if torch.cuda.is_available() else "cpu"
        device = torch.device(auto if args.device == "auto" else args.device)
        model, sp, meta = load_bundle(args.bundle, map_location=device)
        cfg = model.config
        k = cfg.block_size if args.block_size is None else args.block_size
        if args.block_size is not None and not args.greedy:
            check_block_sizes([k], cfg.block_size, f"bundle {args.bundle}")
        rule = parse_rule(args.accept)
        max_len = max_len_arg(list(args.max_len))
        model.decode_options = decode_options(sp, cfg.eos_id, args.dtype, args.draft_vocab)
    except USER_ERRORS as e:
        return report(e, stderr)
    use_blockwise = not args.greedy and k > 1
    text = SpmText(sp, cfg.eos_id, cfg.pad_id, cfg.max_positions)
    stats, n_sent, seconds = DecodeStats(), 0, 0.0
    with torch.inference_mode():
        source = _Lines(stdin, args.errors)
        for lines in _chunks(source, args.batch_size):
            out = [""] * len(lines)
            todo = [i for i, s in enumerate(lines) if s is not None and s.strip()]
            ids = [text.source_ids(lines[i]) for i in todo]
            for group in length_sorted_batches([len(x) for x in ids], args.batch_size):
                src = text.batch([ids[j] for j in group], device)
                t0 = time.perf_counter()
                if use_blockwise:
                    r = blockwise(model, src, block_size=k, accept=rule, max_len=max_len, adaptive=args.adaptive)
                else:
                    r = greedy(model, src, max_len=max_len)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                seconds += time.perf_counter() - t0
                stats.add(r)
                for j, toks in zip(group, r.tokens):
                    out[todo[j]] = one_line(text.detok(toks))
            stdout.write("".join(o + "\n" for o in out))
            stdout.flush()
            n_sent += len(lines)
    if not args.quiet:
        mode = f"blockwise k={k} {args.accept}" if use_blockwise else "greedy"
        khat = f"k̂={stats.mean_accepted:.2f}, " if use_blockwise else ""
        rate = f"{n_sent / seconds:.1f} sent/s, {stats.tokens / seconds:.1f} tok/s" if seconds > 0 else "no decoding"
        print(f"translated {n_sent} lines ({mode}, batch {args.batch_size}, {device.type}): {khat}"
              f"decoder calls={stats.calls}, {rate}, {seconds:.2f}s decoding"
              + (f", {text.truncated} source(s) truncated to {cfg.max_positions} positions" if text.truncated else ""),
              file=stderr)
    if source.replaced:
        print(f"warning: {source.replaced} input line(s) were not valid UTF-8; bad bytes were read as U+FFFD",
              file=stderr)
    if source.bad:
        where = ", ".join(f"line {n} (byte {b})" for n, b in source.bad[:5]) + (" ..." if len(source.bad) > 5 else "")
        return report(f"{len(source.bad)} input line(s) are not valid UTF-8: {where}; their output lines are empty, "
                      "every other line was translated. Fix the input encoding or pass --errors replace", stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
