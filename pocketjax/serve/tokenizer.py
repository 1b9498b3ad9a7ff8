"""Text <-> token ids for HF Qwen checkpoints, the chat template, and the host-side streaming helpers.

Encoding and decoding go through the `tokenizers` library with the checkpoint's own tokenizer.json, and chat
templates render in a Jinja environment built like transformers' (`chat_template.py`), so a prompt built here has
the same ids as one built with transformers — without importing transformers or torch.
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jinja2
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.decoders import DecodeStream

from ..errors import CheckpointError, RequestError
from ..model.checkpoint import contained
from ..model.config import read_json_object
from ..model.hub import resolve_checkpoint
from .chat_template import alias_reasoning, compile_template, plain
from .template_sandbox import DEFAULT_LIMITS, RenderLimitError, RenderLimits, render

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"          # transformers 5 saves the template here
TEMPLATE_DIR = "additional_chat_templates"     # named extra templates, one <name>.jinja each
# The named special tokens transformers passes to every chat template (its SPECIAL_TOKENS_ATTRIBUTES).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT = 5  # prompt ids that streamed text is decoded after (as in vLLM)


class Tokenizer:
    """An HF checkpoint's tokenizer: encode, decode and the chat template, as transformers would do them."""

    def __init__(self, backend: BackendTokenizer, config: Mapping[str, Any] | None = None,
                 chat_templates: Mapping[str, str] | str | None = None, name: str = "tokenizer"):
        self.backend = backend
        self.config = dict(config or {})
        self.name = name
        named = {key: _token_content(self.config.get(key)) for key in NAMED_SPECIAL_TOKENS}
        self.special_tokens: dict[str, str] = {k: v for k, v in named.items() if v is not None}
        self._register_added_tokens()
        if chat_templates is None:
            chat_templates = self.config.get("chat_template")
        self.chat_templates = _template_dict(chat_templates)
        self.render_limits: RenderLimits = DEFAULT_LIMITS  # time and size bounds of every template render
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.eos_token_id = self.token_id(self.special_tokens.get("eos_token"))
        self.pad_token_id = self.token_id(self.special_tokens.get("pad_token"))
        self.bos_token_id = self.token_id(self.special_tokens.get("bos_token"))
        self.special_token_ids: set[int] = {
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        }

    @classmethod
    def from_folder(cls, path: str | os.PathLike, *, revision: str | None = None,
                    local_files_only: bool = False) -> Tokenizer:
        """Load tokenizer.json, tokenizer_config.json and any chat_template.jinja from an HF checkpoint folder.

        `path` may be a Hub repo id ("Qwen/Qwen3-0.6B", at `revision`): only the tokenizer files are downloaded.
        """
        folder = resolve_checkpoint(path, revision, local_files_only,
                                    files=(TOKENIZER_FILE, CONFIG_FILE, TEMPLATE_FILE, f"{TEMPLATE_DIR}/*.jinja"))
        tokenizer_file = folder / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise CheckpointError(f"{tokenizer_file} is missing: pocketjax needs the fast tokenizer file")
        try:
            backend = BackendTokenizer.from_file(str(contained(folder, TOKENIZER_FILE)))
        except CheckpointError:
            raise
        except Exception as err:  # tokenizers raises plain Exception for bad JSON or unknown components
            raise CheckpointError(f"{tokenizer_file} is corrupt or unsupported: {err}") from err
        config = {}
        config_file = folder / CONFIG_FILE
        if config_file.is_file():
            config = read_json_object(contained(folder, CONFIG_FILE), CheckpointError)
        # Like transformers: template files, when present, replace the templates in tokenizer_config.json.
        templates = {}
        try:
            if (folder / TEMPLATE_FILE).is_file():
                templates["default"] = contained(folder, TEMPLATE_FILE).read_text(encoding="utf-8")
            if (folder / TEMPLATE_DIR).is_dir():
                for file in sorted((folder / TEMPLATE_DIR).glob("*.jinja")):
                    name = f"{TEMPLATE_DIR}/{file.name}"
                    templates[file.name.removesuffix(".jinja")] = contained(folder, name).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise CheckpointError(f"a chat template file of {folder} cannot be read: {err}") from err
        try:
            return cls(backend, config, templates or None, name=str(folder))
        except (TypeError, KeyError, ValueError, AttributeError) as err:  # a field of the wrong shape
            raise CheckpointError(f"{config_file} has a malformed field: {type(err).__name__}: {err}"[:500]) from err

    def _register_added_tokens(self) -> None:
        """Add what transformers adds on load: tokenizer_config's added_tokens_decoder and named special tokens.

        For a consistent checkpoint these are already in tokenizer.json and this changes nothing; when the
        config declares more, transformers matches and skips them, so we must too.
        """
        present = {tok.content for tok in self.backend.get_added_tokens_decoder().values()}
        decoder = self.config.get("added_tokens_decoder") or {}
        for _, entry in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            if entry.get("content") in present:
                continue
            token = AddedToken(entry["content"], single_word=entry.get("single_word", False),
                               lstrip=entry.get("lstrip", False), rstrip=entry.get("rstrip", False),
                               normalized=entry.get("normalized", not entry.get("special", False)),
                               special=entry.get("special", False))
            self.backend.add_tokens([token])
            present.add(token.content)
        # v4 configs list extra specials as additional_special_tokens, transformers 5 as extra_special_tokens.
        extra = []
        for key in ("additional_special_tokens", "extra_special_tokens"):
            tokens = self.config.get(key) or []
            extra += [_token_content(t) for t in (tokens.values() if isinstance(tokens, dict) else tokens)]
        named = [t for t in dict.fromkeys([*self.special_tokens.values(), *extra]) if t and t not in present]
        if named:
            self.backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in named])

    def token_id(self, token: str | None) -> int | None:
        """The id of one token string, or None when it is not in the vocabulary."""
        return None if token is None else self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; special-token text such as "<|im_end|>" becomes its single special id."""
        if not isinstance(text, str):
            raise RequestError(f"text to encode must be str, got {type(text).__name__}")
        try:
            return self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as error:  # noqa: BLE001 - the Rust binding raises plain Exception/TypeError (a lone surrogate)
            raise RequestError(f"text cannot be encoded: {error}") from error

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 sequences become U+FFFD, as in transformers."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def get_chat_template(self, chat_template: str | None = None, tools: Sequence | None = None) -> str:
        """The template source to render: a named template, the literal `chat_template`, or the default."""
        if chat_template is not None and chat_template in self.chat_templates:
            return self.chat_templates[chat_template]
        if chat_template is not None:
            return chat_template
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if self.chat_templates:
            raise RequestError(f"{self.name} has several chat templates and no default; pass chat_template= "
                               f"one of {sorted(self.chat_templates)}")
        raise RequestError(f"{self.name} has no chat template (tokenizer_config.json 'chat_template' or "
                           f"{TEMPLATE_FILE}); pass chat_template= or use a plain prompt")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, *, chat_template: str | None = None,
                            continue_final_message: bool = False, documents: Sequence[Mapping] | None = None,
                            **kwargs: Any) -> str:
        """The prompt text for `messages`, rendered exactly as transformers' apply_chat_template(tokenize=False).

        Extra keyword arguments become template variables (e.g. `enable_thinking=False` for Qwen3) and
        override the named special tokens, as in transformers. Rendering is bounded by `self.render_limits`
        (time, output and intermediate sizes: `template_sandbox`); past them, or for any error the template raises,
        a RequestError.
        """
        if continue_final_message and add_generation_prompt:
            raise RequestError("continue_final_message and add_generation_prompt are mutually exclusive")
        if not messages:
            raise RequestError("cannot apply a chat template to an empty conversation")
        for i, m in enumerate(messages):
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not m["role"]:
                raise RequestError(f"chat message {i} must be a dict with a 'role' string, got {m!r:.80}")
            content = m.get("content")
            if not (content is None or isinstance(content, str)
                    or (isinstance(content, Sequence) and all(isinstance(p, Mapping) for p in content))):
                raise RequestError(f"chat message {i}: 'content' must be a string, a list of content parts (dicts) "
                                   f"or None, got {type(content).__name__}")
        if tools is not None and any(not isinstance(t, Mapping) for t in tools):
            raise RequestError("tools must be JSON-schema dicts")
        source = self.get_chat_template(chat_template, tools)
        template = compile_template(source, self.name)
        tag = "CONTINUE_FINAL_MESSAGE_TAG "
        final = None
        try:
            # transformers drops None-valued keys (OpenAI-style content=None) and rebuilds inputs from plain types.
            chat = [{k: plain(v) for k, v in m.items() if v is not None} for m in messages]
            chat = [alias_reasoning(m) for m in chat]
            variables = {**self.special_tokens, **plain(kwargs)}
            if continue_final_message:
                final = chat[-1].get("content")
                if not isinstance(final, str):
                    raise RequestError("continue_final_message needs a final message with string content")
                chat[-1]["content"] = final + tag
            text = render(template, dict(messages=chat, tools=plain(tools), documents=plain(documents),
                                         add_generation_prompt=add_generation_prompt, **variables),
                          self.render_limits)
        except RequestError:
            raise
        except jinja2.TemplateError as err:
            raise RequestError(f"chat template rejected the conversation: {err}") from err
        except RenderLimitError as err:
            raise RequestError(f"chat template stopped: {err}") from None
        except RecursionError:
            raise RequestError("chat template or conversation nests too deeply") from None
        except Exception as err:  # noqa: BLE001 - whatever the template's code raises (1/0, a bad filter argument)
            raise RequestError(f"chat template failed on this conversation: {type(err).__name__}: {err}") from err
        if final is not None:
            if final.strip() not in text or tag.strip() not in text:
                raise RequestError("continue_final_message: the template dropped the final message")
            at = text.rindex(tag.strip())
            text = text[:at] if text[at:at + len(tag)] == tag else text[:at].rstrip()
        return text


def _token_content(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or a serialized AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is not None and not isinstance(value, str):
        raise TypeError(f"a special token must be a string or an AddedToken object, got {value!r:.80}")
    return value


def _template_dict(templates: Mapping[str, str] | Sequence[Mapping[str, str]] | str | None) -> dict[str, str]:
    """Every template by name: one string is "default", a list of {name, template} is by name (HF format)."""
    if templates is None:
        return {}
    if isinstance(templates, str):
        return {"default": templates}
    found = dict(templates) if isinstance(templates, Mapping) else {t["name"]: t["template"] for t in templates}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in found.items()):
        raise TypeError("chat_template must be a string, or named templates that are strings")
    return found


class IncrementalDetokenizer:
    """Streams generated ids to text in whole characters: `tokenizers`' DecodeStream, plus `flush()`.

    Byte-level BPE splits multibyte characters across tokens; DecodeStream holds such tokens back until the
    character is complete (the two-window decoding vLLM does). Its prompt context (`ids=`) keeps the leading
    space that SentencePiece-style decoders strip from a text's first token: " world" after "Hello".
    Own code covers what DecodeStream lacks:
    - it has no flush and does not show the ids it holds, so we keep the ids since its last piece and decode
      them after that piece's ids (bytes that never formed a character become U+FFFD, as in `decode`);
    - given a prompt that ends inside a character, its first piece would repeat the prompt's text (its prefix
      stays "" while the context decodes to a trailing U+FFFD), so the context ends at the last whole character.
    For byte-level tokenizers (every Qwen checkpoint) "".join(pieces) + flush() == tokenizer.decode(generated
    ids), for any prompt. It differs where context changes the text (the SentencePiece space above), and with
    ByteFallback tokenizers, where an invalid byte run turns already streamed text into U+FFFD: there
    DecodeStream raises rather than stream text that `decode` would not give.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = [int(i) for i in prompt_ids[-PROMPT_CONTEXT:]]
        while context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context.pop()
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._last = context          # the ids of the last piece: held ids decode after them
        self._held: list[int] = []    # ids DecodeStream has not turned into text yet
        self._text: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._text)

    def add(self, token_id: int) -> str:
        """Feed one generated id; returns the newly completed text (often "" while a character is split)."""
        self._held.append(int(token_id))
        piece = self._stream.step(self.tokenizer.backend, self._held[-1])
        if piece is None:
            return ""
        self._last, self._held = self._held, []
        self._text.append(piece)
        return piece

    def flush(self) -> str:
        """At the end of generation: whatever was held back (bytes that never formed a character, as U+FFFD)."""
        if not self._held:
            return ""
        piece = self._decode(self._last + self._held)[len(self._decode(self._last)):]
        self._held = []
        self._text.append(piece)
        return piece

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


