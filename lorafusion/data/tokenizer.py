"""Tokenizers: byte-level (built in), a HF tokenizer directory (``tokenizer.json``), or sentencepiece.

All share one small interface (:class:`Tokenizer`): ``encode(text)`` (no special tokens added),
``decode(ids)``, ``eos_id``, ``bos_id`` (``None`` when the tokenizer has none), ``pad_id``,
``vocab_size`` and ``apply_chat(messages) -> (prompt_ids, response_ids)``.

Chat rendering. The last message must be the assistant's; it is the response, everything before it is
the prompt. A HF tokenizer whose ``tokenizer_config.json`` has a ``chat_template`` renders with it
(jinja2, as transformers does: the prompt is the history rendered with ``add_generation_prompt=True``,
the response is what the full conversation adds after that, so end-of-turn markers are trained). All
other tokenizers use the built-in template :data:`SIMPLE_CHAT_TEMPLATE`::

    <role>: <content>\\n        for every message before the last
    assistant:                  (the generation prompt; one space after the colon)
    <last assistant content>    (the response)

``bos``/``eos`` are added by the sample builder (:mod:`lorafusion.data.dataset`), not here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from lorafusion.core.errors import ConfigError

__all__ = [
    "SIMPLE_CHAT_TEMPLATE",
    "ByteTokenizer",
    "HFTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "TokenizerError",
    "build_tokenizer",
    "render_simple_chat",
    "simple_chat_jinja",
]

# the built-in chat template: one line per history message, then the generation prompt
SIMPLE_CHAT_TEMPLATE = {"message": "{role}: {content}\n", "generation_prompt": "assistant: "}


def simple_chat_jinja(with_bos: bool) -> str:
    """The built-in template as a transformers ``chat_template``: a conversation ending in an assistant
    message renders as training's sample text (``[bos] prompt response eos``), a history with
    ``add_generation_prompt`` as its prompt."""
    return ("{{ bos_token }}" if with_bos else "") + (
        "{% for message in messages %}{% if loop.last and message['role'] == 'assistant' %}"
        "assistant: {{ message['content'] }}{{ eos_token }}"
        "{% else %}{{ message['role'] }}: {{ message['content'] }}\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}")


class TokenizerError(ConfigError):
    """A tokenizer could not be built or used (the message names the file)."""


def _check_messages(messages) -> list[dict]:
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError(f"expected a non-empty list of messages, got {messages!r:.80}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {i}: expected a mapping with 'role' and 'content', got {m!r:.80}")
        for key in ("role", "content"):
            if key not in m or m[key] is None:
                raise ValueError(f"message {i}: missing field {key!r}")
            if not isinstance(m[key], str):
                raise ValueError(f"message {i}: field {key!r}: expected a string, got {m[key]!r:.80}")
    if messages[-1]["role"] != "assistant":
        raise ValueError(f"the last message must have role 'assistant' (it is the response), "
                         f"got role {messages[-1]['role']!r}")
    return list(messages)


def render_simple_chat(messages: Sequence[dict]) -> tuple[str, str]:
    """(prompt text, response text) with the built-in template (see the module docstring)."""
    msgs = _check_messages(messages)
    t = SIMPLE_CHAT_TEMPLATE
    prompt = "".join(t["message"].format(role=m["role"], content=m["content"]) for m in msgs[:-1])
    prompt += t["generation_prompt"]
    return prompt, msgs[-1]["content"]


class Tokenizer:
    """Base class. Subclasses set ``eos_id``, ``bos_id``, ``pad_id``, ``vocab_size`` and ``name``."""

    name: str = "tokenizer"
    eos_id: int
    bos_id: int | None = None
    pad_id: int | None = None
    vocab_size: int

    def encode(self, text: str) -> list[int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def render_chat(self, messages: Sequence[dict]) -> tuple[str, str]:
        return render_simple_chat(messages)

    def apply_chat(self, messages: Sequence[dict]) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids) of a conversation whose last message is the assistant's."""
        prompt, response = self.render_chat(messages)
        return self.encode(prompt), self.encode(response)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, vocab_size={self.vocab_size}, eos={self.eos_id}, " \
               f"bos={self.bos_id})"


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes: ids 0–255 are bytes, 256 = bos, 257 = eos, 258 = pad; vocab_size 259."""

    name = "byte"
    BOS, EOS, PAD = 256, 257, 258

    def __init__(self) -> None:
        self.bos_id, self.eos_id, self.pad_id, self.vocab_size = self.BOS, self.EOS, self.PAD, 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")


def _token_content(tok) -> str | None:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...} mappings."""
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tok if isinstance(tok, str) else None


