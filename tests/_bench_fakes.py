"""What the bench tests share: bench/ modules imported from the checkout, and a clock that only moves when a fake
engine says it took time."""

import importlib
import sys

from conftest import REPO_ROOT


def load_bench(name: str):
    """bench/<name>.py as the module bench.<name> (bench/ imports as a namespace package from the checkout)."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    return importlib.import_module(f"bench.{name}")


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def timed(clock, log, name, seconds, result):
    """A fake engine: each call 'takes' seconds(call number) (or seconds) on the clock, logs (name, unit) and returns
    result(unit)."""
    n = {"i": 0}

    def run(unit):
        s = seconds(n["i"]) if callable(seconds) else seconds
        n["i"] += 1
        clock.now += s
        log.append((name, unit))
        return result(unit)

    return run
