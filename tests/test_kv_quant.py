"""Quantized KV cache (int8, float8_e4m3fn): rounding, engine parity, sharding and bytes.

The independent reference: `pj.logits(..., kv_dtype=)`, a cache-free full forward that rounds K/V the way the
cache stores them (per token and head, so it does not depend on what else is cached). The kernels and the XLA
attention over a quantized cache are checked against a dequantized copy in tests/test_kernels.py.
"""
import jax.numpy as jnp
import numpy as np
import pytest

import pocketjax as pj
from pocketjax.engine.engine import Engine
from pocketjax.engine.request import BatchedRequest
from pocketjax.errors import ConfigError
from pocketjax.model.kv_cache import QMAX, copy_prefix, dequantize, init_cache, quantize
from pocketjax.engine.sampling_params import SamplingParams
from test_engine import MIXED, random_prompts, run

KV_DTYPES = ["int8", "float8_e4m3fn"]


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_quantize_round_trip_is_within_half_a_step(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 7, 3, 64)).astype(np.float32) * rng.uniform(0.01, 30, (4, 7, 3, 1))
    x[0, 0, 0] = 0.0  # an all-zero vector must not make NaNs
    values, scales = quantize(jnp.asarray(x), dtype)
    assert values.dtype == jnp.dtype(dtype) and scales.shape == x.shape[:-1] and scales.dtype == jnp.float32
    back = np.asarray(dequantize(values, scales))
    assert np.all(np.isfinite(back)) and np.all(back[0, 0, 0] == 0)
    amax = np.abs(x).max(-1, keepdims=True)
    if dtype == "int8":  # uniform grid: error <= half a step of amax / 127
        assert np.all(np.abs(back - x) <= amax / 127 * 0.5 * (1 + 1e-5) + 1e-12)
    else:  # e4m3: 3 mantissa bits, relative error <= 2^-4 above the subnormal range
        big = np.abs(x) > amax / QMAX[dtype] * 2**-6 * 448
        assert np.all(np.abs(back - x)[big] <= np.abs(x)[big] * 2**-4 * (1 + 1e-5))
    assert np.all(np.abs(np.asarray(values, np.float32)).max(-1)[amax[..., 0] > 0] == QMAX[dtype])


def test_cache_bytes_and_prefix_copy_carry_scales():
    """int8 at head_dim 128 stores 128 + 4 bytes per token and head: 0.516x of bfloat16 (target <= 0.55x)."""
    shape = (2, 4, 2, 256, 128)
    ratio = init_cache(*shape, "int8").nbytes / init_cache(*shape, "bfloat16").nbytes
    assert ratio == pytest.approx(132 / 256) and ratio <= 0.55
    assert init_cache(*shape, "bfloat16").k_scale == ()

    cache = init_cache(1, 3, 2, 16, 8, "int8")
    k = jnp.asarray(np.random.default_rng(3).standard_normal((1, 5, 2, 8)), jnp.float32)
    cache = cache.write(0, jnp.array([1]), jnp.arange(5)[None], k, 2 * k)
    copied = copy_prefix(cache, jnp.int32(1), jnp.int32(2), jnp.int32(3))
    for values, scales in ((copied.k[0], copied.k_scale[0]), (copied.v[0], copied.v_scale[0])):
        np.testing.assert_array_equal(np.asarray(values[2, :, :3]), np.asarray(values[1, :, :3]))
        np.testing.assert_array_equal(np.asarray(scales[2, :, :3]), np.asarray(scales[1, :, :3]))
        assert not np.asarray(scales[2, :, 3:]).any()
    np.testing.assert_allclose(np.asarray(dequantize(copied.v[0][1], copied.v_scale[0][1]))[:, :5],
                               2 * np.asarray(k[0]).transpose(1, 0, 2), atol=2 * 4 / 127)


@pytest.fixture(scope="module")
def qwen3(hf_checkpoint):
    return pj.load_model(hf_checkpoint("qwen3_gqa4_headdim"))


def log_softmax(x):
    x = np.asarray(x, np.float64)
    return x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True))