class HFTokenizer(Tokenizer):
    """A HF tokenizer directory: ``tokenizer.json`` (+ ``tokenizer_config.json`` for eos/bos/pad and the
    chat template when present). Needs the ``tokenizers`` package (imported here, lazily)."""

    _EOS_GUESSES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "[SEP]")

    def __init__(self, directory: str | Path) -> None:
        d = Path(directory)
        self.name = str(d)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(f"{d}: expected a HF tokenizer directory with tokenizer.json (not found)")
        try:
            from tokenizers import Tokenizer as _HFTok
        except ImportError:
            raise TokenizerError(f"{d}: loading a HF tokenizer needs the `tokenizers` package "
                                 f"(pip install tokenizers)") from None
        try:
            self._tok = _HFTok.from_file(str(tj))
        except Exception as e:  # noqa: BLE001 - the Rust error type is not importable
            raise TokenizerError(f"{tj}: cannot load tokenizer ({e})") from None
        cfg: dict = {}
        tc = d / "tokenizer_config.json"
        if tc.is_file():
            try:
                cfg = json.loads(tc.read_text(encoding="utf-8"))
            except (OSError, ValueError) as e:
                raise TokenizerError(f"{tc}: cannot read ({e})") from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token = _token_content(cfg.get("eos_token"))
        if self.eos_token is None:
            self.eos_token = next(
                (t for t in self._EOS_GUESSES if self._tok.token_to_id(t) is not None), None)
        if self.eos_token is None or self._tok.token_to_id(self.eos_token) is None:
            raise TokenizerError(f"{tc}: eos_token: expected an end-of-sequence token that is in the "
                                 f"vocabulary, got {self.eos_token!r}")
        self.eos_id = self._tok.token_to_id(self.eos_token)
        self.bos_token = _token_content(cfg.get("bos_token"))
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        if cfg.get("add_bos_token") is False:
            self.bos_id = None
        pad = _token_content(cfg.get("pad_token"))
        self.pad_id = self._tok.token_to_id(pad) if pad else None
        tmpl = cfg.get("chat_template")
        if isinstance(tmpl, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in tmpl if isinstance(t, dict)}
            tmpl = named.get("default") or next(iter(named.values()), None)
        self.chat_template: str | None = tmpl if isinstance(tmpl, str) else None

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def render_chat(self, messages: Sequence[dict]) -> tuple[str, str]:
        if self.chat_template is None:
            return render_simple_chat(messages)
        msgs = _check_messages(messages)
        template = _compile_jinja(self.chat_template, self.name)
        kw = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or ""}
        full = template.render(messages=msgs, add_generation_prompt=False, **kw)
        prompt = template.render(messages=msgs[:-1], add_generation_prompt=True, **kw)
        if not full.startswith(prompt):
            raise ValueError("the chat template renders the history differently with and without the last "
                             "assistant message; cannot split prompt from response")
        return prompt, full[len(prompt):]


def _compile_jinja(source: str, where: str):
    try:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise TokenizerError(f"{where}: rendering the tokenizer's chat_template needs `jinja2`") from None

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise TokenizerError(f"{where}: chat_template is not a valid jinja2 template ({e})") from None


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece model file (or a directory holding ``tokenizer.model``)."""

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        if p.is_dir():
            p = p / "tokenizer.model"
        self.name = str(p)
        if not p.is_file():
            raise TokenizerError(f"{p}: sentencepiece model file not found")
        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_file=str(p))
        except Exception as e:  # noqa: BLE001 - sentencepiece raises RuntimeError/OSError
            raise TokenizerError(f"{p}: cannot load sentencepiece model ({e})") from None
        self.vocab_size = int(self._sp.get_piece_size())
        if self._sp.eos_id() < 0:
            raise TokenizerError(f"{p}: the sentencepiece model has no eos piece (train it with eos_id >= 0)")
        self.eos_id = int(self._sp.eos_id())
        self.bos_id = int(self._sp.bos_id()) if self._sp.bos_id() >= 0 else None
        self.pad_id = int(self._sp.pad_id()) if self._sp.pad_id() >= 0 else None

    def encode(self, text: str) -> list[int]:
        return list(self._sp.encode(text, out_type=int))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def build_tokenizer(cfg, model_path: str | None = None) -> Tokenizer:
    """Tokenizer from a :class:`lorafusion.config.TokenizerConfig` (``hf`` without a path uses
    ``model_path``, the HF model directory)."""
    if cfg.type == "byte":
        return ByteTokenizer()
    if cfg.type == "hf":
        d = cfg.path or model_path
        if d is None:
            raise TokenizerError("tokenizer.path: expected a HF tokenizer directory (model.path is not set)")
        return HFTokenizer(d)
    if cfg.type == "sentencepiece":
        if cfg.path is None:
            raise TokenizerError("tokenizer.path: expected a sentencepiece model file")
        return SentencePieceTokenizer(cfg.path)
    raise TokenizerError(f"tokenizer.type: expected byte, hf or sentencepiece, got {cfg.type!r}")
