"""Weight-only quantization: round-trip bounds, packing layouts, quantized logits, AWQ/GPTQ checkpoints."""
import dataclasses
import json
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pocketjax as pj
from pocketjax.model import cpu_kernels, decoder, layers, prequantized, quant
from pocketjax.model.checkpoint import open_checkpoint, write_safetensors
from pocketjax.errors import ConfigError
from pocketjax.model.prequantized import AWQ_ORDER
from pocketjax.model.quant import QuantizedWeight
from benchmarks.bench_quant import one_digit


def rel_err(a, b) -> float:
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def rel_rms(a, b) -> float:
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


# ---- round trips -------------------------------------------------------------------------------------------------
def test_int8_round_trip_within_half_a_step_per_channel():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((256, 96)).astype(np.float32) * np.logspace(-3, 1, 96, dtype=np.float32)
    w[:, 5] = 0.0
    qw = quant.quantize(w.T, 8)  # [out, in]: 96 channels
    assert qw.values.dtype == np.int8 and qw.values.shape == (96, 256) and qw.scale.shape == (96, 1)
    assert qw.zero is None and np.abs(qw.values).max() <= 127
    err = np.abs(w - np.asarray(quant.dequantize(qw)).T)
    assert np.all(err <= qw.scale.T / 2 * (1 + 1e-6)), float((err / qw.scale.T).max())
    assert np.all(err[:, 5] == 0)


def range_form_error(groups):
    """Each group's squared error under the first int4 form: [min(w, 0), max(w, 0)] on 15 steps, nearest level."""
    lo, hi = np.minimum(groups.min(-1), 0), np.maximum(groups.max(-1), 0)
    scale = np.where(hi > lo, (hi - lo) / np.float32(15), np.float32(1)).astype(np.float32)
    zero = np.rint(-lo / scale)
    q = np.clip(np.rint(groups / scale[..., None]) + zero[..., None], 0, 15)
    return np.square(groups - (q - zero[..., None]) * scale[..., None]).sum(-1)


