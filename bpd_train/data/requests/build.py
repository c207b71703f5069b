"""The general chat-request corpus, built offline and deterministically from what every install has.

python -m bpd_train.data.requests OUT_DIR      writes train.jsonl, seen.jsonl, unseen.jsonl and manifest.json

Sources (provenance and licences: data/README.md):
  topics      data/general-requests/topics.txt: topic lists written for this project (concepts, foods, skills,
              places, animals, words, jobs, email situations, comparable groups, ...)
  python      the running Python's own standard library: documented public functions (their docstrings and, for
              functions written in Python, their source) and module docstrings, read with `inspect`
  bible       the bundled corpus data/bible-en-fr (World English Bible): short passages to summarize, rewrite,
              translate, quote
Each request is one of KINDS (a name, the pool its topics come from, a few phrasings). Every topic is held out or
not by a hash of "pool:topic" (held_out_topic), decided once for all kinds, so the held-out topics are disjoint
from the training topics by construction:
  train       the training kinds on the training topics (at most `per_kind` requests a kind)
  seen        the training kinds on the held-out topics (new topics of the kinds the heads learnt)
  unseen      the held-out kinds (never trained) on the held-out topics: the headline evaluation set
Requests are deduplicated on their normalised text across all three splits; the same inputs give the same
records in the same order (seeded by kind name, never by time or hash randomisation).
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib
import inspect
import json
import random
import re
import textwrap
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# ------------------------------------------------------------------------------------------------ topics


def held_out_topic(key: str, percent: int) -> bool:
    """Whether a topic ("pool:topic") is held out: the first 8 hex digits of its sha256, mod 100, below percent."""
    return int(hashlib.sha256(key.encode("utf-8")).hexdigest()[:8], 16) % 100 < percent


def read_topics(path: Path) -> dict[str, list[str]]:
    """{pool: [topic, ...]} from a topics file ("[pool]" headers, one topic a line, '#' comments)."""
    pools: dict[str, list[str]] = {}
    pool = None
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            pool = line[1:-1]
            pools.setdefault(pool, [])
        elif pool is None:
            raise ValueError(f"{path}:{n}: a topic before any [pool] header")
        else:
            pools[pool].append(line)
    return pools


@dataclass(frozen=True)
class Item:
    """One thing to ask about: its split keys ("pool:topic"; every key held out, or none, else it is dropped) and
    the fields the kinds' phrasings fill in."""

    keys: tuple[str, ...]
    fields: dict[str, str]
    source: str


# ------------------------------------------------------------------------------------------------ python sources

# Modules every CPython install has (no optional C extension or GUI toolkit); missing ones are skipped and counted.
PY_MODULES = (
    "abc argparse array ast base64 bisect binascii calendar cmath codecs collections colorsys configparser "
    "contextlib copy csv dataclasses datetime decimal difflib dis email.utils enum filecmp fnmatch fractions "
    "functools getopt gettext glob gzip hashlib heapq hmac html html.parser http.client http.cookies imaplib inspect "
    "io ipaddress itertools json keyword locale logging math mimetypes operator os os.path pathlib pickle platform "
    "plistlib pprint quopri queue random re reprlib secrets shlex shutil smtplib socket sqlite3 statistics string "
    "struct subprocess sys tarfile tempfile textwrap threading time timeit tokenize traceback types typing "
    "unicodedata urllib.parse urllib.request uuid warnings weakref wave xml.dom.minidom xml.etree.ElementTree "
    "zipfile zlib"
).split()

_SIGNATURE = re.compile(r"^[\w.]+\(.*\)( -> .*)?$")
_MUTATIONS = (  # (old, new): the first that occurs in a function's body makes its "buggy" version
    (" <= ", " < "),
    (" >= ", " > "),
    (" < ", " <= "),
    (" > ", " >= "),
    (" == ", " != "),
    (" != ", " == "),
    (" + 1", " - 1"),
    (" - 1", " + 1"),
    (" and ", " or "),
    (" or ", " and "),
    ("[1:]", "[:1]"),
    ("[:-1]", "[-1:]"),
    (" not ", " "),
)


