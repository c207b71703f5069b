"""A user's own requests (a log of what they serve): read, checked, deduplicated and split, for
`python -m bpd_train.real_model --run --requests FILE`.

FILE is JSON lines of chat records ({"messages": [{"role", "content"}, ...]}: the conversation up to the request;
a final assistant turn is dropped, the model answers itself) or {"prompt": "..."} records, or plain text with one
request a line. Anything else is a RequestsError: one line, and the caller writes nothing.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

MIN_REQUESTS = 10


class RequestsError(ValueError):
    """A requests file that cannot be used: one line for the user."""


def _chat(obj, where: str) -> list[dict]:
    if not isinstance(obj, dict):
        raise RequestsError(f'{where}: a JSON object with "messages" or "prompt" expected, got {type(obj).__name__}')
    if isinstance(obj.get("messages"), list):
        msgs = []
        for m in obj["messages"]:
            if not (
                isinstance(m, dict)
                and m.get("role") in ("system", "user", "assistant")
                and isinstance(m.get("content"), str)
            ):
                raise RequestsError(f"{where}: every message needs a role (system, user, assistant) and text content")
            msgs.append({"role": m["role"], "content": m["content"]})
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        if not msgs or msgs[-1]["role"] != "user" or not msgs[-1]["content"].strip():
            raise RequestsError(f"{where}: the conversation does not end with a user's request")
        return msgs
    if isinstance(obj.get("prompt"), str) and obj["prompt"].strip():
        return [{"role": "user", "content": obj["prompt"].strip()}]
    raise RequestsError(f'{where}: a record needs "messages" (a chat) or a non-empty "prompt"')


def read_requests(path: Path) -> tuple[list[dict], str]:
    """(chat records {"id", "kind", "messages"} in file order without duplicates, the file's sha256). JSON lines
    when the first non-blank line starts with '{', else one request a line."""
    if not path.is_file():
        raise RequestsError(f"--requests {path}: no such file")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestsError(f"--requests {path}: not UTF-8 text (byte {e.start})") from None
    text = text.removeprefix("\ufeff")
    lines = text.splitlines()
    first = next((ln for ln in lines if ln.strip()), None)
    if first is None:
        raise RequestsError(f"--requests {path}: the file is empty")
    as_json = first.lstrip().startswith("{")
    out, seen = [], set()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--requests {path}:{n}"
        if as_json:
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise RequestsError(f"{where}: not a JSON line ({e.msg}, column {e.colno})") from None
            msgs = _chat(obj, where)
        else:
            msgs = [{"role": "user", "content": line.strip()}]
        key = " ".join(" ".join(m["content"] for m in msgs if m["role"] != "assistant").lower().split())
        if key in seen:
            continue
        seen.add(key)
        out.append({"id": f"line-{n}", "kind": "requests", "messages": msgs})
    return out, hashlib.sha256(raw).hexdigest()


def split_requests(records: list[dict], held_out: int, path: Path | str = "") -> tuple[list[dict], list[dict]]:
    """(training records, held-out records): the held-out ones chosen by a hash of their text (so adding requests
    to a log keeps the earlier choice mostly stable), at most `held_out` and at most a fifth of the file; they end
    with an assistant turn (the request again: evaluate.py needs a reference, never a target)."""
    if len(records) < MIN_REQUESTS:
        raise RequestsError(
            f"--requests {path}: {len(records)} different request(s); at least {MIN_REQUESTS} are needed to train on "
            "some and hold some out"
        )
    h = max(1, min(int(held_out), len(records) // 5))

    def digest(r: dict) -> str:
        return hashlib.sha256(json.dumps(r["messages"], ensure_ascii=False).encode("utf-8")).hexdigest()

    chosen = {r["id"] for r in sorted(records, key=digest)[:h]}
    train = [r for r in records if r["id"] not in chosen]
    held = [
        {
            **r,
            "kind": "held_out",
            "messages": [*r["messages"], {"role": "assistant", "content": r["messages"][-1]["content"]}],
        }
        for r in records
        if r["id"] in chosen
    ]
    return train, held
