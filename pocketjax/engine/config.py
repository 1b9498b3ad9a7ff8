"""EngineConfig: how an Engine sizes its cache and its compiled shapes, from arguments or the environment.

The one place that reads POCKETJAX_* variables (a deployment or notebook host sizes the engine without code
changes): each fills a field the caller did not pass; an explicit argument always wins.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
import json
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import jax
from jax.experimental.compilation_cache import compilation_cache

from ..errors import ConfigError
from ..model.kv_cache import check_kv_dtype
from ..model.layers import ATTENTION_IMPLS
from .sampling_params import DEFAULT_LOGPROBS_MODE, check_logprobs_mode

ENVIRONMENT = {  # field -> variable
    "max_batch_size": "POCKETJAX_MAX_BATCH_SIZE",
    "max_seq_len": "POCKETJAX_MAX_SEQ_LEN",
    "prefill_chunk": "POCKETJAX_PREFILL_CHUNK",
    "attention_impl": "POCKETJAX_ATTENTION_IMPL",
    "kv_dtype": "POCKETJAX_KV_DTYPE",
    "compile_cache_dir": "POCKETJAX_COMPILE_CACHE_DIR",
    "batch_invariant": "POCKETJAX_BATCH_INVARIANT",
    "logprobs_mode": "POCKETJAX_LOGPROBS_MODE",
    "decode_steps": "POCKETJAX_DECODE_STEPS",
}
OFF = "off"  # compile_cache_dir (or POCKETJAX_COMPILE_CACHE_DIR) that keeps compiled programs in this process only
log = logging.getLogger("pocketjax")


SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding with prompt-lookup drafts (vLLM's `speculative_config` spelling): propose up to
    `num_speculative_tokens` tokens that followed the most recent earlier occurrence of the context's last n tokens
    (n from `prompt_lookup_max` down to `prompt_lookup_min`), and verify them in one step (docs/speculative-decoding.md).

    Per engine, not per request: k fixes the verify step's compiled width, so one value keeps one set of programs.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2

    @classmethod
    def of(cls, value: SpeculativeConfig | Mapping[str, Any] | str | None) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, a dict of its fields, or that dict as JSON (the CLI's --speculative-config);
        ConfigError naming unknown keys or a bad value."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ConfigError(f"speculative config is not JSON: {error}") from None
        if not isinstance(value, Mapping):
            raise ConfigError(f"speculative must be None, a SpeculativeConfig or a dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"unknown speculative option(s) {', '.join(map(str, unknown))} "
                              f"(known: {', '.join(sorted(known))})")
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                              f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"speculative {name} must be a positive integer, got {value!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative prompt_lookup_min {self.prompt_lookup_min} is above prompt_lookup_max "
                              f"{self.prompt_lookup_max}")


@dataclass(frozen=True)
class EngineConfig:
    """How an Engine sizes its cache and its compiled shapes (every bucket derives from these numbers)."""

    max_batch_size: int = 8
    max_seq_len: int = 2048
    prefill_chunk: int = 512
    attention_impl: str = "auto"
    min_kv_bucket: int = 128
    min_prefill_bucket: int = 16
    kv_dtype: str | None = None  # None: the model's dtype; "int8" / "float8_e4m3fn": quantized with scales
    # JAX's persistent compilation cache, kept across processes (process-wide). A folder: an Engine turns it on
    # there. None: an Engine leaves JAX's settings alone, while LLM / the CLI / the server use the per-user folder
    # ($XDG_CACHE_HOME/pocketjax/xla, else ~/.cache/pocketjax/xla) unless JAX's own cache folder is already set;
    # "off": none anywhere (JAX's setting is left alone).
    compile_cache_dir: str | None = None
    # speculative decoding: None (off), or a SpeculativeConfig / a dict of its fields / that dict as JSON
    speculative: SpeculativeConfig | None = None
    # On the CPU, pocketjax's native kernels (products, attention) so that a request's bits never depend on its
    # batch (README "Guarantees"); False: XLA's forms (today's speed at some batch sizes, no such guarantee)
    batch_invariant: bool = True
    # Which values a request's logprobs (and top logprobs) are, in vLLM's names (`sampling.LOGPROBS_MODES`):
    # "raw_logprobs" (default: log_softmax of the model's logits, before masks, logit_bias, penalties, temperature
    # and filtering), "processed_logprobs" (of the distribution the token was drawn from), "raw_logits",
    # "processed_logits" (the logit values instead). Per engine: the mode is compiled into the sampler.
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE
    # Decode steps per dispatch: N > 1 runs up to N decode + sample steps in one program (a loop of static length),
    # rows stopping on the device at their stop ids and max_tokens, when no row needs the host between steps
    # (`DecodePolicy.steps`); the tokens are those of N single steps, bit for bit. 1: one step per dispatch.
    decode_steps: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative", SpeculativeConfig.of(self.speculative))

    @classmethod
    def of(cls, config: EngineConfig | None = None, *, environ: Mapping[str, str] | None = None,
           **options: Any) -> EngineConfig:
        """`config` with `options` (EngineConfig field names) replaced, validated. Without `config`, fields no
        option names come from POCKETJAX_* variables in `environ` (default: os.environ), then the defaults.

        The one way Engine, LLM and the CLI turn keyword options into a config, so none repeats the field list.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        if config is None:
            config = cls.from_environment(os.environ if environ is None else environ)
        config = replace(config, **options)
        config.validate()
        return config

    @classmethod
    def from_environment(cls, environ: Mapping[str, str]) -> EngineConfig:
        """The defaults, with each field whose POCKETJAX_* variable is set (non-empty) read from it."""
        types = {f.name: f.type for f in fields(cls)}
        values = {}
        for name, variable in ENVIRONMENT.items():
            text = environ.get(variable, "").strip()
            if not text:
                continue
            try:
                values[name] = int(text) if types[name] == "int" else text
                if types[name] == "bool":
                    values[name] = {"1": True, "true": True, "on": True, "0": False, "false": False,
                                    "off": False}[text.lower()]
            except (ValueError, KeyError):
                kind = "a boolean (1/0, true/false, on/off)" if types[name] == "bool" else "an integer"
                raise ConfigError(f"environment variable {variable}={text!r} is not {kind}") from None
            try:
                cls(**{name: values[name]}).validate()
            except ConfigError as error:
                raise ConfigError(f"environment variable {variable}={text!r}: {error}") from None
        return cls(**values)

    def validate(self) -> None:
        for name in ("max_batch_size", "max_seq_len", "prefill_chunk", "min_kv_bucket", "min_prefill_bucket",
                     "decode_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ConfigError(f"attention_impl must be one of {', '.join(ATTENTION_IMPLS)}, got {self.attention_impl!r}")
        check_kv_dtype(self.kv_dtype)
        if not isinstance(self.batch_invariant, bool):
            raise ConfigError(f"batch_invariant must be True or False, got {self.batch_invariant!r}")
        check_logprobs_mode(self.logprobs_mode)
        folder = self.compile_cache_dir
        if folder is not None and (not isinstance(folder, (str, os.PathLike)) or not os.fspath(folder).strip()):
            raise ConfigError(f"compile_cache_dir must be a folder path or {OFF!r}, got {folder!r}")


def default_compile_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The per-user folder for compiled programs: $XDG_CACHE_HOME/pocketjax/xla, else ~/.cache/pocketjax/xla."""
    base = (os.environ if environ is None else environ).get("XDG_CACHE_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".cache"  # the XDG spec ignores a relative one
    return root / "pocketjax" / "xla"


def use_compile_cache(setting: str | os.PathLike | None) -> None:
    """Keep every compiled program in the folder `setting` names (JAX's persistent cache), so the next process
    reads the same shapes from disk instead of compiling them. Process-wide, as JAX's cache is.

    None: the per-user folder, unless JAX's cache folder is already set (JAX_COMPILATION_CACHE_DIR, an earlier
    call), and none (logged) if it cannot be created. "off": JAX's setting is left alone (off unless set).
    """
    current = jax.config.jax_compilation_cache_dir
    if setting == OFF or (setting is None and current is not None):
        return
    try:
        folder = Path(setting).expanduser().absolute() if setting is not None else default_compile_cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
    except (OSError, RuntimeError) as error:  # RuntimeError: Path.home() without a home
        if setting is not None:
            raise ConfigError(f"compile_cache_dir={os.fspath(setting)!r} cannot be created: {error}") from None
        log.warning("pocketjax: no compile cache (%s); compile_cache_dir= names a folder", error)
        return
    if current == str(folder):
        return
    if current is not None:
        compilation_cache.reset_cache()  # JAX opens its cache once per process: reopen it in the new folder
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # the engine's steps are worth keeping
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    log.info("pocketjax: compiled programs kept in %s (compile_cache_dir=%r or %s=%s turns this off)", folder, OFF,
             ENVIRONMENT["compile_cache_dir"], OFF)
