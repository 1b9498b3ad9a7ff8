"""Structured outputs: a request's constraint (`Structured`) and the host side that turns it into token masks.

A constraint (a JSON schema, any JSON object, a regex, a choice among strings, or a Lark grammar) is compiled by
llguidance into an `LLMatcher` per request. Each step the host fills every constrained row's allowed-token bitmask
(int32 [rows, ceil(vocab / 32)], llguidance's layout: bit t % 32 of word t // 32) and the jitted sampler sets the
disallowed logits to -inf (`sampling.sample`); after the step, the sampled token advances the row's matcher. A
request ends "stop" once its matcher is stopped (its grammar accepts and nothing may follow, or it took an EOS the
grammar allowed); a grammar that allows no token at some point ends its request with a StructuredOutputError.

`Constrainer` is the engine's compiler: it builds llguidance's tokenizer from the checkpoint's once (lazily: ~1 s at
Qwen's vocabulary), caches each compiled constraint (bounded), and hands each request a fresh copy of it.
"""
from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from copy import copy
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import StructuredOutputError

FIELDS = ("json_schema", "json_object", "regex", "choice", "grammar")
CACHE_SIZE = 256  # compiled constraints kept per engine (each a matcher in its start state; a few KB to MBs)
# Compact JSON: no free whitespace between tokens, so a model cannot spend its max_tokens on spaces and newlines
# (llguidance's default allows any). A schema's own "x-guidance" options override this.
JSON_OPTIONS = {"whitespace_flexible": False}


def llguidance_module() -> Any:
    """llguidance, imported on the first constraint: `import pocketjax` and unconstrained generation work on a
    machine without it (the lent GPU host has none, and no network to fetch it); a constraint then fails with a
    StructuredOutputError that says what to install, not an ImportError from deep inside the engine."""
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 - fill_next_token_bitmask_par
    except ImportError as error:
        raise StructuredOutputError(f"structured outputs need llguidance (pip install 'llguidance>=1.9'): "
                                    f"{error}") from error
    return llguidance


