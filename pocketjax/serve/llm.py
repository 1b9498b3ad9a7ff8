"""LLM: the user-level API (generate / stream / chat) over a background Scheduler and the checkpoint's tokenizer."""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.config import EngineConfig, use_compile_cache
from ..engine.engine import Engine
from ..engine.request import Completion
from ..engine.sampling_params import SamplingParams
from ..errors import RequestError
from ..model.decoder import Model, load_model
from .distributed import ProcessGroup, default_mesh
from .scheduler import Scheduler
from .tokenizer import Tokenizer

DEFAULT_MODEL = Path(__file__).parents[1] / "assets" / "pocket-coder"
Prompt = str | Sequence[int]


@dataclass(frozen=True)
class Score:
    """A continuation's log-likelihood given its context: what an evaluation harness's loglikelihood request needs."""

    token_ids: list[int]  # the continuation's tokens
    logprobs: list[float]  # raw log p(token | context and the continuation tokens before it), one per token
    logprob: float  # their sum
    greedy: bool  # every continuation token was the argmax, first index on ties (lm-eval's is_greedy)


BYTES = (bytes, bytearray, memoryview)


def refuse_bytes(value: Any, name: str) -> None:
    """RequestError for bytes: a Sequence of ints in Python, they would otherwise pass for token ids."""
    if isinstance(value, BYTES):
        raise RequestError(f"{name} must be text (str) or token ids, got {type(value).__name__}: decode bytes first, "
                           f"e.g. data.decode('utf-8')")


def as_batch(prompts: Prompt | Sequence[Prompt], name: str = "prompts") -> list[Prompt]:
    """A list of prompts: one string or one token-id list becomes a list of one (RequestError for anything else,
    bytes included)."""
    refuse_bytes(prompts, name)
    if not isinstance(prompts, (str, Sequence, np.ndarray)):
        raise RequestError(f"{name} must be a string, a list of token ids, or a list of strings or id lists, "
                           f"got {type(prompts).__name__}")
    if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, float, np.number))):
        return [prompts]
    return list(prompts)


