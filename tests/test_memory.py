"""plan_memory: the seed's figure, quantized sizes, and agreement with what load_model actually places."""
import pytest

import pocketjax as pj
from pocketjax.errors import ConfigError
from pocketjax.model.memory import GiB, MemoryPlan, per_device_bytes

# The seed's deployment: a 64-layer Qwen with 8 KV heads of 128 (Qwen2.5-32B's shape) at TP2.
QWEN_64L = dict(model_type="qwen2", vocab_size=152064, hidden_size=5120, intermediate_size=27648,
                num_hidden_layers=64, num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False)


def test_seed_figure_8_slots_of_8k_fp16_kv_at_tp2_is_8_gib():
    plan = pj.plan_memory(QWEN_64L, tp=2, dtype="float16", quantize="int4", kv_dtype="float16", slots=8,
                          max_seq_len=8192)
    # 64 layers * (k, v) * 8 heads * 128 * 2 bytes * 8192 positions * 8 slots / 2 devices = 8 GiB exactly
    assert plan.details["kv_cache.values"] == 64 * 2 * 8 * 128 * 2 * 8192 * 8 // 2 == 8 * GiB
    assert plan.kv_cache == 8 * GiB + 8 * 4  # + the per-slot lengths
    assert plan.total == plan.weights + plan.kv_cache + plan.activations
    assert isinstance(plan, MemoryPlan) and set(plan.as_dict()) >= {"weights", "kv_cache", "activations", "total"}
    assert "kv_cache" in str(plan) and "8.000 GiB" in str(plan)


def test_int8_kv_and_quantized_weights_shrink():
    bf16 = pj.plan_memory(QWEN_64L, tp=2, dtype="bfloat16")
    int8_kv = pj.plan_memory(QWEN_64L, tp=2, dtype="bfloat16", kv_dtype="int8")
    assert int8_kv.kv_cache <= 0.55 * bf16.kv_cache  # 1 byte + a float32 scale per 128 values: 0.516x
    assert int8_kv.details["kv_cache.scales"] > 0
    for mode, bound in (("int8", 0.55), ("int4", 0.33)):  # int4: 4 bits + a float32 scale and int8 zero per 32
        plan = pj.plan_memory(QWEN_64L, tp=2, dtype="bfloat16", quantize=mode)
        assert plan.details["weights.linear"] <= bound * bf16.details["weights.linear"], mode
        assert plan.details["weights.embedding+lm_head"] == bf16.details["weights.embedding+lm_head"]
        head = pj.plan_memory(QWEN_64L, tp=2, dtype="bfloat16", quantize=mode + "+head")
        assert head.weights <= bound * bf16.weights, mode


def test_kv_heads_fewer_than_tp_are_replicated():
    cfg = QWEN_64L | {"num_key_value_heads": 1}
    one = pj.plan_memory(cfg, tp=1, slots=2, max_seq_len=1024)
    two = pj.plan_memory(cfg, tp=2, slots=2, max_seq_len=1024)
    assert two.details["kv_cache.values"] == one.details["kv_cache.values"]


@pytest.mark.parametrize("quantize", [None, "int8", "int4", "int4+head8"])
@pytest.mark.parametrize("tp", [1, 2])
def test_plan_matches_what_load_model_places(hf_checkpoint, quantize, tp):
    folder = hf_checkpoint("qwen3_gqa4_headdim")
    model = pj.load_model(folder, tp=tp, quantize=quantize)
    plan = pj.plan_memory(model.config, tp=tp, dtype="float32", quantize=quantize)
    placed = per_device_bytes(model.params)
    assert set(placed.values()) == {plan.weights}, (placed, plan.weights)


def test_bad_arguments_raise_config_error():
    with pytest.raises(ConfigError, match="kv_dtype"):
        pj.plan_memory(QWEN_64L, kv_dtype="int4")
    with pytest.raises(ConfigError, match="quantize"):
        pj.plan_memory(QWEN_64L, quantize="int3")
    with pytest.raises(ConfigError, match="tp=3"):
        pj.plan_memory(QWEN_64L, tp=3)
    with pytest.raises(ConfigError, match="slots"):
        pj.plan_memory(QWEN_64L, slots=0)