def _first_paragraph(doc: str | None) -> str:
    """The docstring's first paragraph that is not a signature line, on one line ('' if none)."""
    for para in (doc or "").strip().split("\n\n"):
        para = " ".join(para.split())
        if para and not _SIGNATURE.match(para):
            return para
    return ""


def _first_sentence(text: str) -> str:
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    return (m.group(1) if m else text).strip()


def _without_docstring(src: str) -> str | None:
    """A function's source without its docstring (None when it has none or does not parse)."""
    try:
        fn = ast.parse(src).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(fn, ast.FunctionDef) or not fn.body:
        return None
    first = fn.body[0]
    if not (
        isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str)
    ):
        return None
    if len(fn.body) == 1:
        return None
    lines = src.splitlines()
    del lines[first.lineno - 1 : first.end_lineno]
    return "\n".join(lines).rstrip() + "\n"


def python_items() -> tuple[dict[str, list[Item]], dict[str, Any]]:
    """{"func": documented public functions, "source": those written in Python (short), "moddoc": module
    docstrings' first paragraphs}, and what was read (for the manifest)."""
    funcs: list[Item] = []
    sources: list[Item] = []
    moddocs: list[Item] = []
    missing = []
    for name in PY_MODULES:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001  (a module this Python lacks: counted in the manifest)
            missing.append(name)
            continue
        key = (f"python:{name}",)
        para = _first_paragraph(mod.__doc__)
        if 80 <= len(para) <= 600:
            moddocs.append(Item(key, {"module": name, "passage": para}, f"python:{name}"))
        for attr in sorted(vars(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr)
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj)):
                continue
            if getattr(obj, "__module__", None) not in (name, mod.__name__, f"_{name}"):
                continue
            doc = _first_paragraph(inspect.getdoc(obj))
            if len(doc) < 20:
                continue
            qual = f"{name}.{attr}"
            funcs.append(Item(key, {"qualname": qual, "doc": doc, "task": _first_sentence(doc)}, f"python:{qual}"))
            if not inspect.isfunction(obj):
                continue
            try:
                src = textwrap.dedent(inspect.getsource(obj))
            except (OSError, TypeError):
                continue
            bare = _without_docstring(src)
            if bare is None or not (3 <= len(bare.splitlines()) <= 16) or len(bare) > 700:
                continue
            head, _, body = bare.partition("\n")
            buggy = None
            for old, new in _MUTATIONS:
                if old in body:
                    buggy = head + "\n" + body.replace(old, new, 1)
                    break
            fields = {"qualname": qual, "doc": doc, "task": _first_sentence(doc), "code": bare.rstrip()}
            if buggy is not None:
                fields["buggy"] = buggy.rstrip()
            sources.append(Item(key, fields, f"python:{qual}"))
    return {"func": funcs, "source": sources, "moddoc": moddocs}, {"python_modules_missing": missing}


# ------------------------------------------------------------------------------------------------ bible passages

BOOKS = tuple(
    b.replace("_", " ")
    for b in (
        "Genesis Exodus Leviticus Numbers Deuteronomy Joshua Judges Ruth 1_Samuel 2_Samuel 1_Kings 2_Kings "
        "1_Chronicles 2_Chronicles Ezra Nehemiah Esther Job Psalms Proverbs Ecclesiastes Song_of_Solomon Isaiah "
        "Jeremiah Lamentations Ezekiel Daniel Hosea Joel Amos Obadiah Jonah Micah Nahum Habakkuk Zephaniah Haggai "
        "Zechariah Malachi Matthew Mark Luke John Acts Romans 1_Corinthians 2_Corinthians Galatians Ephesians "
        "Philippians Colossians 1_Thessalonians 2_Thessalonians 1_Timothy 2_Timothy Titus Philemon Hebrews James "
        "1_Peter 2_Peter 1_John 2_John 3_John Jude Revelation"
    ).split()
)
assert len(BOOKS) == 66


