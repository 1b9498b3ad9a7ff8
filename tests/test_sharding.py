"""Tensor parallelism on two CPU devices: tp=2 (and 1x2 / 2x1 dp x tp meshes) reproduce tp=1, memory halves."""
import json
import os
import re
import subprocess
import sys
import textwrap
from collections import Counter
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import pocketjax as pj
from pocketjax.model import sharding
from pocketjax.model.config import ModelConfig
from pocketjax.engine.engine import Engine
from pocketjax.model.memory import per_device_bytes
from pocketjax.engine.plan import DecodePlan, PrefillPlan, Signature
from pocketjax.engine.steps import SlotState, decode_step, prefill_step
from pocketjax.errors import ConfigError
from pocketjax.engine.sampling_params import SamplingParams

from test_engine import random_prompts, run

ENGINE = dict(max_batch_size=4, max_seq_len=64, prefill_chunk=16)  # one prefill and one decode shape below
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT_LENGTHS = (5, 16, 11)
# Qwen2 with 4 kv heads (split) and an untied lm_head, Qwen3 with 2 kv heads (split) and an odd vocab (replicated),
# Qwen3 with 1 kv head (replicated) and a tied, vocab-parallel embedding. Engine tests use the two with vocab 300,
# so the sampler compiles once per placement.
CHECKPOINTS = {"qwen2_mha_untied": {}, "qwen3_gqa4_headdim": {}, "qwen3_kv1": {"vocab_size": 300}}
MESHES = {"tp1": lambda: None, "tp2": lambda: sharding.make_mesh(2),
          "1x2": lambda: sharding.make_mesh(2, dp=1), "2x1": lambda: sharding.make_mesh(1, dp=2)}

pytestmark = pytest.mark.skipif(len(jax.devices()) < 2, reason="needs 2 devices (conftest sets XLA_FLAGS)")


@pytest.fixture(scope="module")
def load(hf_checkpoint):
    """load(name, mesh_name) -> Model, loaded once per module."""
    models = {}

    def get(name: str, mesh: str = "tp1") -> pj.Model:
        if (name, mesh) not in models:
            models[name, mesh] = pj.load_model(hf_checkpoint(name, **CHECKPOINTS[name]), mesh=MESHES[mesh]())
        return models[name, mesh]

    return get


@pytest.fixture(scope="module")
def reference_tokens(load):
    """reference_tokens(name) -> (prompts, greedy tokens of the tp=1 engine), computed once."""
    done = {}

    def get(name: str):
        if name not in done:
            model = load(name)
            prompts = random_prompts(7, PROMPT_LENGTHS, model.config.vocab_size)
            done[name] = prompts, [r.generated_tokens for r in run(Engine(model, **ENGINE), prompts, GREEDY)]
        return done[name]

    return get


