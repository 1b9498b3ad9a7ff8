"""The engine's device state: per-slot updates address slots and drop rows aimed past the last slot."""
import jax.numpy as jnp
import numpy as np

from pocketjax.engine.plan import bucket
from pocketjax.engine.steps import SlotState


def test_slot_state_restart_count_and_advance_address_slots_and_drop_padding():
    state = SlotState.zeros(3, 5)
    pad = state.num_slots  # a row aimed here (padding, inactive) writes nothing
    state = state.count(jnp.array([1, 2, pad]), jnp.array([1, 4, 1]))
    state = state.count(jnp.array([1, pad, 0]), jnp.array([1, 0, 2]))
    np.testing.assert_array_equal(state.output_counts, [[0, 0, 1, 0, 0], [0, 2, 0, 0, 0], [0, 0, 0, 0, 1]])
    masks = jnp.array([[0, 1, 0, 1, 0], [1, 0, 0, 0, 1]], bool)
    state = state.restart(jnp.array([1, pad]), masks)  # a new prompt in slot 1: its mask, counts back to 0
    np.testing.assert_array_equal(state.prompt_mask, [[0] * 5, [0, 1, 0, 1, 0], [0] * 5])
    np.testing.assert_array_equal(state.output_counts, [[0, 0, 1, 0, 0], [0] * 5, [0, 0, 0, 0, 1]])
    state = state.advance(jnp.array([2, pad, 0]), jnp.array([7, 8, 9]), jnp.array([5, 6, 4]), jnp.array([1, 2, 3]))
    np.testing.assert_array_equal(np.stack([state.token, state.position, state.generated]),
                                  [[9, 0, 7], [4, 0, 5], [3, 0, 1]])


def test_bucket_is_the_next_power_of_two_within_bounds():
    assert [bucket(n, 16, 512) for n in (1, 16, 17, 300, 512, 9999)] == [16, 16, 32, 512, 512, 512]