@pytest.mark.parametrize("kv_dtype, impl", [("int8", "xla"), ("float8_e4m3fn", "xla"), ("int8", "pallas_interpret")])
def test_engine_logprobs_match_a_cache_free_forward_with_the_same_rounding(qwen3, kv_dtype, impl):
    """Every generated token's logprob (prefill and decode, chunked prompt) equals the full forward's."""
    prompts = random_prompts(7, (5, 37), qwen3.config.vocab_size)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    engine = Engine(qwen3, max_batch_size=2, max_seq_len=64, prefill_chunk=16, attention_impl=impl,
                    kv_dtype=kv_dtype)
    assert engine.cache.k[0].dtype == jnp.dtype(kv_dtype) and engine.cache.quantized
    for req, prompt in zip(run(engine, prompts, greedy), prompts):
        seq = prompt + req.generated_tokens
        full = log_softmax(pj.logits(qwen3, seq[:-1], kv_dtype=kv_dtype)[0])[len(prompt) - 1:]
        want = full[np.arange(len(req.generated_tokens)), req.generated_tokens]
        got = np.array([lp for lp, _ in req.logprobs])
        # The two programs compute K/V with float32 results an ulp apart, so a value within an ulp of a rounding
        # midpoint may land on neighbouring levels: measured, one such flip moves a logprob by up to 8.6e-4 (int8)
        # and 1.5e-4 (float8); the tolerance allows a few, and stays far below the gaps checked next.
        np.testing.assert_allclose(got, want, atol=3e-3 if kv_dtype == "int8" else 1e-3)
        assert req.generated_tokens == [int(t) for t in full.argmax(-1)]
        # and the rounding costs little against the float cache
        exact = log_softmax(pj.logits(qwen3, seq[:-1])[0])[len(prompt) - 1:]
        assert np.abs(np.exp(full) - np.exp(exact)).max() < (0.02 if kv_dtype == "int8" else 0.1)


def test_int8_cache_batched_equals_alone_and_prefix_reuse(qwen3):
    prompts = random_prompts(4, (3, 20, 9, 30), qwen3.config.vocab_size)
    engine = Engine(qwen3, max_batch_size=4, max_seq_len=64, prefill_chunk=16, kv_dtype="int8")
    together = run(engine, prompts, MIXED[:4])
    for prompt, params, req in zip(prompts, MIXED[:4], together):
        assert run(engine, [prompt], params)[0].generated_tokens == req.generated_tokens
    # a follow-up sharing 25 tokens of prompt 3 reuses (and on-device copies) its quantized K/V and scales
    follow = prompts[3][:25] + [1, 2, 3]
    fresh = run(Engine(qwen3, max_batch_size=4, max_seq_len=64, prefill_chunk=16, kv_dtype="int8"), [follow],
                MIXED[0])[0]
    engine.allocate_slot(BatchedRequest(9, prompts[3]))  # holds prompt 3's slot: the follow-up must copy from it
    reused = run(engine, [follow], MIXED[0], ids=["f"])[0]
    assert reused.slot_id != engine.slots.owner[9]
    engine.free_slot(9)
    assert reused.cached_prefix_len == 25 and reused.generated_tokens == fresh.generated_tokens


def test_unsupported_kv_dtype_is_a_config_error(qwen3):
    with pytest.raises(ConfigError, match="kv_dtype"):
        Engine(qwen3, max_batch_size=1, max_seq_len=32, kv_dtype="int4")
    with pytest.raises(ConfigError, match="kv_dtype"):
        pj.logits(qwen3, [1, 2], kv_dtype="int4")


@pytest.mark.parametrize("name, impl", [("qwen2_mha_untied", "xla"), ("qwen3_kv1", "pallas_interpret")])
def test_tp2_int8_cache_is_sharded_with_its_scales_and_equals_tp1(hf_checkpoint, name, impl):
    folder = hf_checkpoint(name)
    prompts = random_prompts(5, (6, 19), 250)
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = {}
    for tp in (1, 2):
        engine = Engine(pj.load_model(folder, tp=tp), max_batch_size=2, max_seq_len=64, prefill_chunk=16,
                        attention_impl=impl, kv_dtype="int8")
        if tp == 2:
            k, scale = engine.cache.k[0], engine.cache.k_scale[0]
            split = engine.model.config.num_kv_heads % 2 == 0
            assert scale.sharding.spec[:2] == k.sharding.spec[:2] == ((None, "tp") if split else (None, None))
            assert len({s.data.shape for s in scale.addressable_shards}) == 1
        tokens[tp] = [r.generated_tokens for r in run(engine, prompts, greedy)]
    assert tokens[1] == tokens[2]


def test_llm_and_cli_take_quantize_and_kv_dtype(capsys):
    with pj.LLM(max_batch_size=2, max_seq_len=128, quantize="int8", kv_dtype="int8") as llm:
        assert llm.engine.cache.quantized and llm.engine.cache.k[0].dtype == jnp.int8
        out = llm.generate("def main(", SamplingParams(max_tokens=5, temperature=0.0))[0]
        assert len(out.token_ids) == 5
    from pocketjax.serve.cli import main
    assert main(["info", "--kv-dtype", "int8", "--quantize", "int4"]) == 0
    plan = __import__("json").loads(capsys.readouterr().out)["memory_plan"]
    assert plan["details"]["kv_cache.scales"] > 0
