"""EngineConfig: how an Engine sizes its cache and its compiled shapes (every bucket derives from these numbers)."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..errors import ConfigError
from ..model.kv_cache import check_kv_dtype


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

    @classmethod
    def of(cls, config: EngineConfig | None = None, **options: Any) -> EngineConfig:
        """`config` (default: the defaults) with `options` (EngineConfig field names) replaced, validated.

        The one way Engine, LLM and the CLI turn keyword options into a config, so none repeats the field list.
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
        config = replace(config or cls(), **options)
        config.validate()
        return config

    def validate(self) -> None:
        for name in ("max_batch_size", "max_seq_len", "prefill_chunk", "min_kv_bucket", "min_prefill_bucket"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        check_kv_dtype(self.kv_dtype)
