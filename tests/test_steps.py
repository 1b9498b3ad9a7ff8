"""The engine's device state: per-slot penalty updates address slots and drop rows aimed past the last slot."""
import jax.numpy as jnp
import numpy as np

from pocketjax.engine.plan import bucket
from pocketjax.engine.steps import Penalties


def test_penalties_restart_and_count_address_slots_and_drop_padding():
    state = Penalties.zeros(3, 5)
    pad = state.num_slots  # a row aimed here (padding, inactive) writes nothing
    state = state.count(jnp.array([1, 2, pad]), jnp.array([1, 4, 1]))
    state = state.count(jnp.array([1, pad, 0]), jnp.array([1, 0, 2]))
    np.testing.assert_array_equal(state.output_counts, [[0, 0, 1, 0, 0], [0, 2, 0, 0, 0], [0, 0, 0, 0, 1]])
    masks = jnp.array([[0, 1, 0, 1, 0], [1, 0, 0, 0, 1]], bool)
    state = state.restart(jnp.array([1, pad]), masks)  # a new prompt in slot 1: its mask, counts back to 0
    np.testing.assert_array_equal(state.prompt_mask, [[0] * 5, [0, 1, 0, 1, 0], [0] * 5])
    np.testing.assert_array_equal(state.output_counts, [[0, 0, 1, 0, 0], [0] * 5, [0, 0, 0, 0, 1]])


def test_bucket_is_the_next_power_of_two_within_bounds():
    assert [bucket(n, 16, 512) for n in (1, 16, 17, 300, 512, 9999)] == [16, 16, 32, 512, 512, 512]
