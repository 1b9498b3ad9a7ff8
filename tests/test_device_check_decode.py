"""benchmarks/device_check_decode.py, the GPU script's issue-66 parts, on CPU: what they compare and count is what they
say (the timings themselves only a GPU run gives; `device_check.sh --dry-run` runs every part end to end)."""
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import device_check_decode as dcd
from benchmarks.peers import sampling_8a0ce4b as old_sampling
from pocketjax.engine import sampling
from pocketjax.engine.engine import Engine
from pocketjax.model.quant import QuantizedWeight


def test_thunk_lines_are_counted_per_step_inside_each_marked_loop_only():
    log = "\n".join([
        "I1207 00:00:00.1 1 conditional_thunk.cc:80] before any loop: not counted",
        f"{dcd.MARK} begin greedy/8a0ce4b steps=4",
        *["I1207 00:00:00.2 1 conditional_thunk.cc:80] Executing"] * 6,
        "I1207 00:00:00.3 1 while_thunk.cc:90] iteration",
        "I1207 00:00:00.4 1 gpu_executable.cc:1] other",
        f"{dcd.MARK} end greedy/8a0ce4b",
        "I1207 00:00:00.5 1 while_thunk.cc:90] between loops: not counted",
        f"{dcd.MARK} begin greedy/today steps=2",
        f"{dcd.MARK} end greedy/today",
    ])
    assert dcd.count_thunks(log) == {"greedy/8a0ce4b": {"conditional": 1.5, "while": 0.25},
                                     "greedy/today": {"conditional": 0.0, "while": 0.0}}


def test_the_parent_sampler_branches_on_the_device_and_todays_greedy_program_does_not():
    """The A/B compares what it says: 8a0ce4b's sampler holds HLO conditionals, today's GREEDY variant none."""
    rows, vocab = 2, 64
    logits = jnp.zeros((rows, vocab), jnp.float32)
    arrays = sampling.pack_sampling([dcd.SAMPLINGS["greedy"]] * rows, [0] * rows)
    steps = jnp.zeros(rows, jnp.int32)
    old = old_sampling.sample.lower(logits, arrays, None, None, steps).compile().as_text()
    new = jax.jit(lambda lg, a, s: sampling.sample(lg, a, None, None, s, paths=sampling.GREEDY)
                  ).lower(logits, arrays, steps).compile().as_text()
    assert "conditional(" in old
    assert "conditional(" not in new


def test_random_model_makes_int8_linears_stacked_with_the_float_forms_spread():
    model = dcd.random_model("qwen2.5-micro", "float32", int8=True, scan=True)
    config, layers = model.config, model.params["layers"]
    assert model.scan_layers and isinstance(layers["q"], QuantizedWeight)
    assert layers["q"].values.dtype == jnp.int8
    assert layers["q"].values.shape == (config.num_layers, config.num_heads * config.head_dim, config.hidden_size)
    assert layers["q_bias"].shape == (config.num_layers, config.num_heads * config.head_dim)  # Qwen2's biases
    assert model.params["embed"].dtype == jnp.float32 and "lm_head" in model.params  # untied, as Qwen2.5-32B
    w = np.asarray(layers["gate"].values, np.float32) * np.asarray(layers["gate"].scale)
    assert abs(w.std() * np.sqrt(config.hidden_size) - 1) < 0.1  # std 1/sqrt(in), as the float form's


def test_engine_run_decodes_several_steps_per_dispatch():
    """The table's loop runs the engine's multi-step path: 4 decode tokens in 2 dispatches of 2 steps (and one more
    that finds the row done), every token made."""
    model = dcd.random_model("qwen3-micro", "float32")
    engine = Engine(model, max_batch_size=1, max_seq_len=32, decode_steps=2, attention_impl="xla")
    run = dcd.engine_run(engine, dcd.prompts(1, 6, model.config.vocab_size), gen=5, steps=2)
    assert run["decode_tokens"] == 4
    assert run["dispatches"] <= 3
