"""What a request asks of the sampler: `SamplingParams`, its limits and its validation, apart from the jitted
sampler (`sampling.py`) because most of the code that builds requests needs only this."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import ConfigError, SamplingError
from .structured import Structured, as_structured

MAX_LOGPROBS = 20  # most top-n logprobs a request may ask for (OpenAI's limit)
GREEDY_EPS = 1e-5  # temperatures below this are greedy (as in vLLM): logits / 1e-30 would overflow
PENALTY_RANGE = 2.0  # presence/frequency penalties live in [-2, 2] (OpenAI)
MAX_STOP_STRINGS = 64  # stop strings per request: each is matched on the host after every token (OpenAI allows 4)
MAX_STOP_CHARS = 4096  # their total length: the matcher's work per token grows with it
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 300  # logit_bias entries per request: the sampler's bias arrays have this fixed width (one program)
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: a bias lies in [-100, 100]
MAX_BAD_WORDS = 256  # bad words per request: each is matched against the output on the host before every token
INT32_MAX = 2**31 - 1  # top_k is packed as int32
FLOAT32_MAX = float(np.finfo(np.float32).max)  # float fields are packed as float32
# vLLM's `logprobs_mode` names: raw = the model's logits before any processing; processed = the distribution the
# token is drawn from; *_logits report the logit values instead of their log_softmax. The default is vLLM's.
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
DEFAULT_LOGPROBS_MODE = "raw_logprobs"


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, (bool, np.bool_))


def _is_f32(value: object) -> bool:
    """A real number that float32 holds as a finite value (a Python int past float's range is not one)."""
    if not _is_real(value):
        return False
    try:
        number = float(value)
    except OverflowError:
        return False
    return math.isfinite(number) and abs(number) <= FLOAT32_MAX


def _as_tuple(value: object) -> object:
    """Lists become tuples and a lone value a 1-tuple, so params stay hashable; anything else is left for validate()."""
    if isinstance(value, (str, int, np.integer)):
        return (value,)
    if isinstance(value, (list, tuple, range, np.ndarray)):
        return tuple(value)
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. Constructing never raises; the engine calls `validate(vocab_size)`."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int = 0
    prompt_logprobs: int | None = None  # None: off; k: each prompt token's logprob and its top-k (from prefill)
    # A pure jnp `fn(layer, hidden [B, T, H]) -> hidden` applied to this request's residual stream after each layer,
    # in prefill and decode (`pj.logits(hook=)`'s contract), acting on each row and position on its own (it sees the
    # whole batch, chunk by chunk). Hashed by identity: each new one compiles new engine programs (`steps.row_hooks`).
    # Python API only: the server never sets it.
    hook: Callable[[Any, Any], Any] | None = None
    # Steering vectors as data: {layer: vector [hidden]} added to this request's residual stream after that layer
    # (where a hook sees it, after the hook), in prefill and decode. Unlike a hook, any vectors run the same
    # programs (`Engine.warmup(steering=True)` compiles them). Kept as sorted (layer, floats) pairs; scale a vector
    # yourself to steer harder.
    steer: Any = None
    # Activations from generation: for each generated token, the residual stream at the position whose logits gave
    # it (after the embedding = 0, after layer i = i + 1: `pj.logits(return_hidden=True)`'s indices) at these
    # indices, in `Completion.hidden` [tokens, len(return_hidden), hidden] float32. Prompt positions: pj.logits.
    return_hidden: tuple[int, ...] = ()
    # What the output must match (a JSON schema, JSON object, regex, choice or grammar: `structured.Structured`);
    # the sampler only draws tokens it allows (the reported logprobs follow the engine's `logprobs_mode`: raw by
    # default, the constrained distribution under "processed_*").
    structured: Structured | None = None
    # vLLM's extras. EOS and stop_token_ids cannot be sampled, and stop strings are not looked for, before the
    # min_tokens-th token.
    min_tokens: int = 0
    # token id -> bias added to its logit before sampling (OpenAI's logit_bias; a dict is kept as sorted pairs)
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be sampled (None: every token)
    # words the output never contains (vLLM's rule: a word of several tokens bans its last token while the output
    # ends with the others); tokenized by the engine's tokenizer, with and without a leading space
    bad_words: tuple[str, ...] = ()
    skip_special_tokens: bool = True  # text only: special tokens are left out of the decoded text
    include_stop_str_in_output: bool = False  # text only: the stop string that ended the text is kept

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", _as_tuple(self.stop))
        object.__setattr__(self, "bad_words", _as_tuple(self.bad_words))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _as_tuple(self.allowed_token_ids))
        if isinstance(self.logit_bias, dict):
            try:
                object.__setattr__(self, "logit_bias", tuple(sorted(self.logit_bias.items())))
            except TypeError:
                pass  # mixed key types: validate() names it
        elif isinstance(self.logit_bias, list):
            object.__setattr__(self, "logit_bias", tuple(tuple(pair) if isinstance(pair, list) else pair
                                                         for pair in self.logit_bias))
        hidden = self.return_hidden
        object.__setattr__(self, "return_hidden", _as_tuple(hidden) if hidden is not None else ())
        object.__setattr__(self, "structured", as_structured(self.structured))  # a dict: dataclasses.asdict's form
        if isinstance(self.steer, dict):
            try:
                object.__setattr__(self, "steer", tuple(sorted(
                    (layer, tuple(float(x) for x in np.asarray(v, np.float32).reshape(-1)))
                    for layer, v in self.steer.items())))
            except (TypeError, ValueError):
                pass  # validate() names it
        elif isinstance(self.steer, list):  # dataclasses.asdict's form (lockstep) of the pairs
            object.__setattr__(self, "steer", tuple((p[0], tuple(p[1])) if isinstance(p, (list, tuple)) and len(p) == 2
                                                    else p for p in self.steer))

    @property
    def cache_tag(self) -> Any:
        """What the K/V this request writes depend on besides its tokens (a slot's cached prefix serves only
        requests with the same tag): its hook and steering."""
        return self.hook if not self.steer else (self.hook, self.steer)

    @property
    def limited(self) -> bool:
        """True when the sampler needs this request's token masks or biases (`processors.TokenLimits`)."""
        return bool(self.min_tokens or self.logit_bias or self.allowed_token_ids is not None or self.bad_words)

    @property
    def greedy(self) -> bool:
        """True when the row takes the argmax: the sampler then ignores seed, top_p and min_p."""
        return self.temperature < GREEDY_EPS or self.top_k == 1

    def validate(self, vocab_size: int | None = None) -> None:
        """Returns None, or raises SamplingError naming the first field outside its documented range."""

        def fail(name: str, why: str) -> None:
            raise SamplingError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            fail("max_tokens", "must be an int >= 1")
        if not _is_f32(self.temperature) or self.temperature < 0:
            fail("temperature", "must be a finite number >= 0 (0 means greedy) that float32 holds")
        if not _is_int(self.top_k) or not 0 <= self.top_k <= INT32_MAX:
            fail("top_k", f"must be an int in [0, {INT32_MAX}] (0 means off)")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0 or np.float32(self.top_p) <= 0:
            fail("top_p", "must be in (0, 1] (and above 0 in float32)")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail("min_p", "must be in [0, 1]")
        rp = self.repetition_penalty
        if not _is_f32(rp) or rp <= 0 or np.float32(rp) <= 0:
            fail("repetition_penalty", "must be a finite number > 0 (1 means off) that float32 holds")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                fail(name, f"must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**32):
            fail("seed", "must be None or an int in [0, 2**32)")
        ids = self.stop_token_ids
        if not isinstance(ids, tuple) or not all(_is_int(t) and t >= 0 for t in ids):
            fail("stop_token_ids", "must be a sequence of ints >= 0")
        if len(ids) > MAX_STOP_TOKEN_IDS:
            fail("stop_token_ids", f"must hold at most {MAX_STOP_TOKEN_IDS} ids")
        if vocab_size is not None and any(t >= vocab_size for t in ids):
            fail("stop_token_ids", f"must be < vocab_size {vocab_size}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            fail("stop", "must be a sequence of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS or sum(map(len, self.stop)) > MAX_STOP_CHARS:
            raise SamplingError(f"SamplingParams.stop must hold at most {MAX_STOP_STRINGS} strings of "
                                f"{MAX_STOP_CHARS} characters in all, got {len(self.stop)} of "
                                f"{sum(map(len, self.stop))}")
        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            fail("ignore_eos", "must be a bool")
        if not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS:
            fail("logprobs", f"must be an int in [0, {MAX_LOGPROBS}]")
        k = self.prompt_logprobs
        if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
            fail("prompt_logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
        if self.hook is not None and not callable(self.hook):
            fail("hook", "must be None or a function (layer, hidden) -> hidden")
        try:
            hash(self.hook)  # a static argument of the jitted steps
        except TypeError:
            fail("hook", "must be hashable (a function, or a frozen callable object)")
        steer = self.steer
        if steer is not None and not (isinstance(steer, tuple) and all(
                isinstance(p, tuple) and len(p) == 2 and _is_int(p[0]) and p[0] >= 0 and isinstance(p[1], tuple)
                and all(_is_f32(x) for x in p[1]) for p in steer)):
            fail("steer", "must be None or a dict {layer (int >= 0): vector of finite floats}")
        if not isinstance(self.return_hidden, tuple) or not all(_is_int(i) and i >= 0 for i in self.return_hidden):
            fail("return_hidden", "must be a sequence of layer indices >= 0 (0: the embedding output)")
        self._validate_limits(vocab_size)
        for name in ("skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                fail(name, "must be a bool")
        if self.structured is not None:
            if not isinstance(self.structured, Structured):
                fail("structured", "must be None or a pocketjax.Structured")
            self.structured.validate()


    def _validate_limits(self, vocab_size: int | None) -> None:
        """SamplingError naming the first of min_tokens, logit_bias, allowed_token_ids, bad_words that is wrong."""

        def fail(name: str, why: str) -> None:
            raise SamplingError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r:.200}")

        def ids_ok(ids: object) -> bool:
            return all(_is_int(t) and 0 <= t < (vocab_size or INT32_MAX) for t in ids)

        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            fail("min_tokens", "must be an int in [0, max_tokens]")
        bias = self.logit_bias
        if (not isinstance(bias, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in bias)
                or not ids_ok(t for t, _ in bias)):
            fail("logit_bias", "must map token ids in the vocabulary to biases")
        if not all(_is_real(b) and -LOGIT_BIAS_RANGE <= b <= LOGIT_BIAS_RANGE for _, b in bias):
            fail("logit_bias", f"biases must be numbers in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]")
        if len(bias) > MAX_LOGIT_BIAS or len({int(t) for t, _ in bias}) != len(bias):
            fail("logit_bias", f"must hold at most {MAX_LOGIT_BIAS} distinct token ids")
        allowed = self.allowed_token_ids
        if allowed is not None and (not isinstance(allowed, tuple) or not allowed or not ids_ok(allowed)):
            fail("allowed_token_ids", "must be None or a non-empty list of token ids in the vocabulary")
        words = self.bad_words
        if not isinstance(words, tuple) or not all(isinstance(w, str) and w.strip() for w in words):
            fail("bad_words", "must be a list of non-blank strings")
        if len(words) > MAX_BAD_WORDS or sum(map(len, words)) > MAX_STOP_CHARS:
            fail("bad_words", f"must hold at most {MAX_BAD_WORDS} words of {MAX_STOP_CHARS} characters in all")


def check_logprobs_mode(mode: object) -> str:
    """Returns `mode` if it is one of LOGPROBS_MODES, else raises ConfigError naming the field and the modes."""
    if not isinstance(mode, str) or mode not in LOGPROBS_MODES:
        raise ConfigError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {mode!r}")
    return mode