class LLM:
    """Load a checkpoint folder or Hub repo id (default: the embedded model) and serve prompts through continuous batching.

    `quantize` ("int8", "int4", "+head" variants) quantizes weights at load; `kv_dtype` ("int8", "float8_e4m3fn")
    quantizes the KV cache (about half the bytes of a 16-bit cache, so twice the slots or context per GiB).
    `scan_layers` ("auto", True, False) picks the layer loop, as `load_model`'s.

    Engine options (max_batch_size, max_seq_len, prefill_chunk, attention_impl, kv_dtype) are EngineConfig's fields,
    as keywords or as `engine_config`.

    Prompts are strings (tokenized with the checkpoint's tokenizer.json) or token-id lists. The scheduler runs on
    a background thread from the first request until `close()` (or the end of a `with` block).

    In a multi-process job (after `pocketjax.serve.distributed.initialize`) every process constructs the same LLM:
    weights go over a ("dp", "tp") mesh of every process's devices, process 0 takes the requests and the others
    follow it step by step (the same prompts submitted on every process return the same completions everywhere);
    process 0's `close()` ends the job, and `close()` elsewhere waits for it.
    """

    def __init__(self, model: str | Path | Model | None = None, engine_config: EngineConfig | None = None, *,
                 dtype: str | None = None, tp: int = 1, quantize: str | None = None, revision: str | None = None,
                 seed: int = 0, warmup: bool = False, scan_layers: bool | str = "auto",
                 tokenizer: Tokenizer | None = None, **engine_options: Any):
        config = EngineConfig.of(engine_config, **engine_options)  # checked before the weights load
        # The one process-wide setting pocketjax makes, and only here (not in Engine): JAX's persistent compile cache
        # in the per-user folder (logged at INFO; compile_cache_dir="off" or POCKETJAX_COMPILE_CACHE_DIR=off: none)
        use_compile_cache(config.compile_cache_dir)
        group = ProcessGroup.current()  # None unless jax.distributed joined a multi-process job
        if not isinstance(model, Model):
            mesh = default_mesh(tp) if group is not None else None  # every device of the job: dp = devices / tp
            model = load_model(model or DEFAULT_MODEL, dtype=dtype, tp=tp, quantize=quantize, revision=revision,
                               mesh=mesh, scan_layers=scan_layers)
        self.model = model
        self.tokenizer = tokenizer
        if self.tokenizer is None and model.path and (Path(model.path) / "tokenizer.json").exists():
            self.tokenizer = Tokenizer.from_folder(model.path)
        self.engine = Engine(model, config, seed=seed, tokenizer=self.tokenizer)
        if warmup:  # every shape compiled now (and kept in the compile cache), none in the middle of serving
            self.engine.warmup()
        self.scheduler = Scheduler(self.engine, max_waiting=1 << 20, tokenizer=self.tokenizer,  # generate() queues all
                                   group=group)
        self.started = False
        if group is not None:  # every process steps in lockstep from now on (process 0 at least once a second)
            self.scheduler.start()
            self.started = True

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Stop the background scheduler thread (requests still running end "cancelled")."""
        if self.started:
            self.scheduler.stop()
            self.started = False

    def update_params(self, params: Any, *, finish_running: bool = False, timeout: float | None = None) -> None:
        """Serve new weights (an RL loop's policy after each optimizer step) with no recompile and no new cache:
        `Scheduler.update_params` swaps them at the next step boundary (the same tree, shapes and dtypes; a
        ConfigError otherwise), requests in flight continue on them (`finish_running`: they finish on the old ones
        first), cached prefixes are forgotten. `self.model` then holds them, so `pj.logits(llm.model, ...)` scores
        with what generates.

        In a multi-process job every process calls it, as a jax.distributed training loop does, with its view of the
        same global params, each leaf on the engine's sharding (a train step's out_shardings; anything else is a
        ConfigError, since placing it would run collectives beside the serving loop). Process 0's broadcast says at
        which step its call number N applies, and every process swaps in its own call N at that step (one that has
        not made it yet is waited for), so all serve the new weights from the same step."""
        self.scheduler.update_params(params, finish_running=finish_running, timeout=timeout)
        self.model = self.engine.model

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt: strings go through the tokenizer, id lists pass through (bytes: RequestError)."""
        refuse_bytes(prompt, "a prompt")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model folder has no tokenizer.json: pass token ids instead of text")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (Sequence, np.ndarray)):
            raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        return list(prompt)  # the engine checks each id (a non-integer is a RequestError, never rounded)

    def submit(self, prompt: str | Sequence[int], sampling: SamplingParams | None = None):
        """Queue one prompt on the background scheduler; returns its handle."""
        return self._running().submit(self.encode(prompt), sampling)  # None: the scheduler's default

    def submit_many(self, prompts: Sequence[str | Sequence[int]], sampling: Sequence[SamplingParams | None]) -> list:
        """Queue prompts together (`Scheduler.submit_many`: admitted as one batch); returns their handles."""
        jobs = [(self.encode(p), s, None) for p, s in zip(prompts, sampling)]
        return self._running().submit_many(jobs)

    def _running(self) -> Scheduler:
        """The scheduler, its background loop started on first use."""
        if not self.started:
            self.scheduler.start()
            self.started = True
        return self.scheduler

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[Completion]:
        """One Completion per prompt, in order; all prompts run concurrently (continuous batching)."""
        prompts = as_batch(prompts)
        if not (sampling is None or isinstance(sampling, (SamplingParams, list, tuple))):
            raise RequestError(f"sampling must be a SamplingParams or a list of them, got {type(sampling).__name__}")
        params = list(sampling) if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(params)} SamplingParams for {len(prompts)} prompts")
        handles = self.submit_many(prompts, params)
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

    def score(self, contexts: Prompt | Sequence[Prompt], continuations: Prompt | Sequence[Prompt]) -> list[Score]:
        """The log-probability of each continuation after its context, token by token, in one batched pass.

        Strings or token-id lists (both of a pair the same kind); one context pairs with every continuation, else
        one context per continuation. Each pair runs as one request whose prompt is context + continuation, with
        `prompt_logprobs` from the batched prefill and a single generated token (the least the engine runs).
        """
        conts = as_batch(continuations, "continuations")
        ctxs = as_batch(contexts, "contexts")
        if len(ctxs) == 1:
            ctxs = ctxs * len(conts)
        if len(ctxs) != len(conts):
            raise RequestError(f"{len(ctxs)} contexts for {len(conts)} continuations (give one, or one each)")
        pairs = [self.encode_pair(ctx, cont) for ctx, cont in zip(ctxs, conts)]
        sampling = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)  # top-1: the greedy flag
        handles = self.submit_many([ctx + cont for ctx, cont in pairs], [sampling] * len(pairs))
        scores = []
        for handle, (ctx, cont) in zip(handles, pairs):
            entries = handle.result().prompt_logprobs[len(ctx):]
            logprobs = [lp for lp, _ in entries]
            greedy = all(next(iter(top)) == token for token, (_, top) in zip(cont, entries))
            scores.append(Score(cont, logprobs, float(sum(logprobs)), greedy))
        return scores

    def encode_pair(self, context: Prompt, continuation: Prompt) -> tuple[list[int], list[int]]:
        """Context and continuation token ids, split as lm-eval does: trailing spaces of a text context move to the
        continuation, the whole text is encoded at once and split after as many tokens as the context alone
        encodes to. Where the tokenizer merges characters across the boundary, the tokens after that count are the
        continuation (they may carry context characters, or the context's last token the continuation's first).
        An empty text context is the tokenizer's BOS (else EOS) token, as lm-eval's prefix token."""
        if isinstance(context, str) != isinstance(continuation, str):
            raise RequestError("a context and its continuation must both be strings or both token-id lists")
        if not isinstance(context, str):
            ctx, cont = self.encode(context), self.encode(continuation)
        elif context == "":
            ids = (self.tokenizer.bos_token_id, self.tokenizer.eos_token_id) if self.tokenizer is not None else ()
            ctx, cont = [i for i in ids if i is not None][:1], self.encode(continuation)
            if not ctx:
                raise RequestError("an empty context needs a tokenizer with a BOS or EOS token to stand for it")
        else:
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole, ctx = self.encode(context + continuation), self.encode(context)
            ctx, cont = whole[:len(ctx)], whole[len(ctx):]
        if not ctx or not cont:
            raise RequestError(f"context and continuation must each be at least one token, got {len(ctx)} and "
                               f"{len(cont)} (context {context!r}, continuation {continuation!r})")
        return ctx, cont
