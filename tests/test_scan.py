"""The scan layout (`load_model(scan_layers=True)`: stacked weights, one `lax.scan`, a stacked KV cache) against the
unrolled one on the same checkpoint: logits, greedy engine tokens (both attention paths, quantized weights and
caches, prefix copies, TP2), warm-up, and the "auto" rule."""
from dataclasses import replace

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import pocketjax as pj
from pocketjax.engine.engine import Engine
from pocketjax.engine.sampling_params import SamplingParams
from pocketjax.errors import ConfigError
from pocketjax.model import decoder
from pocketjax.model.quant import QuantizedWeight

from test_engine import random_prompts, run

NAME = "qwen3_gqa4_headdim"  # 3 layers, QK-norm, GQA 4
ENGINE = dict(max_batch_size=3, max_seq_len=64, prefill_chunk=16)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def load(hf_checkpoint):
    """load(scan, **load_model options) -> Model, loaded once per module."""
    models = {}

    def get(scan: bool, name: str = NAME, **options) -> pj.Model:
        key = (scan, name, tuple(sorted((k, v) for k, v in options.items() if v is not None)))
        if key not in models:
            models[key] = pj.load_model(hf_checkpoint(name), scan_layers=scan, **options)
        return models[key]

    return get


@pytest.fixture(scope="module")
def greedy():
    """greedy(model, **engine options) -> greedy tokens of three prompts, then of two that extend the first one
    (the second gets its prefix copied from the first one's slot: `copy_prefix` on the cache layout under test);
    computed once per (model, options)."""
    done = {}

    def get(model: pj.Model, **options) -> list[list[int]]:
        key = (id(model), tuple(sorted((k, v) for k, v in options.items() if v is not None)))
        if key not in done:
            engine = Engine(model, **ENGINE, **options)
            prompts = random_prompts(7, (5, 16, 11), model.config.vocab_size)
            first = [r.generated_tokens for r in run(engine, prompts, GREEDY)]
            reqs = run(engine, [prompts[0] + [3, 4, 5], prompts[0] + [6, 7]], GREEDY, ids=[10, 11])
            assert [r.cached_prefix_len for r in reqs] == [5, 5]
            done[key] = first + [r.generated_tokens for r in reqs]
        return done[key]

    return get


@pytest.mark.parametrize("name", [NAME, "qwen2_mha_untied"])
def test_scan_logits_equal_unrolled(load, name):
    unrolled, scan = load(False, name), load(True, name)
    assert not unrolled.scan_layers and scan.scan_layers
    c = scan.config
    assert scan.params["layers"]["q"].shape == (c.num_layers, c.num_heads * c.head_dim, c.hidden_size)
    tokens = np.random.default_rng(1).integers(0, c.vocab_size, (2, 21))
    a, b = np.asarray(pj.logits(unrolled, tokens)), np.asarray(pj.logits(scan, tokens))
    assert np.max(np.abs(a - b)) <= 1e-6


@pytest.mark.parametrize("impl, kv_dtype, quantize", [
    ("xla", None, None), ("xla", "int8", "int8"), ("pallas_interpret", "float8_e4m3fn", "int4")])
def test_engine_greedy_scan_equals_unrolled(load, greedy, impl, kv_dtype, quantize):
    unrolled, scan = load(False, quantize=quantize), load(True, quantize=quantize)
    if quantize:
        assert isinstance(scan.params["layers"]["gate"], QuantizedWeight)
        c = scan.config
        assert scan.params["layers"]["gate"].shape == (c.num_layers, c.intermediate_size, c.hidden_size)
    expected = greedy(unrolled, attention_impl=impl, kv_dtype=kv_dtype)
    engine = Engine(scan, **ENGINE, attention_impl=impl, kv_dtype=kv_dtype)
    c = scan.config
    assert engine.cache.stacked and engine.cache.k.shape == (c.num_layers, 3, c.num_kv_heads, 64, c.head_dim)
    assert engine.cache.quantized == (kv_dtype is not None)
    assert greedy(scan, attention_impl=impl, kv_dtype=kv_dtype) == expected


@pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (conftest sets XLA_FLAGS)")
def test_tp2_scan_equals_unrolled_tp1(load, greedy):
    """Stacked weights keep their Megatron specs behind a replicated layer axis; the kernels' shard_map runs inside
    the scan on a layer slice of the sharded cache (reference: the unrolled tp=1 engine with XLA attention)."""
    model = load(True, tp=2)
    layer = model.params["layers"]
    assert layer["q"].sharding.spec == P(None, "tp", None) and layer["o"].sharding.spec == P(None, None, "tp")
    assert layer["input_norm"].sharding.spec == P(None)
    engine = Engine(model, **ENGINE, attention_impl="pallas_interpret")
    assert engine.cache.k.sharding.spec == P(None, None, "tp")
    del engine
    assert greedy(model, attention_impl="pallas_interpret") == greedy(load(False), attention_impl="xla")


def test_warmup_compiles_every_shape_of_a_scan_engine(load):
    engine = Engine(load(True), max_batch_size=1, max_seq_len=24, prefill_chunk=16, min_kv_bucket=16)
    assert engine.warmup(progress=False) > 0
    before = engine.compiled_count()
    prompts = random_prompts(3, (4, 18), engine.model.config.vocab_size)
    for prompt in prompts:
        run(engine, [prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert engine.compiled_count() == before


def test_auto_rule_and_bad_values(hf_checkpoint, load):
    config = load(False).config
    deep = replace(config, num_layers=decoder.AUTO_SCAN_MIN_LAYERS)
    assert decoder.resolve_scan_layers("auto", config) is False
    assert decoder.resolve_scan_layers("auto", deep) is True
    assert pj.load_model(hf_checkpoint(NAME)).scan_layers is False  # "auto" for 3 layers
    for bad in ("yes", 1, None):
        with pytest.raises(ConfigError, match="scan_layers"):
            pj.load_model(hf_checkpoint(NAME), scan_layers=bad)