@dataclass(frozen=True)
class Structured:
    """What a request's output must be: exactly one of the fields is set.

    `json_schema` (a dict or its JSON text; kept as compact JSON text so the value is hashable and survives
    `dataclasses.asdict`), `json_object` (any JSON object), `regex` (Rust regex syntax, matched in full),
    `choice` (one of these strings exactly), `grammar` (Lark, in llguidance's dialect, which embeds JSON schemas as
    `%json {...}`). Constructing never raises; `validate` does, and the engine compiles it.
    """

    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, dict):
            try:
                object.__setattr__(self, "json_schema", json.dumps(self.json_schema, ensure_ascii=False,
                                                                   separators=(",", ":")))
            except (TypeError, ValueError):
                pass  # left as given: validate() names it
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def kind(self) -> str | None:
        """The name of the one field that is set (None when none or several are)."""
        set_ = [name for name in FIELDS if getattr(self, name) not in (None, False)]
        return set_[0] if len(set_) == 1 else None

    def validate(self) -> None:
        """Returns None, or raises StructuredOutputError naming what is wrong with the fields' types and shape."""
        def fail(why: str) -> None:
            raise StructuredOutputError(f"SamplingParams.structured: {why}")

        set_ = [name for name in FIELDS if getattr(self, name) not in (None, False)]
        if len(set_) != 1:
            fail(f"exactly one of {', '.join(FIELDS)} must be set, got {set_ or 'none'}")
        if not isinstance(self.json_object, (bool, np.bool_)):
            fail(f"json_object must be a bool, got {self.json_object!r}")
        if self.json_schema is not None:
            if not isinstance(self.json_schema, str):
                fail(f"json_schema must be a JSON object (a dict or its JSON text), got "
                     f"{type(self.json_schema).__name__}")
            try:
                schema = json.loads(self.json_schema)
            except ValueError as error:
                fail(f"json_schema is not valid JSON: {error}")
            if not isinstance(schema, (dict, bool)):
                fail(f"json_schema must be a JSON object, got {type(schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                fail(f"{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, tuple) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                fail(f"choice must be a non-empty list of non-empty strings, got {self.choice!r}")

    def grammar_text(self) -> str:
        """llguidance's grammar for this constraint (compiled by LLMatcher; raises StructuredOutputError when
        llguidance refuses its input outright)."""
        LLMatcher = llguidance_module().LLMatcher
        try:
            if self.json_schema is not None:
                return LLMatcher.grammar_from_json_schema(self.json_schema, defaults=JSON_OPTIONS)
            if self.json_object:
                return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
            if self.regex is not None:
                return LLMatcher.grammar_from_regex(self.regex)
            if self.choice is not None:  # Lark string literals take JSON's escapes
                return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
            return LLMatcher.grammar_from_lark(self.grammar)
        except ValueError as error:
            raise StructuredOutputError(f"SamplingParams.structured.{self.kind}: {error}") from error


def all_allowed(rows: int, vocab_size: int) -> np.ndarray:
    """int32 [rows, ceil(vocab_size / 32)] token masks (`SamplePlan.allowed`) that allow every token."""
    return np.full((rows, (vocab_size + 31) // 32), -1, np.int32)


def as_structured(value: Any) -> Any:
    """`value`, or the Structured a dict of its fields describes (what `dataclasses.asdict` and JSON make of one)."""
    if isinstance(value, dict) and set(value) <= set(FIELDS):
        return Structured(**value)
    return value


def tokenizer_json(tokenizer: Any) -> tuple[str, int]:
    """(the `tokenizers.Tokenizer` JSON, its vocabulary size with added tokens) of a pocketjax Tokenizer (its
    `.backend`) or a `tokenizers.Tokenizer`: what llguidance reads each token's bytes from (as llguidance.hf)."""
    backend = getattr(tokenizer, "backend", tokenizer)
    if not hasattr(backend, "to_str"):
        raise StructuredOutputError(f"the engine's tokenizer must be a pocketjax Tokenizer or a tokenizers.Tokenizer, "
                                    f"got {type(tokenizer).__name__}")
    backend = copy(backend)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str(), backend.get_vocab_size(with_added_tokens=True)


class Constrainer:
    """The engine's structured-output side: compiles constraints (cached) and fills the token masks of a step."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int], cache_size: int = CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(int(t) for t in eos_ids if 0 <= t < vocab_size)
        self.cache_size = cache_size
        self.words = (vocab_size + 31) // 32
        self._ll = None  # llguidance.LLTokenizer, built on first use
        self._llg: Any = None  # the llguidance module, imported with it (the step's masks reuse it)
        self._limit: np.ndarray | None = None  # int32 [words]: bits of the tokenizer's own ids (< its vocab)
        self._compiled: OrderedDict[Structured, Any] = OrderedDict()  # -> LLMatcher in its start state
        self._lock = threading.Lock()  # Engine.validate runs on submitting threads, masks on the loop's
        self._executor = None

    def prepare(self) -> None:
        """Build llguidance's tokenizer now (~1-3 s at Qwen's vocabulary), not at the first constrained request."""
        with self._lock:
            self._ll_tokenizer()

    def _ll_tokenizer(self) -> Any:
        """llguidance's tokenizer, built on first use (under the lock: by `compile` or `prepare`)."""
        if self._ll is None:
            llguidance = self._llg = llguidance_module()
            text, size = tokenizer_json(self.tokenizer)
            try:
                self._ll = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=self.eos_ids or None)
            except Exception as error:  # noqa: BLE001 - llguidance's own error type for a tokenizer it cannot read
                raise StructuredOutputError(f"llguidance cannot read this tokenizer: {error}") from error
            # The model's vocabulary can exceed the tokenizer's (Qwen: 151,936 vs 151,669): ids past the
            # tokenizer's have no text, so a constrained row never takes one.
            ids = np.arange(self.words * 32)
            bits = (ids < min(size, self.vocab_size)).reshape(self.words, 32)
            self._limit = np.packbits(bits, axis=1, bitorder="little").view("<i4").reshape(self.words)
            self._executor = llguidance.LLExecutor()
        return self._ll

    def compile(self, structured: Structured) -> Any:
        """The compiled matcher of `structured` in its start state (cached); StructuredOutputError when it does not
        compile, with llguidance's message."""
        with self._lock:
            if structured in self._compiled:
                self._compiled.move_to_end(structured)
                return self._compiled[structured]
            tokenizer = self._ll_tokenizer()
        # compiled without the lock: a slow grammar (seconds) must not hold up other submitters' cached matchers;
        # two threads compiling one constraint both get a valid matcher
        matcher = self._llg.LLMatcher(tokenizer, structured.grammar_text(), log_level=0)
        if matcher.is_error():
            raise StructuredOutputError(f"SamplingParams.structured.{structured.kind} does not compile: "
                                        f"{matcher.get_error().strip()}")
        with self._lock:
            matcher = self._compiled.setdefault(structured, matcher)
            self._compiled.move_to_end(structured)
            if len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
            return matcher

    def start(self, structured: Structured) -> Any:
        """A fresh matcher for one request (a copy of the compiled one: cheap)."""
        return self.compile(structured).deep_copy()

    def attach(self, req: Any) -> None:
        """Give a constrained request its own matcher now, compiled on the validating thread if the cache lost it.
        Validation runs where the request is submitted; admission validates again under the scheduler's lock and
        finds the matcher on the request, so past CACHE_SIZE distinct constraints (evicted) no compile stalls the
        scheduler thread and every stream it runs."""
        if req.matcher is None:
            req.matcher = self.start(req.sampling.structured)

    def masks(self, rows: Sequence[Any]) -> np.ndarray | None:
        """int32 [len(rows), words] allowed-token masks for a step's rows (requests or None), or None when no row is
        constrained. Rows without a matcher, finished, or None get all ones. A constrained row whose grammar allows
        no token ends its request here with a StructuredOutputError (`req.error`), and gets all ones too: the row
        is then discarded when its step is collected."""
        live = [(i, r) for i, r in enumerate(rows)
                if r is not None and getattr(r, "matcher", None) is not None and not r.finished]
        if not live:
            return None
        out = all_allowed(len(rows), self.vocab_size)
        self._llg.numpy.fill_next_token_bitmask_par(self._executor, [(r.matcher, i) for i, r in live], out)
        for i, r in live:
            out[i] &= self._limit
            if r.matcher.is_error() or not out[i].any():
                if r.matcher.is_accepting() and not r.matcher.is_error():
                    r.finish("stop")  # complete, and no EOS token to say so with
                else:
                    why = r.matcher.get_error() or "no token of the vocabulary is allowed"
                    self.fail(r, f"the grammar cannot continue after {len(r.generated_tokens)} tokens: {why}")
                out[i] = -1  # every bit
        return out

    def advance(self, req: Any, token: int) -> bool:
        """Feed a sampled token to req's matcher; True when that ends the request (grammar stopped: "stop", or an
        error: `req.error`)."""
        if not req.matcher.consume_token(token):
            self.fail(req, f"token {token} was refused by the grammar: {req.matcher.get_error()}")
            return True
        if req.matcher.is_stopped():
            req.finish("stop")
            return True
        return False

    @staticmethod
    def fail(req: Any, why: str) -> None:
        req.error = StructuredOutputError(f"request {req.request_id!r}: {why}")
        req.finish("error")