def bible_items(corpus_dir: Path, every: int = 9) -> dict[str, list[Item]]:
    """{"verse": single verses (40-260 characters), "passage": two consecutive verses of a chapter (120-480
    characters)}, every `every`-th of each taken, from all three splits of the bundled corpus; keyed by book."""
    rows = []
    for split in ("train", "validation", "test"):
        with gzip.open(corpus_dir / f"{split}.jsonl.gz", "rt", encoding="utf-8") as f:
            rows += [json.loads(line) for line in f if line.strip()]
    rows.sort(key=lambda r: tuple(int(x) for x in r["id"].split(".")))
    verses: list[Item] = []
    passages: list[Item] = []
    for n, r in enumerate(rows):
        b, c, v = (int(x) for x in r["id"].split("."))
        text = r["translation"]["en"].strip()
        key = (f"bible:{BOOKS[b - 1]}",)
        ref = f"{BOOKS[b - 1]} {c}:{v}"
        if n % every == 0 and 40 <= len(text) <= 260:
            verses.append(Item(key, {"passage": text, "ref": ref}, f"bible:{r['id']}"))
        if n % every == 4 and n + 1 < len(rows):
            nxt = rows[n + 1]
            if nxt["id"].rsplit(".", 1)[0] == r["id"].rsplit(".", 1)[0]:
                two = f"{text} {nxt['translation']['en'].strip()}"
                if 120 <= len(two) <= 480:
                    passages.append(Item(key, {"passage": two, "ref": ref}, f"bible:{r['id']}+1"))
    return {"verse": verses, "passage": passages}


# ------------------------------------------------------------------------------------------------ generated pools

UNITS = (
    ("centimeters", "meter", 100),
    ("grams", "kilogram", 1000),
    ("minutes", "hour", 60),
    ("seconds", "hour", 3600),
    ("ounces", "pound", 16),
    ("inches", "foot", 12),
    ("milliliters", "liter", 1000),
    ("hours", "week", 168),
    ("feet", "mile", 5280),
    ("meters", "kilometer", 1000),
    ("days", "leap year", 366),
    ("millimeters", "centimeter", 10),
    ("cups", "gallon", 16),
    ("pints", "gallon", 8),
    ("bytes", "kilobyte", 1024),
)


def generated_items() -> dict[str, list[Item]]:
    """Arithmetic and unit questions from fixed number ranges (keyed by the question's numbers)."""
    rng = random.Random("arith")
    arith = []
    for _ in range(600):
        a, b = rng.randint(11, 99), rng.randint(11, 99)
        op = rng.choice(("times", "plus", "minus", "percent"))
        q = {
            "times": f"{a} times {b}",
            "plus": f"{a * 7} plus {b * 13}",
            "minus": f"{a * 11} minus {b}",
            "percent": f"{b}% of {a * 20}",
        }[op]
        arith.append(Item((f"number:{q}",), {"question": q}, "generated"))
    units = []
    for small, big, _ in UNITS:
        for n in (2, 3, 5, 7, 12, 20, 40, 100):
            units.append(Item((f"unit:{n} {big}",), {"small": small, "big": f"{n} {big}s"}, "generated"))
    return {"arith": arith, "unit": units}


# ------------------------------------------------------------------------------------------------ kinds


@dataclass(frozen=True)
class Kind:
    """A kind of request: which pool its items come from, its phrasings ({field} from the item; {n} a small count,
    {language} a language, {followup} a follow-up question, all drawn per request), whether it is held out (never
    trained), and for a multi-turn kind the turns before the last request."""

    name: str
    pool: str
    asks: tuple[str, ...]
    held_out: bool = False
    needs: str = ""  # an item field the kind needs (items without it are not used)
    history: tuple[str, str] | None = None  # (user, assistant) turns before the request, multi-turn kinds


