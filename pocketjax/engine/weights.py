"""New weights for a running engine (an RL loop's policy after each optimizer step), with no recompile.

The engine's jitted steps take the params as an argument, so weights of the same tree, shapes, dtypes (weak types
included) and shardings hit the programs already compiled. `placed` checks that and places the new leaves: a leaf
that already has the engine's sharding is used as it is (no copy: a training step's output arrays serve directly);
one on another placement (host NumPy, one device of a TP engine) is put onto the engine's sharding, which copies it.
A leaf whose tree position, shape or dtype differs is a ConfigError naming it, before anything changes.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

from ..errors import ConfigError


def placed(current: Any, new: Any, refuse_copies: str | None = None) -> Any:
    """`new` laid out as `current` (the engine's params): same tree, shapes and dtypes, the engine's shardings; a
    ConfigError names the first leaf that differs. With `refuse_copies` (why), a leaf that would have to be placed
    (not used as it is) is a ConfigError too, saying that."""
    old_leaves, old_tree = jax.tree_util.tree_flatten_with_path(current)
    try:
        new_leaves = old_tree.flatten_up_to(new)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"update_params: the new params are not the engine's tree ({_first_line(error)}); pass "
                          f"the same structure the model was loaded with (LoRA leaves included)") from None
    out = []
    for (path, old), leaf in zip(old_leaves, new_leaves):
        where = jax.tree_util.keystr(path)
        shape, dtype = np.shape(leaf), getattr(leaf, "dtype", None)
        if shape != old.shape or dtype != old.dtype:
            raise ConfigError(f"update_params: params{where} is {dtype}{list(shape)}, the engine's is "
                              f"{old.dtype}{list(old.shape)} (same shapes and dtypes only: no recompile)")
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise ConfigError(f"update_params: params{where} was deleted (donated to another jitted call?)")
        as_is = isinstance(leaf, jax.Array) and not leaf.weak_type  # a weak type would compile programs of its own
        if as_is and leaf.sharding == old.sharding:
            out.append(leaf)
        elif refuse_copies is not None:
            spec = getattr(old.sharding, "spec", old.sharding)
            raise ConfigError(f"update_params: params{where} is not a jax.Array on the engine's sharding ({spec}); "
                              f"{refuse_copies}")
        else:
            out.append(jax.device_put(leaf if as_is else np.asarray(leaf), old.sharding))
    return jax.tree_util.tree_unflatten(old_tree, out)


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
