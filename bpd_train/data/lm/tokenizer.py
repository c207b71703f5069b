"""Tokenizer of an imported decoder-only LM (Llama, Qwen2, ...): its `tokenizer.json` read with Hugging Face
`tokenizers`, special tokens from `tokenizer_config.json`, and its chat template (`chat_template` there, or
the `chat_template.jinja` file newer transformers write) rendered with jinja2 the way transformers'
`apply_chat_template` renders it (sandboxed, trim_blocks/lstrip_blocks, its tojson / raise_exception /
strftime_now helpers, the special tokens as variables). transformers is not needed.

encode(text) adds the special tokens tokenizer.json's post-processor adds (Llama's BOS; Qwen2 adds none), as
transformers' tokenizer(text) does; chat_ids(messages) renders the template and encodes without adding any
(the template writes them), as apply_chat_template(tokenize=True) does.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Sequence

from bpd_train.data.hf_tokenizer import TokenizerError, read_tokenizer_json, inside  # noqa: F401  (one JSON reader)
from bpd_train.data.hf_tokenizer import tokenizer_folder_hash
from bpd_train.io import sha256_file


def _token_text(v) -> str | None:
    """tokenizer_config.json writes a special token as a string or as an AddedToken dict."""
    if isinstance(v, dict):
        v = v.get("content")
    return str(v) if v is not None else None


def _compile(template: str):
    """The chat template under the environment transformers gives it (chat_template_utils.py)."""
    try:
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise TokenizerError("chat templates need jinja2 (pip install 'jinja2>=3.1.6')") from None

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f))
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as e:
        raise TokenizerError(f"the chat template does not parse (line {e.lineno}: {e.message})") from None


class LMTokenizer:
    """encode/decode, special ids and the chat template of an imported decoder-only LM."""

    kind = "lm-tokenizers"

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError("decoder-only models read tokenizer.json, which needs the 'tokenizers' package "
                                 "(pip install 'bpd-train[hf]')") from None
        self.path = self.folder / "tokenizer.json"
        if not self.path.is_file():
            raise TokenizerError(f"{self.folder} lacks tokenizer.json (decoder-only models are read with the Hugging "
                                 "Face tokenizers file)")
        inside(self.folder, "tokenizer.json")
        try:
            self.tk = Tokenizer.from_file(str(self.path))
        except Exception as e:
            raise TokenizerError(f"{self.path} is not a tokenizers file ({str(e).strip().splitlines()[-1]})") from None
        cfg_path = self.folder / "tokenizer_config.json"
        self.tok_config = read_tokenizer_json(cfg_path) if cfg_path.is_file() else {}
        self.special_tokens = {name: t for name in ("bos_token", "eos_token", "unk_token", "pad_token")
                               if (t := _token_text(self.tok_config.get(name))) is not None}
        ids = {}
        for name, text in self.special_tokens.items():
            i = self.tk.token_to_id(text)
            if i is None:
                raise TokenizerError(f"{self.path} has no {text!r} token ({name} in tokenizer_config.json)")
            ids[name] = i
        self.bos_id, self.eos_id = ids.get("bos_token"), ids.get("eos_token")
        self.pad_id = ids.get("pad_token")
        self.vocab_size = self.tk.get_vocab_size(with_added_tokens=True)
        template = self.tok_config.get("chat_template")
        if isinstance(template, list):  # several named templates: transformers uses "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        jinja_file = self.folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = inside(self.folder, jinja_file.name).read_text(encoding="utf-8")
        self.chat_template: str | None = template
        self._compiled = None
        self.hash = sha256_file(self.path)

    # ---- text <-> ids ----
    def encode(self, text: str | Sequence[str], add_special_tokens: bool = True):
        """Ids of a text (a list of texts gives a list of id lists)."""
        if isinstance(text, (list, tuple)):
            return [e.ids for e in self.tk.encode_batch(list(text), add_special_tokens=add_special_tokens)]
        return list(self.tk.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ---- chats ----
    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        """The chat as text, as transformers' apply_chat_template(tokenize=False) renders it."""
        if self.chat_template is None:
            raise TokenizerError(f"{self.folder} has no chat template (tokenizer_config.json chat_template or "
                                 "chat_template.jinja): give the data as plain prompt/response text instead")
        if self._compiled is None:
            self._compiled = _compile(self.chat_template)
        import jinja2
        import jinja2.ext
        try:
            return self._compiled.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **{**self.special_tokens, **extra})
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the chat template refused this chat: {e}") from None

    def chat_ids(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> list[int]:
        """The chat's ids (the template writes the special tokens, so encoding adds none)."""
        return self.encode(self.render_chat(messages, add_generation_prompt, **extra), add_special_tokens=False)

    # ---- bundles ----
    def files(self) -> list[str]:
        return [str(inside(self.folder, n).name) for n in ("tokenizer.json", "tokenizer_config.json",
                                                           "chat_template.jinja") if (self.folder / n).is_file()]

    def meta(self) -> dict:
        return {"kind": self.kind, "files": self.files(), "vocab_size": self.vocab_size, "bos_id": self.bos_id,
                "eos_id": self.eos_id, "pad_id": self.pad_id, "chat_template": self.has_chat_template}

    def check_model(self, vocab_size: int) -> None:
        """One line when the tokenizer's ids cannot belong to a model with this vocabulary (checkpoints often pad
        the embedding beyond the tokenizer: that is fine)."""
        if self.vocab_size > vocab_size:
            raise TokenizerError(f"tokenizer in {self.folder} has {self.vocab_size} tokens but the checkpoint's "
                                 f"vocabulary has {vocab_size}: the files belong to different models")
        top = max(self.tk.get_vocab(with_added_tokens=True).values(), default=-1)
        if top >= vocab_size:  # an added token with an id past the embedding (a gap the count does not show)
            raise TokenizerError(f"{self.path} has a token with id {top}, but the checkpoint's vocabulary has "
                                 f"{vocab_size} tokens: the file was edited or belongs to another model")


class RunLMTokenizer(LMTokenizer):
    """An LMTokenizer as training runs, checkpoints and bundles record it, like hf_tokenizer.ModelTokenizer for
    imported encoder-decoder models: `path` is the folder (its tokenizer files are copied into run folders and
    bundles), `hash` the one over those files (loading.tokenizer_hash), `meta` what checkpoints store."""

    def __init__(self, folder: str | Path, hash: str | None = None):
        super().__init__(folder)
        self.json_path, self.path = self.path, self.folder
        self.hash = hash or tokenizer_folder_hash(self.folder)
        self.meta = LMTokenizer.meta(self)

    def __reduce__(self):  # datasets' cache keys and DataLoader workers: rebuilt from the folder, hash checked
        return (_rebuild_run_tokenizer, (str(self.folder), self.hash))


def _rebuild_run_tokenizer(folder: str, want: str) -> RunLMTokenizer:
    tok = RunLMTokenizer(folder)
    if tok.hash != want:
        raise TokenizerError(f"{folder} changed since it was loaded (sha256 {tok.hash[:12]} != {want[:12]})")
    return tok