def test_int4_fits_each_group_at_least_as_well_as_its_range():
    """The int4 fit (grids searched, least-squares scale) never does worse per group than rounding on the group's
    range with 0 in it, does strictly better on most groups and on a group that does not hold 0, and keeps constant
    and zero groups exact."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((384, 64)).astype(np.float32)
    w[:128, 0] = np.abs(w[:128, 0]) + 3.0  # a group entirely positive (asymmetric range)
    w[128:256, 1] = -0.25  # a constant group
    w[256:, 2] = 0.0
    qw = quant.quantize(w.T, 4, 128)  # [out, in]: 64 channels, 3 groups of 128 inputs
    assert qw.values.shape == (64, 192) and qw.values.dtype == np.uint8
    assert qw.scale.shape == qw.zero.shape == (64, 3) and qw.group_size == 128 and qw.shape == (64, 384)
    assert int(quant.unpack_int4(qw.values, 3).max()) <= 15 and qw.zero.dtype == np.int8
    groups = w.T.reshape(64, 3, 128)
    err = np.square(groups - np.asarray(quant.dequantize(qw)).reshape(64, 3, 128)).sum(-1)
    first = range_form_error(groups)
    assert np.all(err <= first * (1 + 1e-5) + 1e-12)
    assert (err < first * 0.99).mean() > 0.5 and err[0, 0] < first[0, 0] * 0.5
    assert qw.zero[0, 0] < 0  # the positive group's grid starts above 0
    assert err[1, 1] == 0 and err[2, 2] == 0


@pytest.mark.parametrize("in_features,group", [(128, 128), (1024, 128), (64, 64), (96, 96), (200, 100), (1000, 100),
                                               (210, 70), (262, 262), (16, 16)])
def test_int4_group_size_falls_back_to_a_divisor_or_the_whole_dim(in_features, group):
    assert quant.group_size_for(in_features, 128) == group
    assert quant.group_size_for(1024) == quant.GROUP_SIZE == 32 and quant.group_size_for(96) == 32


# ---- packing -----------------------------------------------------------------------------------------------------
def reference_pack_awq(q: np.ndarray) -> np.ndarray:
    """AutoAWQ WQLinear_GEMM.from_linear's loop: word col, nibble i <- column col * 8 + order_map[i]."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    packed = np.zeros((q.shape[0], q.shape[1] // 8), np.uint32)
    for col in range(q.shape[1] // 8):
        for i in range(8):
            packed[:, col] |= q[:, col * 8 + order_map[i]].astype(np.uint32) << (i * 4)
    return packed.view(np.int32)


def reference_pack_gptq_rows(q: np.ndarray) -> np.ndarray:
    """auto-gptq QuantLinear.pack's qweight loop: word row r, nibble j <- input row 8r + j."""
    packed = np.zeros((q.shape[0] // 8, q.shape[1]), np.uint32)
    for row in range(q.shape[0] // 8):
        for j in range(8):
            packed[row] |= q[row * 8 + j].astype(np.uint32) << (4 * j)
    return packed.view(np.int32)


def reference_pack_gptq_cols(z: np.ndarray) -> np.ndarray:
    """auto-gptq QuantLinear.pack's qzeros loop: word col c, nibble j <- column 8c + j."""
    return reference_pack_gptq_rows(z.T).T.copy()


def test_pack_unpack_identity_and_documented_orders():
    rng = np.random.default_rng(2)
    q = rng.integers(0, 16, (16, 24)).astype(np.uint8)
    for groups in (1, 2, 3):
        np.testing.assert_array_equal(quant.unpack_int4(quant.pack_int4(q, groups), groups), q)
        np.testing.assert_array_equal(np.asarray(quant.unpack_int4(jnp.asarray(quant.pack_int4(q, groups)), groups)), q)
    packed = quant.pack_int4(q, 2).reshape(16, 2, 6)  # groups of 12 columns: byte j holds columns j and j + 6
    np.testing.assert_array_equal(packed & 15, q.reshape(16, 2, 12)[..., :6])
    np.testing.assert_array_equal(packed >> 4, q.reshape(16, 2, 12)[..., 6:])
    with pytest.raises(ConfigError, match="even groups"):
        quant.pack_int4(q, 8)  # groups of 3
    for axis in (0, 1):
        for order in (None, AWQ_ORDER):
            words = prequantized.pack_nibbles(q, axis, order)
            assert words.dtype == np.int32 and words.shape[axis] == q.shape[axis] // 8
            np.testing.assert_array_equal(prequantized.unpack_nibbles(words, axis, order), q)
    np.testing.assert_array_equal(prequantized.pack_nibbles(q, 1, AWQ_ORDER), reference_pack_awq(q))
    np.testing.assert_array_equal(prequantized.pack_nibbles(q, 0), reference_pack_gptq_rows(q))
    np.testing.assert_array_equal(prequantized.pack_nibbles(q, 1), reference_pack_gptq_cols(q))
    ramp = np.arange(8, dtype=np.uint8)[None]
    assert prequantized.pack_nibbles(ramp, 1, AWQ_ORDER).view(np.uint32)[0, 0] == 0x75316420  # nibble i = AWQ_ORDER[i]
    assert prequantized.pack_nibbles(ramp, 1).view(np.uint32)[0, 0] == 0x76543210


def test_quantized_weight_is_a_pytree_through_jit():
    qw = quant.quantize(np.random.default_rng(3).standard_normal((16, 64)), 4)
    leaves, treedef = jax.tree.flatten(qw)
    assert len(leaves) == 3  # values, scale, zero; bits is static
    x = jnp.ones((2, 64), jnp.float32)
    want = np.asarray(x) @ np.asarray(quant.dequantize(qw)).T
    for product in (quant.matmul, layers.linear):
        y = jax.jit(product)(x, jax.tree.map(jnp.asarray, qw))
        np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


# ---- quantize at load --------------------------------------------------------------------------------------------
TOKENS = np.random.default_rng(4).integers(0, 257, size=(2, 24))  # one shape: every float model compiles once


@pytest.mark.parametrize("name,modes", [("qwen3_gqa4_headdim", ("int8", "int4")),
                                        ("qwen2_gqa2_tied", ("int4+head", "int4+head8"))])
def test_quantized_logits_close_to_float(hf_checkpoint, name, modes):
    folder = hf_checkpoint(name)
    ref = np.asarray(pj.logits(pj.load_model(folder), TOKENS))
    # Stated bounds, for these random models whose weights (std 0.08) make logits sensitive: int8's step is ~1/127 of
    # a channel's absmax (0.3-0.6% RMS per matrix) -> logits within 3% RMS; int4's is ~1/15 of a group's range
    # (~8% RMS per matrix, compounding over 2-3 layers) -> within 30%. int4+head also quantizes embedding/lm_head,
    # int4+head8 to int8.
    bounds = {"int8": 0.03, "int4": 0.30, "int4+head": 0.35, "int4+head8": 0.30}
    for mode in modes:
        model = pj.load_model(folder, quantize=mode)
        assert model.dtype == jnp.float32
        assert all(isinstance(p[k], QuantizedWeight) for p in model.params["layers"] for k in quant.LINEAR_NAMES)
        head = quant.parse_mode(mode)[1]
        assert isinstance(model.params["embed"], QuantizedWeight) == (head is not None)
        assert head is None or model.params["embed"].bits == head
        err = rel_rms(np.asarray(pj.logits(model, TOKENS)), ref)
        assert err < bounds[mode], (mode, err)


def test_dequantization_is_per_matmul_and_local_under_tp():
    """A chain of quantized matmuls holds one transient float32 weight at a time (XLA:CPU hoisted every
    dequantization to the start before `quant.after`), and a row-parallel matmul (x and rows split over "tp") runs
    without gathering x: the only collective is the all-reduce of the partial products."""
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    rng = np.random.default_rng(6)
    for bits in (8, 4):
        ws = [jax.tree.map(jnp.asarray, quant.quantize(rng.standard_normal((256, 256)), bits)) for _ in range(6)]
        x = jnp.ones((4, 256), jnp.float32)

        def chain(x, ws):
            for w in ws:
                x = jnp.tanh(quant.matmul(x, w))
            return x

        temp = jax.jit(chain).lower(x, ws).compile().memory_analysis().temp_size_in_bytes
        assert temp <= 2 * 256 * 256 * 4, (bits, temp)  # hoisted: 6 x 256 KiB

        mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
        cols, whole = NamedSharding(mesh, P(None, "tp")), NamedSharding(mesh, P())
        w = jax.tree.map(lambda a: jax.device_put(a, whole if a.shape[1] % 2 else cols), ws[0])  # int8 scale [out, 1]
        xs = jax.device_put(x, NamedSharding(mesh, P(None, "tp")))
        hlo = jax.jit(quant.matmul).lower(xs, w).compile().as_text()
        assert "all-gather" not in hlo and "all-reduce" in hlo, bits


def test_quantized_weights_shrink(hf_checkpoint):
    folder = hf_checkpoint("qwen3_gqa4_headdim")
    full = pj.load_model(folder)
    for mode, bound in (("int8", 0.55 / 2), ("int4", 0.33 / 2)):  # vs float32, i.e. 0.55x / 0.33x of bfloat16 (int4:
        # 4 bits + a float32 scale and an int8 zero per group of 32)
        model = pj.load_model(folder, quantize=mode)
        ours = sum(p[k].nbytes for p in model.params["layers"] for k in quant.LINEAR_NAMES)
        theirs = sum(full.params["layers"][i][k].nbytes for i in range(3) for k in quant.LINEAR_NAMES)
        assert ours <= bound * theirs, (mode, ours / theirs)


def test_unknown_quantize_and_bits_raise_config_error(hf_checkpoint):
    folder = hf_checkpoint("qwen2_gqa2_tied")
    for bad in ("int3", "fp8", "INT8", ""):
        with pytest.raises(ConfigError, match="quantize"):
            pj.load_model(folder, quantize=bad)
    with pytest.raises(ConfigError, match="bits"):
        quant.quantize(np.ones((8, 8)), 3)


# ---- AWQ / GPTQ checkpoints --------------------------------------------------------------------------------------
GROUP = 32
CASES = {  # name -> (method, checkpoint_format, sym, desc_act, source); same source + desc_act: one compile
    "awq": ("awq", None, False, False, "qwen3_gqa4_headdim"),
    "gptq_sym": ("gptq", "gptq", True, False, "qwen3_gqa4_headdim"),
    "gptq_asym_desc_act": ("gptq", "gptq", False, True, "qwen2_gqa2_tied"),
    "gptq_v2_asym_desc_act": ("gptq", "gptq_v2", False, True, "qwen2_gqa2_tied"),
}


def write_prequantized(src, dst_quant, dst_float, method, fmt, sym, desc_act, seed=0) -> dict[str, np.ndarray]:
    """Replace every *_proj.weight of a float checkpoint by random int4 (q, zero, fp16 scale) packed in the method's
    layout; write the same weights dequantized as a float checkpoint. Returns {name: intended [in, out] weight}."""
    rng = np.random.default_rng(seed)
    floats = {name: np.asarray(f.tensor(name)) for name, f in open_checkpoint(src).items()}
    packed, intended = dict(floats), {}
    for name, w in floats.items():
        if not name.endswith("_proj.weight"):
            continue
        out_f, in_f = w.shape
        groups = in_f // GROUP
        g_idx = rng.permutation(in_f) // GROUP if desc_act else np.arange(in_f) // GROUP
        q = rng.integers(0, 16, (in_f, out_f)).astype(np.uint8)
        lowest = 1 if fmt == "gptq" else 0  # v1 stores zero - 1, so its zeros start at 1
        zero = np.full((groups, out_f), 8) if sym else rng.integers(lowest, 16, (groups, out_f))
        zero = zero.astype(np.uint8)
        scale = rng.uniform(0.01, 0.025, (groups, out_f)).astype(np.float16)
        intended[name] = (q.astype(np.float32) - zero[g_idx]) * scale[g_idx].astype(np.float32)
        prefix = name.removesuffix(".weight")
        del packed[name]
        if method == "awq":
            packed[prefix + ".qweight"] = reference_pack_awq(q)
            packed[prefix + ".qzeros"] = reference_pack_awq(zero)
        else:
            packed[prefix + ".qweight"] = reference_pack_gptq_rows(q)
            packed[prefix + ".qzeros"] = reference_pack_gptq_cols(zero - (1 if fmt == "gptq" else 0))
            packed[prefix + ".g_idx"] = g_idx.astype(np.int32)
        packed[prefix + ".scales"] = scale
    cfg = json.loads((src / "config.json").read_text())
    qc = {"quant_method": method, "bits": 4, "group_size": GROUP}
    qc |= {"zero_point": True, "version": "gemm"} if method == "awq" else {"sym": sym, "desc_act": desc_act,
                                                                          "checkpoint_format": fmt}
    for folder, tensors, extra in ((dst_quant, packed, {"quantization_config": qc}),
                                   (dst_float, floats | {n: w.T.copy() for n, w in intended.items()}, {})):
        folder.mkdir()
        write_safetensors(folder / "model.safetensors", tensors)
        (folder / "config.json").write_text(json.dumps(cfg | extra))
    return intended


@pytest.mark.parametrize("case", sorted(CASES))
def test_prequantized_checkpoint_dequantizes_exactly_and_matches_float(hf_checkpoint, tmp_path, case):
    method, fmt, sym, desc_act, source = CASES[case]
    intended = write_prequantized(hf_checkpoint(source), tmp_path / "q", tmp_path / "f", method, fmt, sym, desc_act)
    model = pj.load_model(tmp_path / "q")
    for n, p in enumerate(model.params["layers"]):
        for ours, hf in (("q", "self_attn.q_proj"), ("o", "self_attn.o_proj"), ("down", "mlp.down_proj")):
            w = p[ours]
            assert isinstance(w, QuantizedWeight) and w.bits == 4 and w.group_size == GROUP
            assert (w.perm is not None) == desc_act
            want = intended[f"model.layers.{n}.{hf}.weight"]
            rows = np.arange(want.shape[0]) if w.perm is None else np.asarray(w.perm)
            np.testing.assert_array_equal(np.asarray(quant.dequantize(w)), want[rows].T)
    ours = np.asarray(pj.logits(model, TOKENS))
    ref = np.asarray(pj.logits(pj.load_model(tmp_path / "f"), TOKENS))
    # The native int4 kernel rounds activations to 16 bits per row (largest error measured 1.3e-4); XLA's dequantized
    # product keeps them whole
    assert rel_err(ours, ref) <= (5e-4 if cpu_kernels.available() else 1e-5), rel_err(ours, ref)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("case", ["awq", "gptq_asym_desc_act"])
def test_plan_memory_of_a_prequantized_checkpoint_is_what_load_model_places(hf_checkpoint, tmp_path, case, tp):
    """plan_memory of an AWQ/GPTQ config counts the int4 leaves (and desc_act's permutation) that load_model places,
    not the float weights: equal to per_device_bytes of the loaded model on every device."""
    from pocketjax.model.memory import per_device_bytes
    method, fmt, sym, desc_act, source = CASES[case]
    write_prequantized(hf_checkpoint(source), tmp_path / "q", tmp_path / "f", method, fmt, sym, desc_act)
    model = pj.load_model(tmp_path / "q", tp=tp)
    plan = pj.plan_memory(model.config, tp=tp, dtype="float32")
    assert set(per_device_bytes(model.params).values()) == {plan.weights}
    float_plan = pj.plan_memory(pj.load_model(tmp_path / "f").config, tp=tp, dtype="float32")
    assert plan.details["weights.linear"] < 0.25 * float_plan.details["weights.linear"]
    with pytest.raises(ConfigError, match="already"):
        pj.plan_memory(model.config, quantize="int8")


def test_prequantized_checkpoint_config_errors(hf_checkpoint, tmp_path):
    src = hf_checkpoint("qwen2_gqa2_tied")
    write_prequantized(src, tmp_path / "q", tmp_path / "f", "gptq", "gptq", True, False)
    with pytest.raises(ConfigError, match="already gptq"):
        pj.load_model(tmp_path / "q", quantize="int8")
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    for change, match in (({"bits": 8}, "bits=8"), ({"quant_method": "exl2"}, "quant_method"),
                          ({"checkpoint_format": "marlin"}, "checkpoint_format")):
        bad = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tmp_path / "q", bad)
        (bad / "config.json").write_text(json.dumps(cfg | {"quantization_config": cfg["quantization_config"] | change}))
        with pytest.raises(ConfigError, match=match):
            pj.load_model(bad)


@pytest.mark.parametrize("rows", [1, 2, 7, 80])
def test_int8_product_is_an_integer_dot_within_the_activation_rounding(rows):
    """On CPU, per-channel int8 weights multiply as s8 x s8 -> s32 with each row of x as two int8 digits: its error
    against x @ dequantize(W) is at most half a step of the second digit (absmax / 127 / 254 / 2) times
    sum_k |W[k, j]|, one digit's bound / 254."""
    rng = np.random.default_rng(rows)
    w = quant.quantize(rng.standard_normal((48, 64)).astype(np.float32), 8)  # [out, in]
    x = rng.standard_normal((rows, 64)).astype(np.float32)
    x[:, 3] *= 300  # an outlier channel: one int8 digit per row would round every other value to a few levels
    got = np.asarray(quant.matmul(jnp.asarray(x), jax.device_put(w)), np.float64)
    deq = np.asarray(quant.dequantize(w), np.float64).T
    half_step = np.abs(x).max(axis=1, keepdims=True) / 127 / quant.LOW_DIGIT / 2
    bound = half_step * np.abs(deq).sum(axis=0)[None] + 1e-5 * np.abs(x @ deq) + 1e-6
    assert np.all(np.abs(got - x.astype(np.float64) @ deq) <= bound)
    text = jax.jit(quant.matmul).lower(jnp.asarray(x), jax.device_put(w)).as_text()
    left, right = ("48x64xi8", f"{2 * rows}x64xi8") if rows <= quant.SKINNY_ROWS else (f"{2 * rows}x64xi8", "48x64xi8")
    assert re.search(rf"dot_general.*\(tensor<{left}>, tensor<{right}>\) -> tensor<", text), \
        "not one s8 x s8 -> s32 dot over both digits of every row (the weight on the left for decode batches)"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 8, 100])
def test_int8_product_error_stays_near_the_weight_rounding_with_outlier_channels(rows, dtype, monkeypatch):
    """With two channels x30 / x300 at every row, the int8 product's error against the float weight is within 2x the
    weight-only product's (x @ dequantize(W)); one activation digit per row (W8A8) is not."""
    rng = np.random.default_rng(rows)
    w = rng.standard_normal((96, 256)).astype(np.float32) * 0.05
    qw = jax.device_put(quant.quantize(w, 8))
    deq = np.asarray(quant.dequantize(qw), np.float64)
    for factor in (30, 300):
        x = rng.standard_normal((rows, 256)).astype(np.float32)
        x[:, [7, 100]] *= factor
        xj = jnp.asarray(x, dtype)
        x64 = np.asarray(xj.astype(jnp.float32), np.float64)
        want = x64 @ w.T.astype(np.float64)
        weight_only = rel_rms(x64 @ deq.T, want)
        assert rel_rms(np.asarray(quant.matmul(xj, qw).astype(jnp.float32), np.float64), want) <= 2 * weight_only
        with monkeypatch.context() as m:
            m.setattr(quant, "activation_digits", one_digit)  # matmul is not jitted here: no trace to clear
            w8a8 = rel_rms(np.asarray(quant.matmul(xj, qw).astype(jnp.float32), np.float64), want)
        assert w8a8 > 2 * weight_only, (factor, w8a8, weight_only)


OUTLIER_MODEL = dict(hidden_size=192, intermediate_size=384, num_hidden_layers=3)  # heads 4 of 48, untied
PREFILL_TOKENS = np.random.default_rng(7).integers(0, 300, size=(3, 40))  # 120 rows: the wide product
DECODE_TOKENS = np.random.default_rng(8).integers(0, 300, size=(8, 1))  # 8 rows: a decode batch's product


def rounded_weights(model: pj.Model) -> pj.Model:
    """The model of the int8-rounded weights alone: every QuantizedWeight replaced by its float dequantization."""
    import dataclasses
    return dataclasses.replace(model, params=quant.dequantize_params(model.params, model.dtype))


def position_errors(logits, ref) -> np.ndarray:
    """Each position's largest logit error against `ref`, relative to ref's largest logit."""
    return (np.abs(logits - ref).max(axis=-1) / np.abs(ref).max()).ravel()


# The activations' own share of int8's logit error: the median position's error against the model of the rounded
# weights alone (same weights, float activations), relative to the largest logit. Two digits lose at most half a
# step of absmax / 127 / 254 per row, one digit (W8A8) 254x more, and the logits show that ratio: measured on this
# checkpoint (seeds 0-2 of the builder), two digits 0.6-0.7e-4 / 2-4e-4 / 2-3e-4 at x1 / x30 / x300, one digit
# 0.015-0.018 / 0.048-0.088 / 0.043-0.063. The bound sits 5x above the first and 7x below the second.
ACTIVATION_BOUND = 2e-3


@pytest.mark.parametrize("factor", [1, 30, 300])
def test_int8_activations_add_little_to_the_weight_rounding_with_outlier_channels(hf_checkpoint, tmp_path, factor,
                                                                                   monkeypatch):
    """A random Qwen2 with two channels planted `factor` x larger through every RMSNorm weight (the massive
    activations of real checkpoints), at prefill and decode row counts, in XLA's integer form (a mesh, no compiler):
    the int8 activations add at most ACTIVATION_BOUND to the logits of the model of the rounded weights alone at the
    median position, where one activation digit per row (int8 as first landed) adds more at every factor; and at
    x1 / x30 int8's logit error against the float model is within 2x the rounded weights' own, which one digit is not
    at x30. (The native kernel keeps activations whole: the next test.)"""
    from benchmarks.presets import plant_outliers
    folder = plant_outliers(hf_checkpoint("qwen2_mha_untied", **OUTLIER_MODEL), tmp_path / "planted", factor)
    float_model, int8 = pj.load_model(folder), pj.load_model(folder, quantize="int8")
    rounded = rounded_weights(int8)
    monkeypatch.setattr(decoder, "logits_impl", lambda mesh=None: "xla")  # pj.logits in XLA's forms
    old_ratios = []  # one digit's error / the rounded weights', per row count
    for tokens in (PREFILL_TOKENS, DECODE_TOKENS):
        ref, weight_only = np.asarray(pj.logits(float_model, tokens)), np.asarray(pj.logits(rounded, tokens))
        ours = np.asarray(pj.logits(int8, tokens))
        with monkeypatch.context() as m:
            m.setattr(quant, "activation_digits", one_digit)
            jax.clear_caches()  # the forward is jitted: trace it again with the one-digit activations
            w8a8 = np.asarray(pj.logits(int8, tokens))
        jax.clear_caches()
        # The median, not the largest: at x300 the q/k inputs carry the outliers, attention saturates, and a near-tie
        # at a few positions flips under any change to the activations (seed 0: one of 120 prefill positions off
        # by 0.23 of the largest logit with two digits, the next 0.005).
        activation = np.median(position_errors(ours, weight_only))
        assert activation <= ACTIVATION_BOUND, (tokens.shape, activation)
        assert np.median(position_errors(w8a8, weight_only)) > ACTIVATION_BOUND, tokens.shape
        if factor < 300:  # at x300 these random weights' own rounding costs ~0.8 of the largest logit: no bound there
            assert rel_err(ours, ref) <= 2 * rel_err(weight_only, ref), tokens.shape
            old_ratios.append(rel_err(w8a8, ref) / rel_err(weight_only, ref))
    # The float bound fails on the old form at x30 (ratios 1.9 at prefill, 6.7 at decode rows on the numpy-built
    # checkpoint).
    assert factor != 30 or max(old_ratios) > 2, old_ratios


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler for the kernels")
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_native_quantized_model_is_the_model_of_its_rounded_weights(hf_checkpoint, tmp_path, mode):
    """Where the native kernels run, an int8 model's logits are bitwise those of its dequantized weights in the float
    kernel (activations whole: nothing lost to them, even with outlier channels x300), and an int4 model's (16-bit
    activations, one step per row) within ACTIVATION_BOUND at the median position, as int8's two digits in XLA's form;
    at prefill and decode row counts; and the float model differs (the rounding is there)."""
    from benchmarks.presets import plant_outliers
    folder = plant_outliers(hf_checkpoint("qwen2_mha_untied", **OUTLIER_MODEL), tmp_path / "planted", 300)
    quantized = pj.load_model(folder, quantize=mode)
    rounded, float_model = rounded_weights(quantized), pj.load_model(folder)
    hlo = jax.jit(lambda p, t: pj.logits(dataclasses.replace(quantized, params=p), t)).lower(
        quantized.params, DECODE_TOKENS).as_text()
    assert cpu_kernels.QUANTIZED_TARGET in hlo
    # int4 linears are stored in the kernel's tiles on one CPU device; row-major values give the same bits
    linears = [p[k] for p in quantized.params["layers"] for k in quant.LINEAR_NAMES]
    assert all(w.tiled == (mode == "int4") for w in linears)
    row_major = dataclasses.replace(quantized, params=quant.untiled_params(quantized.params))
    def xla_forms(model):  # XLA's forms read the tiles back in row-major order
        return np.asarray(decoder.forward_logits(model.params, model.config, jnp.asarray(DECODE_TOKENS), None, None,
                                                 False, "xla"))
    np.testing.assert_array_equal(xla_forms(quantized), xla_forms(row_major))
    for tokens in (PREFILL_TOKENS, DECODE_TOKENS):
        ours, weight_only = np.asarray(pj.logits(quantized, tokens)), np.asarray(pj.logits(rounded, tokens))
        np.testing.assert_array_equal(ours, np.asarray(pj.logits(row_major, tokens)))
        if mode == "int8":
            np.testing.assert_array_equal(ours, weight_only)
        else:
            assert np.median(position_errors(ours, weight_only)) <= ACTIVATION_BOUND, tokens.shape
        assert not np.array_equal(ours, np.asarray(pj.logits(float_model, tokens)))


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler for the kernels")
def test_an_engine_in_xla_forms_untiles_the_weights_once(hf_checkpoint):
    """A single-device CPU load tiles int4 values for the kernel; an engine that runs XLA's forms instead
    (batch_invariant=False) reads them back row-major once at construction rather than in every step, and an engine
    on the kernels serves the loaded arrays as they are."""
    model = pj.load_model(hf_checkpoint("qwen3_gqa4_headdim"), quantize="int4")
    assert all(p[k].tiled for p in model.params["layers"] for k in quant.LINEAR_NAMES)
    native = pj.Engine(model, max_batch_size=1, max_seq_len=64)
    assert native.impl == "cpu" and native.model.params is model.params
    xla = pj.Engine(model, max_batch_size=1, max_seq_len=64, batch_invariant=False)
    assert xla.impl == "xla" and not any(p[k].tiled for p in xla.model.params["layers"] for k in quant.LINEAR_NAMES)
    weights = [p[k] for p in model.params["layers"] for k in quant.LINEAR_NAMES]
    for w, row_major in zip(weights, (p[k] for p in xla.model.params["layers"] for k in quant.LINEAR_NAMES)):
        np.testing.assert_array_equal(np.asarray(row_major.values), np.asarray(quant.untiled(w).values))