_CODE = "```python\n{code}\n```"
KINDS: tuple[Kind, ...] = (
    # ---- training kinds
    Kind(
        "explain",
        "concept",
        (
            "Explain {topic} in simple terms.",
            "What is {topic}?",
            "Can you explain how {topic} works?",
            "I've never understood {topic}. Can you explain it?",
        ),
    ),
    Kind("why", "why", ("{topic}", "{topic} Explain it briefly.")),
    Kind("quiz", "concept", ("Write {n} quiz questions about {topic}, with answers.", "Make a short quiz on {topic}.")),
    Kind(
        "list_facts", "animal", ("List {n} interesting facts about {topic}.", "Tell me some fun facts about {topic}.")
    ),
    Kind("country_facts", "country", ("What is {topic} known for?", "List {n} things to know about {topic}.")),
    Kind(
        "capital",
        "country",
        ("What is the capital of {topic}?", "What language is spoken in {topic}?", "What currency does {topic} use?"),
    ),
    Kind(
        "recipe",
        "food",
        ("Give me a recipe for {topic}.", "How do I make {topic} at home?", "What ingredients do I need for {topic}?"),
    ),
    Kind("howto", "skill", ("How do I {topic}?", "What are the steps to {topic}?", "Can you teach me how to {topic}?")),
    Kind(
        "tips", "skill", ("Give me {n} tips to {topic}.", "What are some common mistakes when people try to {topic}?")
    ),
    Kind(
        "describe_place",
        "place",
        ("Describe {topic} to someone who has never been there.", "What is the best time of year to visit {topic}?"),
    ),
    Kind("trip_plan", "place", ("Plan a one-day trip to {topic}.", "What should I see on a weekend in {topic}?")),
    Kind(
        "story",
        "story",
        (
            "Write a short story about {animal} in {place}.",
            "Tell me a bedtime story about {animal} who visits {place}.",
        ),
    ),
    Kind("poem", "thing", ("Write a short poem about {topic}.", "Write a rhyming poem about {topic}.")),
    Kind("concept_poem", "concept", ("Write a short poem about {topic}.",)),
    Kind(
        "email",
        "situation",
        ("Write an email to {topic}.", "Draft a polite email to {topic}.", "Help me write a short email to {topic}."),
    ),
    Kind("advice", "feeling", ("I feel {topic}. Any advice?", "What can I do? I'm {topic}.")),
    Kind("define", "word", ('What does the word "{topic}" mean?', 'Define "{topic}".')),
    Kind("use_in_sentence", "word", ('Use the word "{topic}" in {n} example sentences.',)),
    Kind("synonyms", "word", ('Give me some synonyms for "{topic}".', 'What is the opposite of "{topic}"?')),
    Kind("job", "job", ("What does {topic} do all day?", "How do I become {topic}?", "What skills does {topic} need?")),
    Kind("acronym", "acronym", ("What does {topic} stand for?", "What is {topic}?")),
    Kind(
        "compare",
        "pair",
        ("Compare {a} and {b}.", "What is the difference between {a} and {b}?", "Which is better, {a} or {b}?"),
    ),
    Kind("arithmetic", "arith", ("What is {question}?", "Calculate {question}.")),
    Kind("units", "unit", ("How many {small} are in {big}?",)),
    Kind(
        "write_function",
        "func",
        ("Write a Python function that does this: {task}", "In Python, how would I implement this myself? {task}"),
    ),
    Kind(
        "stdlib_usage",
        "func",
        (
            "How do I use {qualname} in Python?",
            "Show me an example of {qualname} in Python.",
            "What does {qualname} do in Python?",
        ),
    ),
    Kind(
        "fix_code",
        "source",
        (
            "Find and fix the bug in this Python function:\n" + _CODE,
            "This function doesn't work as expected. What's wrong?\n" + _CODE,
        ),
        needs="buggy",
    ),
    Kind(
        "explain_code",
        "source",
        ("Explain what this Python code does:\n" + _CODE, "Walk me through this function:\n" + _CODE),
    ),
    Kind("docstring", "source", ("Write a docstring for this Python function:\n" + _CODE,)),
    Kind("unit_tests", "source", ("Write unit tests for this function:\n" + _CODE,)),
    Kind(
        "summarize",
        "passage",
        ("Summarize this in one sentence:\n{passage}", "Give me a short summary of this text:\n{passage}"),
    ),
    Kind("summarize_docs", "moddoc", ("Summarize this paragraph from Python's documentation:\n{passage}",)),
    Kind(
        "rewrite",
        "passage",
        ("Rewrite this in plain modern English:\n{passage}", "Make this easier to read:\n{passage}"),
    ),
    Kind("translate", "verse", ("Translate into {language}: {passage}",)),
    Kind("title", "passage", ("Suggest a title for this passage:\n{passage}",)),
    Kind("keywords", "passage", ("Extract the key words from this text:\n{passage}",)),
    Kind("followup_code", "func", ("{followup}",), history=("What does {qualname} do in Python?", "{doc}")),
    Kind("followup_verse", "verse", ("{followup}",), history=("Can you quote {ref}?", "{passage}")),
    # ---- held-out kinds: never trained, asked only on held-out topics (the headline evaluation)
    Kind("eli5", "concept", ("Explain {topic} to a five-year-old.",), held_out=True),
    Kind("pros_cons", "concept", ("What are the pros and cons of {topic}?",), held_out=True),
    Kind("limerick", "animal", ("Write a limerick about {topic}.",), held_out=True),
    Kind("grammar", "verse", ("Fix the grammar and spelling in this text: {garbled}",), held_out=True),
    Kind("product", "thing", ("Write a product description for {topic}.",), held_out=True),
    Kind("text_message", "situation", ("Write a short, friendly text message to {topic}.",), held_out=True),
    Kind("to_javascript", "source", ("Rewrite this Python function in JavaScript:\n" + _CODE,), held_out=True),
    Kind("bullets", "passage", ("Summarize this in three bullet points:\n{passage}",), held_out=True),
    Kind("names", "food", ("Suggest five names for a small restaurant famous for its {topic}.",), held_out=True),
)
FOLLOWUPS = {
    "followup_code": (
        "Can you show me a short example?",
        "What is a common mistake when using it?",
        "Is there an alternative way to do this?",
        "Can you explain that more simply?",
    ),
    "followup_verse": (
        "What does it mean?",
        "Can you put it in simpler words?",
        "Who is speaking here?",
        "Translate it into French.",
        "Why is this verse important?",
    ),
}
LANGUAGES = ("French", "Spanish", "German", "Italian", "Portuguese")


