"""What an engine checks of a request before it joins a batch, so a bad request fails alone (typed errors).

Cheap host checks (prompt, token ids, sampling fields), then what needs the model: a hook is traced once on a small
stream (no compile), a structured-output constraint is compiled (cached per constraint).
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ..errors import RequestError, SamplingError, StructuredOutputError
from ..model.decoder import Hook, Model
from .request import BatchedRequest
from .sampling_params import SamplingParams
from .structured import Constrainer


def check_request(req: BatchedRequest, model: Model, max_seq_len: int, constrainer: Constrainer | None,
                  checked_hooks: set[Hook]) -> None:
    """Raise RequestError/SamplingError/StructuredOutputError for a request an engine over `model` cannot run.
    `checked_hooks`: hooks traced before (a hook that passes is added)."""
    prompt = req.prompt_tokens
    if not isinstance(prompt, (Sequence, np.ndarray)) or isinstance(prompt, (str, bytes)):
        raise RequestError(f"request {req.request_id!r}: prompt_tokens must be a list of token ids, got "
                           f"{type(prompt).__name__} (encode text first: LLM does, or Tokenizer.encode)")
    if len(prompt) == 0:
        raise RequestError(f"request {req.request_id!r}: empty prompt")
    if len(prompt) >= max_seq_len:
        raise RequestError(f"request {req.request_id!r}: prompt of {len(prompt)} tokens does not fit "
                           f"max_seq_len={max_seq_len} (one position is needed to generate)")
    vocab = model.config.vocab_size
    for t in prompt:
        if not isinstance(t, (int, np.integer)) or isinstance(t, bool):
            raise RequestError(f"request {req.request_id!r}: non-integer token id {t!r}")
        if not 0 <= t < vocab:
            raise RequestError(f"request {req.request_id!r}: token id {t!r} outside the vocabulary [0, {vocab})")
    if not isinstance(req.sampling, SamplingParams):
        raise RequestError(f"request {req.request_id!r}: sampling must be a SamplingParams")
    req.sampling.validate(vocab)
    if req.sampling.bad_words and constrainer is None:
        raise SamplingError(f"request {req.request_id!r}: SamplingParams.bad_words needs an engine with a "
                            f"tokenizer (Engine(model, tokenizer=...); LLM passes its own)")
    check_hook(req, model, checked_hooks)
    steering_table(req, model)
    if any(i > model.config.num_layers for i in req.sampling.return_hidden):
        raise SamplingError(f"request {req.request_id!r}: SamplingParams.return_hidden indexes [0, "
                            f"{model.config.num_layers}] (0: the embedding output, i: after layer i - 1), got "
                            f"{list(req.sampling.return_hidden)}")
    if req.sampling.structured is not None:
        if constrainer is None:
            raise StructuredOutputError(f"request {req.request_id!r}: structured outputs need an engine with a "
                                        f"tokenizer (Engine(model, tokenizer=...); LLM passes its own)")
        constrainer.attach(req)  # compiled here, on the submitting thread: admission never compiles


def steering_table(req: BatchedRequest, model: Model) -> np.ndarray | None:
    """req's steering vectors as float32 [layers, hidden] (None: it steers nothing); SamplingError for a layer the
    model does not have or a vector of the wrong length."""
    if not req.sampling.steer:
        return None
    c = model.config
    table = np.zeros((c.num_layers, c.hidden_size), np.float32)
    for layer, vector in req.sampling.steer:
        if layer >= c.num_layers or len(vector) != c.hidden_size:
            raise SamplingError(f"request {req.request_id!r}: SamplingParams.steer maps layers [0, {c.num_layers}) to "
                                f"vectors of {c.hidden_size} floats, got layer {layer} with {len(vector)}")
        table[layer] = vector
    return table


def check_hook(req: BatchedRequest, model: Model, checked_hooks: set[Hook]) -> None:
    """Trace a request's hook once (`jax.eval_shape`, no compile) on a [2, 3, hidden] stream, with the layer index
    as the model's layout passes it; SamplingError if it raises or changes the shape or dtype, so a bad hook fails
    its own request here instead of the batch it would join."""
    hook = req.sampling.hook
    if hook is None or hook in checked_hooks:
        return
    c = model.config
    x = jax.ShapeDtypeStruct((2, 3, c.hidden_size), model.dtype)
    try:
        if model.scan_layers:
            outs = [jax.eval_shape(hook, jax.ShapeDtypeStruct((), jnp.int32), x)]
        else:
            outs = jax.eval_shape(lambda h: [hook(i, h) for i in range(c.num_layers)], x)
    except Exception as error:  # noqa: BLE001 - whatever a user's function raises belongs to its request
        raise SamplingError(f"request {req.request_id!r}: SamplingParams.hook raised {type(error).__name__} "
                            f"when traced on hidden {x.shape} {x.dtype}: {error}") from error
    for out in outs:
        if getattr(out, "shape", None) != x.shape or getattr(out, "dtype", None) != x.dtype:
            got = f"{out.shape} {out.dtype}" if hasattr(out, "shape") else type(out).__name__
            raise SamplingError(f"request {req.request_id!r}: SamplingParams.hook must return the hidden states' "
                                f"shape and dtype {x.shape} {x.dtype}, got {got}")
    checked_hooks.add(hook)