def rel_err(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def count_collectives(hlo_text: str) -> Counter:
    """(op, shape) -> count of the collectives in compiled HLO text (`jit(f).lower(...).compile().as_text()`)."""
    ops = re.findall(r"= (.+?) (all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute)(?:-start)?\(",
                     hlo_text)
    return Counter((op, shape) for shape, op in ops)


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_tp2_logits_match_tp1(load, name):
    one, two = load(name), load(name, "tp2")
    tokens = np.random.default_rng(3).integers(0, one.config.vocab_size, (4, 17))  # the shape the 2-D test reuses
    assert rel_err(pj.logits(two, tokens), pj.logits(one, tokens)) <= 1e-5
    layer = two.params["layers"][0]
    kv_split = one.config.num_kv_heads % 2 == 0
    # linears are [out, in]: column-parallel splits axis 0, row-parallel axis 1
    assert layer["q"].sharding.spec == P("tp", None) and layer["o"].sharding.spec == P(None, "tp")
    assert layer["k"].sharding.spec == (P("tp", None) if kv_split else P())
    assert layer["gate"].sharding.spec == P("tp", None) and layer["down"].sharding.spec == P(None, "tp")
    assert layer["input_norm"].sharding.spec == P()
    assert two.params["embed"].sharding.spec == (P("tp", None) if one.config.vocab_size % 2 == 0 else P())


def test_param_bytes_per_device_halve(load):
    one, two = load("qwen2_mha_untied"), load("qwen2_mha_untied", "tp2")  # even vocab: everything big is split
    total = sum(per_device_bytes(one.params).values())
    per_device = per_device_bytes(two.params)
    assert len(per_device) == 2 and len(set(per_device.values())) == 1
    assert 0.5 <= per_device[jax.devices()[0]] / total < 0.51, (per_device, total)
    # An odd vocab (301) is replicated: each device holds half the rest plus the whole embedding and lm_head.
    odd_one, odd_two = load("qwen3_gqa4_headdim"), load("qwen3_gqa4_headdim", "tp2")
    vocab = sum(odd_one.params[k].nbytes for k in ("embed", "lm_head"))
    norms = sum(a.nbytes for a in jax.tree.leaves(odd_one.params) if a.ndim == 1)
    expected = (sum(per_device_bytes(odd_one.params).values()) - vocab - norms) / 2 + vocab + norms
    assert per_device_bytes(odd_two.params)[jax.devices()[1]] == expected


@pytest.mark.parametrize("name, impl", [("qwen2_mha_untied", "xla"), ("qwen3_kv1", "pallas_interpret")])
def test_engine_greedy_tp2_equals_tp1(load, reference_tokens, name, impl):
    """Plain jit over sharded params and cache; the kernels run per device on local heads inside shard_map."""
    prompts, expected = reference_tokens(name)
    model = load(name, "tp2")
    engine = Engine(model, attention_impl=impl, **ENGINE)
    assert engine.impl == impl
    assert [r.generated_tokens for r in run(engine, prompts, GREEDY)] == expected
    # donation kept the cache in place and sharded on kv heads (replicated for a single kv head)
    heads = P(None, "tp") if model.config.num_kv_heads % 2 == 0 else P()
    assert all(a.sharding.spec == heads and len(a.addressable_shards) == 2 for a in engine.cache.k + engine.cache.v)
    if impl == "xla":  # XLA inserted exactly the Megatron collectives: 2 all-reduces of [rows, 1, hidden] a layer,
        c = model.config  # plus 1 for the vocab-parallel embedding lookup; no gathers
        compiled = engine.lower(Signature("decode", 4, kv_len=64)).compile()
        collectives = count_collectives(compiled.as_text())
        # the row-parallel products reduce [hidden, rows] (computed as w @ x.T on CPU, see layers.linear)
        assert collectives == {("all-reduce", f"f32[4,1,{c.hidden_size}]{{2,1,0}}"): 1,
                               ("all-reduce", f"f32[{c.hidden_size},4]{{1,0}}"): 2 * c.num_layers}


def test_scheduler_and_llm_run_unchanged_under_tp2(hf_checkpoint, reference_tokens):
    llm_module = pytest.importorskip("pocketjax.serve.llm")
    prompts, expected = reference_tokens("qwen2_mha_untied")
    llm = llm_module.LLM(hf_checkpoint("qwen2_mha_untied"), tp=2, attention_impl="xla", **ENGINE)
    assert sharding.mesh_tp(llm.model.mesh) == 2
    scheduler = llm.scheduler  # stepped by hand, one budget for all prompts: the engine test's shapes, no compiles
    scheduler.prefill_token_budget = sum(PROMPT_LENGTHS)
    handles = [scheduler.submit(p, GREEDY) for p in prompts]
    while scheduler.step():
        pass
    assert [h.result(timeout=0).token_ids for h in handles] == expected


@pytest.mark.parametrize("mesh", ["1x2", "2x1"])
def test_dp_tp_mesh_prefill_and_decode(load, mesh):
    """A ("dp", "tp") mesh: params replicated over dp, each dp replica holds (and serves) its own slots."""
    one, model = load("qwen2_mha_untied"), load("qwen2_mha_untied", mesh)
    c = model.config
    prompts = random_prompts(7, PROMPT_LENGTHS, c.vocab_size)
    lengths = np.array([len(p) for p in prompts] + [0], np.int32)
    tokens = np.zeros((4, 16), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, :len(p)] = p
    slots, zeros = np.arange(4, dtype=np.int32), np.zeros(4, np.int32)
    cache = sharding.init_sharded_cache(model.mesh, c.num_layers, 4, c.num_kv_heads, 64, c.head_dim, model.dtype)
    # 1x2 runs the kernels (shard_map manual over "tp" only, "dp" left to XLA); 2x1 the XLA attention
    steps = dict(config=c, impl="pallas_interpret" if mesh == "1x2" else "xla")
    cache, first, _, _ = prefill_step(model.params, cache, PrefillPlan(tokens, slots, zeros, lengths, kv_len=64), **steps)
    after = np.asarray(first).argmax(-1).astype(np.int32)
    state = SlotState.zeros(4, c.vocab_size).advance(slots, after, lengths, zeros)  # as the first sampler leaves it
    cache, second, _ = decode_step(model.params, cache, state, DecodePlan(slots, lengths > 0, kv_len=64, dense=True),
                                **steps)
    layer = NamedSharding(model.mesh, P("dp", "tp"))  # 1x2: kv heads split; 2x1: slots split (dp of size 1 = P())
    assert all(a.sharding.is_equivalent_to(layer, 4) for a in cache.k + cache.v)
    assert cache.lengths.sharding.is_equivalent_to(NamedSharding(model.mesh, P("dp")), 1)
    per_device = {(2, 4, 64, 16) if mesh == "2x1" else (4, 2, 64, 16)}
    assert {s.data.shape for s in cache.k[0].addressable_shards} == per_device
    full = np.concatenate([tokens, np.zeros((4, 1), np.int32)], axis=1)
    full[np.arange(4), lengths] = after
    ref = np.asarray(pj.logits(one, full))
    rows = np.arange(3)
    assert rel_err(np.asarray(first)[rows], ref[rows, lengths[rows] - 1]) <= 1e-5
    assert rel_err(np.asarray(second)[rows], ref[rows, lengths[rows]]) <= 1e-5
    if mesh == "2x1":
        with pytest.raises(ConfigError, match="3 slots cannot be split over dp=2"):
            sharding.cache_shardings(model.mesh, 1, 3, c.num_kv_heads)


def test_config_errors_name_the_numbers(hf_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="tp=3 needs 3 devices, but only 2"):
        sharding.make_mesh(3)
    with pytest.raises(ConfigError, match="dp=2 x tp=2 needs 4 devices, but only 2"):
        sharding.make_mesh(2, dp=2)
    with pytest.raises(ConfigError, match="tp=3 needs 3 devices"):
        pj.load_model(hf_checkpoint("qwen3_kv1", **CHECKPOINTS["qwen3_kv1"]), tp=3)
    config = json.loads((hf_checkpoint("qwen3_kv1", **CHECKPOINTS["qwen3_kv1"]) / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_attention_heads": 3}))
    with pytest.raises(ConfigError, match="tp=2 does not divide num_attention_heads=3"):
        pj.load_model(tmp_path, tp=2)  # refused before any tensor is read
    with pytest.raises(ConfigError, match="contradicts"):
        pj.load_model(hf_checkpoint("qwen3_kv1", **CHECKPOINTS["qwen3_kv1"]), tp=2, mesh=sharding.make_mesh(1))
    base = dict(model_type="qwen3", vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                head_dim=16)
    with pytest.raises(ConfigError, match="tp=2 and num_key_value_heads=3"):
        sharding.check_tp(ModelConfig.from_dict({**base, "num_attention_heads": 6, "num_key_value_heads": 3}), 2)
    # kv heads fewer than tp but dividing it are replicated; an MLP width tp does not divide is replicated
    config = ModelConfig.from_dict({**base, "num_attention_heads": 8, "num_key_value_heads": 2,
                                    "intermediate_size": 90})
    sharding.check_tp(config, 4)
    assert sharding.param_spec(("layers", 0, "k"), config, 4) == P()
    assert sharding.param_spec(("layers", 0, "q_bias"), config, 4) == P("tp")
    assert sharding.param_spec(("layers", 0, "gate"), config, 4) == P()
    assert sharding.param_spec(("embed",), config, 4) == P("tp", None)


REPLICATED_KV = """
import jax, numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
from pallas_kernels import reference
from pocketjax.model import sharding

mesh = sharding.make_mesh(4)
rng = np.random.default_rng(0)
S, HQ, HKV, T, D = 2, 8, 2, 32, 16
k, v = (rng.standard_normal((S, HKV, T, D)).astype(np.float32) for _ in range(2))
put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
kr, vr = put(k, P()), put(v, P())
q = rng.standard_normal((S, HQ, D)).astype(np.float32)
lengths = np.array([7, 30], np.int32)
decode = jax.jit(lambda q, k, v, n: sharding.attention_over_heads(
    lambda q, kv, n, s: reference.decode_attention(q, *kv, n, slots=s), q, (k, v), n, None))
got, want = decode(put(q, P(None, "tp")), kr, vr, lengths), reference.decode_attention(q, k, v, lengths)
assert got.sharding.spec == P(None, "tp"), got.sharding
np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
qp = rng.standard_normal((S, 8, HQ, D)).astype(np.float32)
starts, qlen = np.array([3, 20], np.int32), np.array([8, 5], np.int32)
prefill = jax.jit(lambda q, k, v, s, n: sharding.attention_over_heads(
    lambda q, kv, s, n, rows: reference.prefill_attention(q, *kv, s, n, slots=rows), q, (k, v), s, n, None))
got = prefill(put(qp, P(None, None, "tp")), kr, vr, starts, qlen)
np.testing.assert_allclose(np.asarray(got), np.asarray(reference.prefill_attention(qp, k, v, starts, qlen)),
                           rtol=1e-5, atol=1e-5)
print("ok")
"""


def test_kernels_with_replicated_kv_heads_on_four_devices():
    """kv_heads=2 < tp=4: each device attends with the kv head its query heads share (needs 4 devices: subprocess).

    The per-device kernel is the reference (same signature as the Pallas kernels; compiles fast): what is tested is
    the shard_map around it.
    """
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(REPLICATED_KV)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