def _garble(text: str, rng: random.Random) -> str:
    """A sentence with a few everyday mistakes: lower-case start, a doubled word, missing apostrophes and commas."""
    words = text.split()
    i = rng.randrange(len(words))
    words.insert(i, words[i])
    out = " ".join(words).replace("'", "").replace(",", "")
    out = out.replace(" their ", " there ", 1).replace(" you're ", " your ", 1)
    return out[:1].lower() + out[1:]


def _pools(topics: dict[str, list[str]], corpus_dir: Path) -> tuple[dict[str, list[Item]], dict[str, Any]]:
    pools: dict[str, list[Item]] = {}
    for pool, items in topics.items():
        if pool == "compare":
            continue
        pools[pool] = [Item((f"{pool}:{t}",), {"topic": t}, "topics") for t in items]
    groups = [[x.strip() for x in line.split(" | ")] for line in topics.get("compare", [])]
    pools["pair"] = [
        Item((f"compare:{a}", f"compare:{b}"), {"a": a, "b": b}, "topics")
        for g in groups
        for i, a in enumerate(g)
        for b in g[i + 1 :]
    ]
    animals, places = topics.get("animal", []), topics.get("place", [])
    pools["story"] = [
        Item((f"animal:{a}", f"place:{p}"), {"animal": a, "place": p}, "topics") for a in animals for p in places
    ]
    py, info = python_items()
    pools.update(py)
    pools.update(bible_items(corpus_dir))
    pools.update(generated_items())
    return pools, info


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def build_general(
    topics_file: Path, corpus_dir: Path, *, held_out_percent: int = 12, per_kind: int = 400, eval_per_kind: int = 24
) -> tuple[dict[str, list[dict]], dict[str, Any]]:
    """({"train", "seen", "unseen"}: chat records, a manifest: counts per split and kind, sources). Records:
    {"id", "kind", "topic" (its split keys joined by " | "), "source", "messages"}; the seen and unseen ones end
    with an assistant turn (the topic: a reference evaluate.py needs, never a target)."""
    if not 0 < held_out_percent < 100:
        raise ValueError(f"held_out_percent={held_out_percent}: between 1 and 99")
    pools, info = _pools(read_topics(topics_file), corpus_dir)
    out: dict[str, list[dict]] = {"train": [], "seen": [], "unseen": []}
    seen_text: set[str] = set()
    dropped = {"duplicate": 0, "mixed_topics": 0}
    for kind in KINDS:
        items = [it for it in pools.get(kind.pool, []) if not kind.needs or kind.needs in it.fields]
        if not items:
            raise ValueError(f"kind {kind.name}: its pool {kind.pool!r} is empty")
        rng = random.Random(f"kind:{kind.name}")
        order = list(range(len(items)))
        rng.shuffle(order)
        counts = {"train": 0, "seen": 0, "unseen": 0}
        for i in order:
            it = items[i]
            held = [held_out_topic(k, held_out_percent) for k in it.keys]
            if any(held) and not all(held):
                dropped["mixed_topics"] += 1
                continue
            split = ("unseen" if kind.held_out else "seen") if all(held) else ("train" if not kind.held_out else None)
            if split is None:  # a held-out kind never asks about a training topic
                continue
            if counts[split] >= (per_kind if split == "train" else eval_per_kind):
                continue
            fields = {
                **it.fields,
                "n": str(rng.choice((3, 5, 7))),
                "language": rng.choice(LANGUAGES),
                "followup": rng.choice(FOLLOWUPS.get(kind.name, ("",))),
            }
            if kind.name == "grammar":
                fields["garbled"] = _garble(it.fields["passage"], rng)
            ask = rng.choice(kind.asks).format(**fields)
            messages = []
            if kind.history:
                messages += [
                    {"role": "user", "content": kind.history[0].format(**fields)},
                    {"role": "assistant", "content": kind.history[1].format(**fields)},
                ]
            messages.append({"role": "user", "content": ask})
            text = _norm(" ".join(m["content"] for m in messages if m["role"] == "user"))
            if text in seen_text:
                dropped["duplicate"] += 1
                continue
            seen_text.add(text)
            topic = " | ".join(it.keys)
            if split != "train":
                messages.append({"role": "assistant", "content": topic})
            out[split].append(
                {
                    "id": f"{split}-{kind.name}-{counts[split]:04d}",
                    "kind": kind.name,
                    "topic": topic,
                    "source": it.source,
                    "messages": messages,
                }
            )
            counts[split] += 1
    manifest = {
        "held_out_percent": held_out_percent,
        "per_kind": per_kind,
        "eval_per_kind": eval_per_kind,
        "counts": {s: len(r) for s, r in out.items()},
        "kinds": {
            s: {k.name: sum(r["kind"] == k.name for r in out[s]) for k in KINDS if (s == "unseen") == k.held_out}
            for s in out
        },
        "dropped": dropped,
        "pools": {p: len(v) for p, v in sorted(pools.items())},
        **info,
    }
    return out, manifest


def kind_balanced(records: list[dict], n: int) -> list[dict]:
    """n records taken round-robin over their kinds (in the order kinds first appear), each kind in its own order:
    a subset of any size that spreads over every kind. All of them when n >= len(records)."""
    by_kind: dict[str, list[dict]] = {}
    for r in records:
        by_kind.setdefault(r["kind"], []).append(r)
    queues = [iter(v) for v in by_kind.values()]
    out: list[dict] = []
    while queues and len(out) < n:
        alive = []
        for q in queues:
            if len(out) >= n:
                break
            r = next(q, None)
            if r is not None:
                out.append(r)
                alive.append(q)
        queues = alive
    return out


def iter_jsonl(records: list[dict]) -> Iterator[str]:
    for r in records:
        yield json.dumps(r, ensure_ascii=False) + "\n"
