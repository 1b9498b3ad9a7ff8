"""LLM: the user-level API (generate / stream / chat) over a background Scheduler and the checkpoint's tokenizer."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.config import EngineConfig
from ..engine.engine import Engine
from ..engine.request import Completion
from ..engine.sampling import SamplingParams
from ..errors import RequestError
from ..model.decoder import Model, load_model
from .scheduler import Scheduler
from .tokenizer import Tokenizer

DEFAULT_MODEL = Path(__file__).parents[1] / "assets" / "pocket-coder"


class LLM:
    """Load a checkpoint folder or Hub repo id (default: the embedded model) and serve prompts through continuous batching.

    `quantize` ("int8", "int4", "+head" variants) quantizes weights at load; `kv_dtype` ("int8", "float8_e4m3fn")
    quantizes the KV cache (about half the bytes of a 16-bit cache, so twice the slots or context per GiB).

    Engine options (max_batch_size, max_seq_len, prefill_chunk, attention_impl, kv_dtype) are EngineConfig's fields,
    as keywords or as `engine_config`.

    Prompts are strings (tokenized with the checkpoint's tokenizer.json) or token-id lists. The scheduler runs on
    a background thread from the first request until `close()` (or the end of a `with` block).
    """

    def __init__(self, model: str | Path | Model | None = None, engine_config: EngineConfig | None = None, *,
                 dtype: str | None = None, tp: int = 1, quantize: str | None = None, revision: str | None = None,
                 seed: int = 0, warmup: bool = False,
                 tokenizer: Tokenizer | None = None, **engine_options: Any):
        config = EngineConfig.of(engine_config, **engine_options)  # checked before the weights load
        if not isinstance(model, Model):
            model = load_model(model or DEFAULT_MODEL, dtype=dtype, tp=tp, quantize=quantize, revision=revision)
        self.model = model
        self.tokenizer = tokenizer
        if self.tokenizer is None and model.path and (Path(model.path) / "tokenizer.json").exists():
            self.tokenizer = Tokenizer.from_folder(model.path)
        self.engine = Engine(model, config, seed=seed)
        if warmup:  # every shape compiled now (and kept in the compile cache), none in the middle of serving
            self.engine.warmup()
        self.scheduler = Scheduler(self.engine, max_waiting=1 << 20, tokenizer=self.tokenizer)  # generate() queues all
        self.started = False

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the background scheduler thread (requests still running end "cancelled")."""
        if self.started:
            self.scheduler.stop()
            self.started = False

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt: strings go through the tokenizer, id lists pass through."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model folder has no tokenizer.json: pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (Sequence, np.ndarray)):
            raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)  # the engine checks each id (a non-integer is a RequestError, never rounded)

    def submit(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None):
        """Queue one prompt on the background scheduler; returns its handle."""
        if not self.started:
            self.scheduler.start()
            self.started = True
        return self.scheduler.submit(self.encode(prompt), SamplingParams() if sampling is None else sampling)

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[Completion]:
        """One Completion per prompt, in order; all prompts run concurrently (continuous batching)."""
        if not isinstance(prompts, (str, Sequence, np.ndarray)):
            raise RequestError("prompts must be a string, a list of token ids, or a list of strings or id lists, "
                               f"got {type(prompts).__name__}")
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, float, np.number))):
            prompts = [prompts]
        if not (sampling is None or isinstance(sampling, (SamplingParams, list, tuple))):
            raise RequestError(f"sampling must be a SamplingParams or a list of them, got {type(sampling).__name__}")
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        handles = [self.submit(p, s) for p, s in zip(prompts, params)]
        show = len(handles) >= 16 if use_tqdm is None else use_tqdm
        if show:
            from tqdm.auto import tqdm
            handles_iter: Any = tqdm(handles, desc="generate", unit="req")
        else:
            handles_iter = handles
        return [h.result() for h in handles_iter]

    def stream(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None) -> Iterator[str]:
        """Text pieces of one completion as they are generated (never splitting a UTF-8 character)."""
        yield from self.submit(prompt, sampling).text_stream()

    def chat(self, messages: list[dict[str, Any]], sampling: SamplingParams | None = None) -> Completion:
        """The assistant's reply to a conversation, rendered with the checkpoint's chat template."""
        if self.tokenizer is None:
            raise RequestError("this model folder has no tokenizer: chat needs a chat template")
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return self.generate(prompt, sampling)[0]
