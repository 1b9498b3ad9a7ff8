"""A loaded `Model` as a Flax NNX module: `Decoder(model)` holds the very arrays of `model.params` as `nnx.Param`s.

Research code can then use NNX's tools (nnx.display, nnx.split by filter, nnx.Optimizer) on a pocketjax model, and
LoRA adapters live in it as `nnx.LoRAParam`s, so "train only the adapters" is a filter: `nnx.split(view,
nnx.LoRAParam, ...)`. The module holds state only: `__call__` rebuilds the params pytree from the variables' values
and runs the one functional forward (`decoder.forward_logits`), so the view cannot drift from what the engine
serves. Flax's `nnx.LoRA` module is not used for the computation: its call re-implements a linear in [in, out]
layout without alpha scaling, where `layers.linear` already applies an unmerged `LoraWeight` in PEFT's layout; its
initializers and variable type are (lora_A: `nnx.nn.lora.default_a_initializer`, lora_B zeros, as PEFT's default).
`to_model()` is the way back: merged weights for `Engine` / `LLM`, no checkpoint round trip.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx.nn.lora import default_a_initializer

from .errors import ConfigError
from .model.checkpoint import layer_tensors
from .model.decoder import Hook, Model, forward_logits, logits_impl
from .model.lora import Adapter, Lora, LoraConfig, attach, merge


def wrap(x: Any) -> nnx.Variable:
    """Float arrays become trainable-by-type `nnx.Param`s; integer leaves (quantized values) plain Variables."""
    return nnx.Param(x) if jnp.issubdtype(x.dtype, jnp.inexact) else nnx.Variable(x)


def values(tree: Any) -> Any:
    """The arrays inside a tree of nnx Variables (the Variables themselves are left alone)."""
    return jax.tree.map(lambda v: v.get_value(), tree, is_leaf=lambda v: isinstance(v, nnx.Variable))


def new_adapter(model: Model, lora: LoraConfig, key: jax.Array) -> Adapter:
    """Fresh float32 pairs for every layer: lora_A from Flax's LoRA initializer, lora_B zeros (so delta W = 0).
    Each layer's own tensors give the shapes: a mixture-of-experts layer has experts, not the dense MLP, so a target
    it lacks is a ConfigError naming the layer (as loading such an adapter is)."""
    layers = []
    for i in range(model.config.num_layers):
        shapes = layer_tensors(model.config, i)
        missing = [name for name in lora.targets if name not in shapes]
        if missing:
            raise ConfigError(f"LoRA targets {missing} are not projections of layer {i} (a mixture-of-experts layer "
                              f"holds experts instead of the dense MLP): target the attention projections")
        pairs = {}
        for j, name in enumerate(lora.targets):
            out, inp = shapes[name][1]
            # Flax's initializer reads a [in, r] kernel (fan_in = in), as PEFT's kaiming init reads A [r, in].
            a = default_a_initializer(jax.random.fold_in(key, i * len(lora.targets) + j), (inp, lora.rank)).T
            pairs[name] = Lora(a, jnp.zeros((out, lora.rank), jnp.float32), lora.scaling)
        layers.append(pairs)
    return Adapter(lora, tuple(layers))


class Decoder(nnx.Module):
    """The Qwen decoder of a loaded `Model` as an nnx.Module, parameters shared with it (no copy, shardings kept).

    `lora`: a `LoraConfig` (fresh adapters, drawn from `rngs`) or an `Adapter` (e.g. `lora.read_adapter(dir,
    config)`), held unmerged as `nnx.LoRAParam`s in `self.lora`; the base weights stay `nnx.Param`s.
    """

    def __init__(self, model: Model, lora: LoraConfig | Adapter | None = None, *, rngs: nnx.Rngs | None = None):
        self.config = model.config
        self.mesh = model.mesh
        self.path = model.path
        self.params = nnx.data(jax.tree.map(wrap, model.params))
        if isinstance(lora, LoraConfig):
            lora = new_adapter(model, lora, (rngs or nnx.Rngs(0)).params())
        self.lora_config = None if lora is None else lora.config
        # per layer, our projection name -> Lora(a=LoRAParam, b=LoRAParam, scaling)
        self.lora = nnx.data(None if lora is None else [
            {n: Lora(nnx.LoRAParam(jnp.asarray(p.a)), nnx.LoRAParam(jnp.asarray(p.b)), p.scaling)
             for n, p in pairs.items()} for pairs in lora.layers])

    def functional(self, merged: bool = False) -> dict:
        """The params pytree the functional decoder takes: adapters attached as `LoraWeight`s, or `merged` in."""
        params = values(self.params)
        if self.lora is not None:
            params = attach(params, Adapter(self.lora_config, tuple(values(self.lora))))
            if merged:
                params = merge(params)
        return params

    def __call__(self, tokens: jax.Array, *, hook: Hook | None = None, return_hidden: bool = False):
        """float32 logits [B, T, vocab] of int tokens [B, T] (with `return_hidden`, also hidden [layers + 1, B, T, H]),
        computed by `decoder.forward_logits` on `functional()`: the same forward as `pj.logits`, adapters unmerged."""
        return forward_logits(self.functional(), self.config, tokens, hook=hook, keep_hidden=return_hidden,
                              impl=logits_impl(self.mesh))

    def adapter(self) -> Adapter:
        """The adapters' current values, e.g. for `lora.write_adapter` (PEFT's files)."""
        if self.lora is None:
            raise ConfigError("this Decoder holds no LoRA adapters (build it with lora=LoraConfig(...))")
        return Adapter(self.lora_config, tuple(values(self.lora)))

    def to_model(self, merged: bool = True) -> Model:
        """A `pj.Model` of the current values for `Engine` / `LLM` / `pj.logits`: adapters merged into the weights
        (`merged=False` keeps them as `LoraWeight`s, which `pj.logits` runs but the engine's sharding does not)."""
        return Model(config=self.config, params=self.functional(merged), mesh=self.mesh, path=self.path)