class StopStringMatcher:
    """Host-side stop strings over streamed text, with OpenAI/vLLM semantics.

    Text is emitted up to (not including) the first stop string, even one spanning several pieces. A tail
    that could still grow into a stop string is held back until it cannot, or until `flush()`.
    """

    def __init__(self, stop: Iterable[str]):
        self.stop = tuple(stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise RequestError("stop strings must be non-empty strings")
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def add(self, piece: str) -> str:
        """Feed the next piece of text; returns what is safe to emit now ("" once stopped)."""
        if self.stopped:
            return ""
        buffer = self._held + piece
        # The stop string that ends first wins (then the one starting first): that is where a token-by-token
        # generator would stop, so the result does not depend on how the text was cut into pieces.
        hits = [(at + len(s), at, s) for s in self.stop if (at := buffer.find(s)) >= 0]
        if hits:
            _, at, self.matched = min(hits)
            self.stopped, self._held = True, ""
            return buffer[:at]
        keep = self._partial_len(buffer)
        self._held = buffer[len(buffer) - keep:]
        return buffer[:len(buffer) - keep]

    def flush(self) -> str:
        """At the end of the stream: the held-back tail, which no longer can become a stop string."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held

    def _partial_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            # candidate suffixes start where text holds s[0]: a find per candidate, not a comparison per length
            at = text.find(s[0], max(len(text) - len(s) + 1, 0))
            while 0 <= at and len(text) - at > best:
                if s.startswith(text[at:]):
                    best = len(text) - at
                    break
                at = text.find(s[0], at + 1)
        return best
