"""ModelConfig parsing in both spellings, RoPE scaling parity with transformers, and ConfigError cases."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from pocketjax.model.config import ModelConfig, QuantizationConfig, rope_frequencies
from pocketjax.model.layers import rope_tables
from pocketjax.errors import ConfigError

from conftest import oracle

torch = oracle("torch")
transformers = oracle("transformers")

QWEN3_06B = {  # as released (transformers 4 spelling)
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "intermediate_size": 3072, "max_position_embeddings": 40960, "model_type": "qwen3",
    "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}


def test_released_qwen3_config():
    c = ModelConfig.from_dict(QWEN3_06B)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.group_size) == (28, 16, 8, 128, 2)
    assert c.qk_norm and not c.attention_bias and c.tie_word_embeddings and c.dtype == "bfloat16"
    assert c.rope.theta == 1e6 and c.rope.rope_type == "default" and c.eos_token_ids == (151645,)
    assert abs(c.num_params() - 596_049_920) < 1  # Qwen3-0.6B's published count (tied)


def test_transformers5_spelling_equals_released():
    new = {k: v for k, v in QWEN3_06B.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    new |= {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000}, "dtype": "bfloat16"}
    assert ModelConfig.from_dict(new) == ModelConfig.from_dict(QWEN3_06B)


def test_qwen2_has_bias_and_derived_head_dim():
    cfg = {**QWEN3_06B, "model_type": "qwen2", "hidden_size": 896, "num_attention_heads": 14,
           "num_key_value_heads": 2}
    cfg.pop("head_dim")
    cfg.pop("attention_bias")
    c = ModelConfig.from_dict(cfg)
    assert c.attention_bias and not c.qk_norm and c.head_dim == 64


@pytest.mark.parametrize("field,value,match", [
    ("model_type", "llama", "model_type"),
    ("num_key_value_heads", 3, "num_key_value_heads"),
    ("hidden_act", "gelu", "hidden_act"),
    ("torch_dtype", "int8", "torch_dtype"),
    ("rms_norm_eps", -1.0, "rms_norm_eps"),
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope_scaling"),
    ("rope_scaling", {"type": "yarn"}, "factor"),
    ("use_sliding_window", True, "use_sliding_window"),
    ("head_dim", 0, "head_dim"),
])
def test_bad_field_raises_config_error_naming_it(field, value, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict({**QWEN3_06B, field: value})


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers", "model_type"])
def test_missing_field_raises(field):
    cfg = dict(QWEN3_06B)
    cfg.pop(field)
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(cfg)


def test_contradictions_raise():
    with pytest.raises(ConfigError, match="rope_theta"):
        ModelConfig.from_dict({**QWEN3_06B, "rope_parameters": {"rope_type": "default", "rope_theta": 10000}})
    with pytest.raises(ConfigError, match="disagree"):
        ModelConfig.from_dict({**QWEN3_06B, "dtype": "float16"})
    with pytest.raises(ConfigError, match="attention_bias"):
        ModelConfig.from_dict({**QWEN3_06B, "model_type": "qwen2", "attention_bias": False})


def test_missing_or_corrupt_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.from_folder(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_folder(tmp_path)


@pytest.mark.parametrize("scaling", [
    None,
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
    {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8192, "mscale": 0.707,
     "mscale_all_dim": 1.0},
])
def test_rope_frequencies_match_transformers(scaling):
    cfg = {**QWEN3_06B, "rope_scaling": scaling, "max_position_embeddings": 131072}
    config = ModelConfig.from_dict(cfg)
    ours, factor = rope_frequencies(config)
    hf_cfg = transformers.Qwen3Config(**{k: v for k, v in cfg.items() if k not in ("architectures",)})
    rope = transformers.models.qwen3.modeling_qwen3.Qwen3RotaryEmbedding(hf_cfg)
    np.testing.assert_allclose(ours, rope.inv_freq.numpy(), rtol=1e-6)
    assert factor == pytest.approx(rope.attention_scaling, rel=1e-7)

    # Long positions: the angle pos * inv_freq is formed in float32 (rounded by up to half a float32 step at its
    # magnitude: ~0.004 rad at 1e5), then a vectorized cos reduces it to [-pi, pi], which may cost more steps
    # (measured on an AMD EPYC: XLA:CPU's cos 0.50 of a step, torch's 2.2). So the engine's tables are compared with
    # the float64 cos of the same product to one float32 step of the angle plus cos's own rounding, and with
    # transformers' cosines only to the sum of both libraries' errors: two float32 results may differ by steps, and
    # which way they fall depends on the CPU and the library.
    pos = np.arange(0, 100000, 997)
    angle = pos[:, None].astype(np.float64) * np.concatenate([ours, ours]).astype(np.float64)
    step = np.spacing(angle.astype(np.float32)).astype(np.float64) * factor
    cos_rounding = 4 * np.finfo(np.float32).eps * factor
    engine_cos, engine_sin = (np.asarray(t, np.float64) for t in rope_tables(config, jnp.asarray(pos), jnp.float32))
    for name, got, want in [("cos", engine_cos, np.cos(angle) * factor), ("sin", engine_sin, np.sin(angle) * factor)]:
        err = np.abs(got - want)
        assert np.all(err <= step + cos_rounding), f"engine {name}: error {err.max():.3g} rad, over one float32 step"
    hf_cos, hf_sin = (t[0].numpy() for t in rope(torch.zeros(1, dtype=torch.float32), torch.as_tensor(pos)[None]))
    np.testing.assert_array_less(np.abs(engine_cos - hf_cos), 4 * step + 2 * cos_rounding)
    np.testing.assert_array_less(np.abs(engine_sin - hf_sin), 4 * step + 2 * cos_rounding)


def test_config_json_roundtrip_of_saved_checkpoint(hf_checkpoint):
    folder = hf_checkpoint("qwen3_gqa4_headdim")
    raw = json.loads((folder / "config.json").read_text())
    c = ModelConfig.from_folder(folder)
    assert c.head_dim == raw["head_dim"] == 32 and c.hidden_size == 64 and c.num_heads * c.head_dim == 256


def test_quantization_config_parsed_once_into_a_typed_scheme():
    assert ModelConfig.from_dict(QWEN3_06B).quantization is None
    awq = ModelConfig.from_dict({**QWEN3_06B, "quantization_config": {"quant_method": "AWQ", "w_bit": 4,
                                                                      "q_group_size": 64, "version": "GEMM"}})
    assert awq.quantization == QuantizationConfig("awq", 4, 64, zero_offset=0)
    assert awq == ModelConfig.from_dict(QWEN3_06B)  # storage, not architecture: jitted functions compile once
    for fmt, offset in (("gptq", 1), ("gptq_v2", 0)):
        qc = {"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": True, "checkpoint_format": fmt}
        gptq = ModelConfig.from_dict({**QWEN3_06B, "quantization_config": qc}).quantization
        assert gptq == QuantizationConfig("gptq", 4, -1, zero_offset=offset, desc_act=True) and gptq.group_for(96) == 96
    for change, match in (({"group_size": 0}, "group_size=0"), ({"version": "gemv"}, "version='gemv'"),
                          ({"zero_point": False}, "zero_point=false")):
        with pytest.raises(ConfigError, match=match):
            ModelConfig.from_dict({**QWEN3_06B, "quantization_config": {"quant_method": "awq", "bits": 4} | change})
    with pytest.raises(ConfigError, match="JSON object"):
        ModelConfig.from_dict({**QWEN3_06B, "quantization_config": "awq"})
