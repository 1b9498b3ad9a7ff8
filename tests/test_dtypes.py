"""16-bit checkpoints on CPU: bfloat16 weights stay 16-bit (by rule, never by a timing probe) and multiply in the
native kernel, or without it in XLA:CPU's best bf16 form (bf16 operands, float32 accumulation, >= 2 rows), beside a
float32 KV cache; float16 checkpoints compute in float32 by default, with a log line. Each default yields to an
explicit dtype."""
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pocketjax as pj
from pocketjax.model import layers

from test_engine import run
from conftest import oracle

torch = oracle("torch")
transformers = oracle("transformers")

GREEDY = pj.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_bfloat16_product_is_one_bf16_dot_with_float32_accumulation(rows, monkeypatch):
    monkeypatch.setattr(layers.cpu_kernels, "available", lambda: False)  # XLA's form (the fallback; the CPU
    # kernel is tested in test_cpu_kernels.py)
    rng = np.random.default_rng(rows)
    w = jnp.asarray(rng.standard_normal((48, 32)), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((rows, 32)), jnp.bfloat16)
    got = layers.linear(x, w)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T  # the bf16 inputs, multiplied exactly
    assert got.dtype == jnp.bfloat16 and got.shape == (rows, 48)
    # float32 accumulation, one rounding to bf16 at the end: within one bf16 step (2^-8 relative) of the exact value
    np.testing.assert_array_less(np.abs(np.asarray(got, np.float64) - want), np.abs(want) * 2.0**-8 + 1e-6)
    lowered = jax.jit(layers.linear).lower(x, w)
    # without the kernel: one row is padded to two (XLA:CPU's bf16 dot is slow at exactly one), 2-8 rows as w @ x.T
    operands, out = (("2x32xbf16", "48x32xbf16"), "2x48xf32") if rows == 1 else (
        ("48x32xbf16", f"{rows}x32xbf16"), f"48x{rows}xf32")
    assert re.search(rf"dot_general.*\(tensor<{operands[0]}>, tensor<{operands[1]}>\) -> tensor<{out}>",
                     lowered.as_text()), lowered.as_text()
    hlo = lowered.compile().as_text()
    assert len(re.findall(r" dot\(", hlo)) == 1 and not re.search(r"f32\[48,32\]\S* convert", hlo)  # never upcast


def test_bfloat16_engine_keeps_16_bit_weights_and_greedy_matches_transformers(hf_checkpoint):
    folder = hf_checkpoint("qwen3_gqa4_headdim", dtype="bfloat16")
    model = pj.load_model(folder, dtype="bfloat16")  # forced, whatever this CPU's probe says
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(model.params))
    prompt = [int(t) for t in np.random.default_rng(4).integers(0, model.config.vocab_size, 11)]
    assert pj.Engine(model, max_batch_size=1, max_seq_len=64, kv_dtype="bfloat16").cache.k[0].dtype == jnp.bfloat16
    engine = pj.Engine(model, max_batch_size=2, max_seq_len=64)
    assert engine.cache.k[0].dtype == jnp.float32  # on CPU: XLA:CPU has no fast 16-bit cache writes
    (req,) = run(engine, [prompt], GREEDY)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():  # greedy in float32 from the same bf16 weights; bf16 rounding may flip near-ties only
        ids = torch.tensor([prompt + req.generated_tokens])
        logits = hf(ids).logits[0, len(prompt) - 1:-1].numpy()
    for step, token in enumerate(req.generated_tokens):
        best = np.sort(logits[step])[-2:]
        if token != int(logits[step].argmax()):
            assert best[1] - best[0] < 0.05 * np.abs(logits[step]).max(), (step, req.generated_tokens)
            break


def test_float16_checkpoint_computes_in_float32_on_cpu_unless_forced(hf_checkpoint, caplog):
    folder = hf_checkpoint("qwen2_mha_untied", dtype="float16")
    with caplog.at_level(logging.INFO, logger="pocketjax"):
        model = pj.load_model(folder)
    assert model.dtype == jnp.float32 and "float16 checkpoint computed in float32" in caplog.text
    assert pj.load_model(folder, dtype="float16").dtype == jnp.float16


@pytest.mark.parametrize("built", [True, False])
def test_bfloat16_checkpoint_dtype_is_a_rule_not_a_timing(hf_checkpoint, monkeypatch, built):
    """The default dtype is a rule of the backend, the checkpoint and the build: bf16 where the native kernels are
    built, else float32; the same call gives the same numerics on a loaded or an idle machine. Nothing is timed (a
    clock read would raise here)."""
    import time

    def no_clock():
        raise AssertionError("load_model timed something")

    folder = hf_checkpoint("qwen3_gqa4_headdim", dtype="bfloat16")
    monkeypatch.setattr(time, "perf_counter", no_clock)
    monkeypatch.setattr(layers.cpu_kernels, "available", lambda: built)
    assert pj.load_model(folder).dtype == (jnp.bfloat16 if built else jnp.float32)
    assert pj.load_model(folder, dtype="bfloat16").dtype == jnp.bfloat16
    assert not hasattr(layers, "bfloat16_probe")


@pytest.mark.parametrize("quantize", [None, "int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_every_dtype_and_weight_form_serves_a_greedy_request(hf_checkpoint, dtype, quantize):
    """Each documented load_model dtype x weight form answers a request through the engine's default attention
    path: float16 failed every request with the native kernels ("q and out must both be float32 or bfloat16",
    issue 67); its queries are now widened to float32 for the kernel, its products are XLA's."""
    model = pj.load_model(hf_checkpoint("qwen3_gqa4_headdim"), dtype=dtype, quantize=quantize)
    assert model.dtype == jnp.dtype(dtype)
    params = pj.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, logprobs=1)
    (req,) = run(pj.Engine(model, max_batch_size=1, max_seq_len=32, prefill_chunk=16), [[5, 17, 3, 9]], params)
    assert len(req.generated_tokens) == 3 and req.finish_reason == "length"
    assert all(np.isfinite(lp) and lp <= 0 for lp, _ in req.logprobs)
