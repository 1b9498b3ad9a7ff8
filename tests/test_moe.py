"""Mixture-of-experts models (issue 68): qwen3_moe and qwen2_moe against transformers' Qwen3MoeForCausalLM /
Qwen2MoeForCausalLM on the same random sharded checkpoints (prefill logits, the engine's cached, batched and chunked
decode, greedy generation), the parity's power to tell wrong routing from right, the config's rules, and the
engine's promises that are model-agnostic (pj.logprobs equal to the engine, bit for bit)."""
import dataclasses

import numpy as np
import pytest

import pocketjax as pj
from pocketjax.engine.engine import Engine
from pocketjax.engine.sampling_params import SamplingParams
from pocketjax.errors import CheckpointError, ConfigError
from pocketjax.model import cpu_kernels
from pocketjax.model.config import ModelConfig

from conftest import MOE_CONFIGS, MissingOracle, oracle
from test_engine import run  # allocate, prefill and decode to completion; frees the slots

torch = oracle("torch")
transformers = oracle("transformers")

NAMES = list(MOE_CONFIGS)
TOLERANCE = 1e-5


def prompts_of(vocab: int, seed: int, lengths=(5, 19, 11)) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in lengths]


@pytest.fixture(scope="module")
def moe(moe_checkpoint):
    """name -> (folder, loaded model, transformers' model of the same folder or None without transformers)."""
    out = {}
    for name in NAMES:
        folder = moe_checkpoint(name)
        hf = None
        if not isinstance(transformers, MissingOracle):
            hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        out[name] = folder, pj.load_model(folder), hf
    return out


def hf_logits(hf, tokens) -> np.ndarray:
    if hf is None:
        pytest.skip("needs transformers as the reference (not installed: CI's torch-free leg)")
    with torch.no_grad():
        return hf(torch.tensor(np.asarray(tokens))).logits.numpy()


@pytest.mark.parametrize("name", NAMES)
def test_prefill_logits_match_transformers(moe, name):
    folder, model, hf = moe[name]
    tokens = np.asarray(prompts_of(model.config.vocab_size, 0, (13, 13)))
    np.testing.assert_allclose(np.asarray(pj.logits(model, tokens)), hf_logits(hf, tokens), atol=TOLERANCE, rtol=0)


def test_xla_forms_and_tp2_match_transformers(moe):
    """Off the native CPU path (one device in XLA's forms; `pj.logits` on a "tp" mesh of two CPU devices, each holding
    half of every expert) the experts run as XLA's grouped product (`ragged_dot_general`, partitioned by XLA): the
    same parity."""
    from pocketjax.model.decoder import forward_logits

    folder, model, hf = moe["qwen2_moe"]
    tokens = np.asarray(prompts_of(model.config.vocab_size, 5, (10, 10)))
    want = hf_logits(hf, tokens)
    xla = forward_logits(model.params, model.config, tokens.astype(np.int32), impl="xla")
    np.testing.assert_allclose(np.asarray(xla), want, atol=TOLERANCE, rtol=0)
    np.testing.assert_allclose(np.asarray(pj.logits(pj.load_model(folder, tp=2), tokens)), want, atol=TOLERANCE,
                               rtol=0)


def test_lora_on_attention_unmerged_equals_merged(moe):
    """An adapter on q / v of a MoE model (random pairs: PEFT's zero B would be a no-op) applied unmerged gives the
    logits of the weights it merges into, and moves them (the experts see the adapted attention)."""
    from pocketjax.model.lora import Adapter, Lora, LoraConfig, attach, merge

    folder, model, _ = moe["qwen2_moe"]
    config, rng = LoraConfig(rank=4, alpha=8.0, targets=("q", "v")), np.random.default_rng(6)
    pairs = tuple({n: Lora(0.2 * rng.standard_normal((4, p[n].shape[1]), dtype=np.float32),
                           0.2 * rng.standard_normal((p[n].shape[0], 4), dtype=np.float32), config.scaling)
                   for n in config.targets} for p in model.params["layers"])
    unmerged = attach(model.params, Adapter(config, pairs))
    tokens = np.asarray(prompts_of(model.config.vocab_size, 7, (9,)))
    got = np.asarray(pj.logits(dataclasses.replace(model, params=unmerged), tokens))
    merged = np.asarray(pj.logits(dataclasses.replace(model, params=merge(unmerged)), tokens))
    np.testing.assert_allclose(got, merged, atol=TOLERANCE, rtol=0)
    assert np.abs(got - np.asarray(pj.logits(model, tokens))).max() > 100 * TOLERANCE


def test_stacked_layers_give_the_unrolled_logits(moe):
    """qwen3_moe's layers are all sparse, so they stack for `lax.scan`: the same logits."""
    folder, model, _ = moe["qwen3_moe"]
    stacked = pj.load_model(folder, scan_layers=True)
    assert stacked.scan_layers and stacked.params["layers"]["expert_gate"].shape[:2] == (2, 8)
    tokens = np.asarray(prompts_of(model.config.vocab_size, 1, (9,)))
    np.testing.assert_allclose(np.asarray(pj.logits(stacked, tokens)), np.asarray(pj.logits(model, tokens)),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_engine_decode_matches_transformers_generate_and_pj_logprobs(moe, name):
    """Three prompts batched, prefilled in chunks of 16 (the 19-token prompt in two) then decoded from the cache: each
    greedy token is transformers' and each token's logprob its log_softmax within the parity bound; and `pj.logprobs`
    of the prompt and its tokens are the engine's logprobs bit for bit (on the native CPU path). Sizes chosen for few
    compiled programs (5; chunks of 8 over 64 positions compiled 7 in 1.7x the time)."""
    folder, model, hf = moe[name]
    prompts = prompts_of(model.config.vocab_size, 2)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    done = run(Engine(model, max_batch_size=4, max_seq_len=32, prefill_chunk=16), prompts, params)
    if cpu_kernels.available():  # the longest request (one more compiled forward per length)
        req, prompt = done[1], prompts[1]
        scored = np.asarray(pj.logprobs(model, [prompt + req.generated_tokens]))[0, len(prompt) - 1:]
        assert scored.tolist() == [lp for lp, _ in req.logprobs]
    if hf is None:
        pytest.skip("needs transformers as the reference (not installed: CI's torch-free leg)")
    for req, prompt in zip(done, prompts):
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=None, output_scores=True, return_dict_in_generate=True)
        ref = out.sequences[0, len(prompt):].tolist()
        same = next((i for i, (a, b) in enumerate(zip(req.generated_tokens, ref)) if a != b), len(ref))
        if same < len(ref):  # allowed only where transformers' top-2 logits are a near-tie (as for dense models)
            top2 = torch.topk(out.scores[same][0], 2).values
            assert float(top2[0] - top2[1]) < 1e-4, (same, req.generated_tokens, ref)
        want = [float(torch.log_softmax(s[0].double(), -1)[t]) for s, t in zip(out.scores, ref[:same])]
        np.testing.assert_allclose([lp for lp, _ in req.logprobs[:same]], want, atol=TOLERANCE, rtol=0)


def broken(model, **moe_changes):
    """The model with its MoE config changed (the same weights): what a routing bug would compute."""
    config = dataclasses.replace(model.config, moe=dataclasses.replace(model.config.moe, **moe_changes))
    return dataclasses.replace(model, config=config)


@pytest.mark.parametrize("name, change", [
    ("qwen3_moe", "no norm_topk_prob"), ("qwen2_moe", "norm_topk_prob"), ("qwen3_moe", "top k-1"),
    ("qwen2_moe", "top k-1"), ("qwen2_moe", "no shared expert")])
def test_the_parity_bound_tells_wrong_routing_from_right(moe, name, change):
    """The parity above fails for a model that routes wrongly: renormalizing or not against the config, one expert
    too few, or qwen2_moe's shared expert dropped, each moves the logits far past the bound."""
    folder, model, hf = moe[name]
    tokens = np.asarray(prompts_of(model.config.vocab_size, 0, (13, 13)))
    k, norm = model.config.moe.top_k, model.config.moe.norm_topk_prob
    if change == "no shared expert":
        layers = [{n: w for n, w in p.items() if not n.startswith("shared")} for p in model.params["layers"]]
        wrong = dataclasses.replace(model, params={**model.params, "layers": layers})
    else:
        wrong = broken(model, top_k=k - 1) if change == "top k-1" else broken(model, norm_topk_prob=not norm)
    error = np.abs(np.asarray(pj.logits(wrong, tokens)) - hf_logits(hf, tokens)).max()
    assert error > 100 * TOLERANCE, error


def test_sparse_layers_follow_transformers_rule():
    """decoder_sparse_step and mlp_only_layers pick the sparse layers as transformers' decoder layers do."""
    cfg = dict(MOE_CONFIGS["qwen2_moe"], num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    ours = ModelConfig.from_dict(cfg)
    assert [ours.sparse(n) for n in range(6)] == [False, True, False, False, False, True]
    assert ours.mixed_layers
    if not isinstance(transformers, MissingOracle):
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "moe_intermediate_size", "shared_expert_intermediate_size", "num_experts",
                "num_experts_per_tok", "decoder_sparse_step", "mlp_only_layers")
        hf = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**{k: cfg[k] for k in keys}))
        assert [type(layer.mlp).__name__ == "Qwen2MoeSparseMoeBlock" for layer in hf.model.layers] == \
            [ours.sparse(n) for n in range(6)]


@pytest.mark.parametrize("change, message", [
    (dict(num_experts_per_tok=9), "exceeds num_experts"),
    (dict(mlp_only_layers=[7]), "mlp_only_layers"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob"),
    (dict(num_local_experts=4), "disagree"),
    (dict(moe_intermediate_size=0), "moe_intermediate_size"),
    (dict(quantization_config={"quant_method": "awq", "bits": 4, "version": "gemv"}), "version"),
])
def test_bad_moe_configs_are_config_errors(change, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict({**MOE_CONFIGS["qwen2_moe"], **change})


def test_mixed_layers_refuse_a_stack_and_a_missing_expert_is_named(moe, tmp_path):
    folder, model, _ = moe["qwen2_moe"]
    with pytest.raises(ConfigError, match="scan_layers=True"):
        pj.load_model(folder, scan_layers=True)
    assert pj.load_model(folder, scan_layers="auto").scan_layers is False
    import json
    import shutil
    copy = shutil.copytree(folder, tmp_path / "copy")
    index = json.loads((copy / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.2.mlp.experts.5.up_proj.weight"]
    (copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="experts.5.up_proj"):
        pj.load_model(copy)


def test_num_params_counts_experts_and_active_experts():
    config = ModelConfig.from_dict(MOE_CONFIGS["qwen3_moe"])
    h, e, i, k = 64, 8, 32, 2
    assert config.num_params() - config.num_params(active=True) == 2 * (e - k) * 3 * h * i


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: the experts' quantized kernel")
def test_int8_experts_are_the_float_product_of_their_dequantized_weights(moe):
    """quantize="int8" quantizes each expert (and the shared expert) per output channel, the router and the shared
    expert's gate stay float; the int8 kernel is bitwise the float kernel on the dequantized weight, so the logits
    are those of the float model of the rounded weights, bit for bit."""
    from pocketjax.model import quant

    folder, model, _ = moe["qwen2_moe"]
    int8 = pj.load_model(folder, quantize="int8")
    sparse = int8.params["layers"][0]
    assert isinstance(sparse["expert_up"], quant.QuantizedWeight) and sparse["expert_up"].values.shape == (8, 32, 64)
    assert isinstance(sparse["shared_down"], quant.QuantizedWeight)
    assert sparse["router"].dtype == sparse["shared_expert_gate"].dtype == np.float32
    rounded = dataclasses.replace(int8, params=quant.dequantize_params(int8.params))
    tokens = np.asarray(prompts_of(model.config.vocab_size, 4, (11, 11)))
    np.testing.assert_array_equal(np.asarray(pj.logits(int8, tokens)), np.asarray(pj.logits(rounded, tokens)))


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_plan_memory_counts_the_experts_as_placed(moe, quantize):
    from pocketjax.model.memory import per_device_bytes

    folder, model, _ = moe["qwen3_moe"]
    loaded = model if quantize is None else pj.load_model(folder, quantize=quantize)
    plan = pj.plan_memory(model.config, dtype="float32", quantize=quantize)
    assert plan.weights == sum(per_device_bytes(loaded.params).values())
    assert plan.details["weights.experts"] > plan.details["weights.linear"] > 0



def test_nnx_adapters_follow_each_layers_tensors(moe):
    """pocketjax.nnx draws a fresh adapter from each layer's own tensors: on attention it serves a MoE model (B = 0:
    the logits of the base, bit for bit); an MLP target that sparse layers lack is a ConfigError naming the layer."""
    from pocketjax.errors import ConfigError
    from pocketjax.model.lora import LoraConfig
    from pocketjax.nnx import Decoder

    _, model, _ = moe["qwen2_moe"]
    tokens = np.asarray(prompts_of(model.config.vocab_size, 8, (7,)))
    decoder = Decoder(model, LoraConfig(rank=2, alpha=4.0, targets=("q", "o")))
    assert np.asarray(decoder(tokens)).tobytes() == np.asarray(Decoder(model)(tokens)).tobytes()
    with pytest.raises(ConfigError, match=r"\['gate'\] are not projections of layer"):
        Decoder(model, LoraConfig(rank=2, alpha=4.0, targets=("q", "gate")))


# ---- AWQ / GPTQ MoE checkpoints ------------------------------------------------------------------------------------
PREQUANTIZED = {  # case -> (model, method, checkpoint_format, sym)
    "qwen3_moe-gptq": ("qwen3_moe", "gptq", "gptq", True),
    "qwen3_moe-awq": ("qwen3_moe", "awq", None, False),
    "qwen2_moe-gptq_v2": ("qwen2_moe", "gptq", "gptq_v2", False),
}
SHARED_64 = {"shared_expert_intermediate_size": 64}  # the fixture's 48 is no whole number of groups of 32


def write_prequantized_moe(moe_checkpoint, tmp_path, name, method, fmt, sym, desc_act=False) -> dict[str, np.ndarray]:
    """The fixture's random MoE checkpoint with every *_proj linear (attention, dense MLP, each expert, the shared
    expert) replaced by random int4 packed as `method` / `fmt` store it, in tmp_path / "q"; the same weights
    dequantized as a float checkpoint in tmp_path / "f" (router and shared-expert gate float in both). Returns
    {HF name: intended [in, out] weight}: test_quant's writer, whose packing follows AutoAWQ's and auto-gptq's loops."""
    from test_quant import write_prequantized

    src = moe_checkpoint(name, **(SHARED_64 if name == "qwen2_moe" else {}))
    return write_prequantized(src, tmp_path / "q", tmp_path / "f", method, fmt, sym, desc_act, seed=3)


@pytest.mark.parametrize("case", sorted(PREQUANTIZED))
def test_prequantized_moe_checkpoint_loads_exact_experts_and_matches_transformers(moe_checkpoint, tmp_path, case):
    """Each layer's experts of a GPTQ (v1, v2) / AWQ GEMM MoE checkpoint load as one QuantizedWeight stacked [E, ...]
    in quant.py's layout (what the native expert kernel takes) that dequantizes to exactly the (q - zero) * scale
    written; the router and shared-expert gate stay float; plan_memory counts what is placed. In XLA's forms (every
    weight dequantized, then a float product) the logits are transformers' on the float checkpoint of those weights
    within the MoE parity bound; the native path adds int4's 16-bit activation rounding only."""
    from pocketjax.model import quant
    from pocketjax.model.checkpoint import EXPERT_PROJECTIONS
    from pocketjax.model.decoder import forward_logits
    from pocketjax.model.memory import per_device_bytes
    from pocketjax.model.quant import QuantizedWeight
    from test_quant import GROUP, rel_err

    name, method, fmt, sym = PREQUANTIZED[case]
    intended = write_prequantized_moe(moe_checkpoint, tmp_path, name, method, fmt, sym)
    model = pj.load_model(tmp_path / "q")
    config = model.config
    for n, p in enumerate(model.params["layers"]):
        if not config.sparse(n):
            assert isinstance(p["down"], QuantizedWeight)
            continue
        for ours, proj in EXPERT_PROJECTIONS.items():
            w = p[ours]
            want = np.stack([intended[f"model.layers.{n}.mlp.experts.{e}.{proj}.weight"].T
                             for e in range(config.moe.num_experts)])
            assert isinstance(w, QuantizedWeight) and w.bits == 4 and w.group_size == GROUP and w.perm is None
            np.testing.assert_array_equal(np.asarray(quant.dequantize(w)), want)
            like = quant.quantize_host(want, 4)  # quant.py's own int4 experts of the same shape
            assert [(np.shape(getattr(w, f)), getattr(w, f).dtype) for f in ("values", "scale", "zero")] == \
                [(np.shape(getattr(like, f)), getattr(like, f).dtype) for f in ("values", "scale", "zero")]
            assert cpu_kernels.expert_quantized_applies(w)
        assert not isinstance(p["router"], QuantizedWeight) and p["router"].dtype == np.float32
        if config.moe.shared_intermediate_size:
            assert isinstance(p["shared_down"], QuantizedWeight)
            assert not isinstance(p["shared_expert_gate"], QuantizedWeight)
    assert pj.plan_memory(config, dtype="float32").weights == sum(per_device_bytes(model.params).values())

    tokens = np.asarray(prompts_of(config.vocab_size, 9, (12, 12)))
    if isinstance(transformers, MissingOracle):  # CI's torch-free leg: pocketjax's float model of the same weights
        ref = np.asarray(pj.logits(pj.load_model(tmp_path / "f"), tokens))
    else:
        ref = hf_logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "f", dtype=torch.float32).eval(),
                        tokens)
    xla = np.asarray(forward_logits(model.params, config, tokens.astype(np.int32), impl="xla"))
    np.testing.assert_allclose(xla, ref, atol=TOLERANCE, rtol=0)
    # The native int4 kernels round activations to 16 bits per row: test_quant's bound for dense AWQ / GPTQ
    native = np.asarray(pj.logits(model, tokens))
    assert rel_err(native, ref) <= (5e-4 if cpu_kernels.available() else TOLERANCE), rel_err(native, ref)


def packed_gptq(q: np.ndarray, zero: np.ndarray, scale: np.ndarray, prefix: str) -> dict[str, np.ndarray]:
    """GPTQ v1's tensors of linear `prefix` from q [in, out], zero and scale [groups, out] (groups in input order)."""
    from test_quant import reference_pack_gptq_cols, reference_pack_gptq_rows

    rows = q.shape[0] // zero.shape[0]
    return {prefix + ".qweight": reference_pack_gptq_rows(q), prefix + ".qzeros": reference_pack_gptq_cols(zero - 1),
            prefix + ".scales": scale.astype(np.float16),
            prefix + ".g_idx": np.arange(q.shape[0], dtype=np.int32) // rows}


@pytest.mark.parametrize("defect, message", [
    ("desc_act", "desc_act"), ("quantized router", "router"), ("mixed group sizes", "mixed group sizes"),
    ("one expert float", "stored float")])
def test_what_one_stacked_expert_weight_cannot_hold_is_a_config_error(moe_checkpoint, tmp_path, defect, message):
    """A GPTQ MoE checkpoint pocketjax cannot read into its form is refused by name, not loaded wrong: a desc_act
    expert permuting its input rows, a quantized router, one projection's experts stored with different group sizes,
    or one expert float among quantized ones."""
    import json
    from pocketjax.model.checkpoint import open_checkpoint, write_safetensors

    write_prequantized_moe(moe_checkpoint, tmp_path, "qwen3_moe", "gptq", "gptq", False, desc_act=defect == "desc_act")
    folder = tmp_path / "q"
    if defect != "desc_act":
        tensors = {n: np.array(f.tensor(n)) for n, f in open_checkpoint(folder).items()}
        rng, at = np.random.default_rng(4), "model.layers.1.mlp."
        if defect == "quantized router":
            del tensors[at + "gate.weight"]
            tensors |= packed_gptq(rng.integers(0, 16, (64, 8)), np.full((2, 8), 8), np.full((2, 8), 0.01),
                                   at + "gate")
        elif defect == "mixed group sizes":  # expert 3's gate_proj in one group of 64 rows, the others in 32
            for part in ("qweight", "qzeros", "scales", "g_idx"):
                del tensors[f"{at}experts.3.gate_proj.{part}"]
            tensors |= packed_gptq(rng.integers(0, 16, (64, 32)), np.full((1, 32), 8), np.full((1, 32), 0.01),
                                   at + "experts.3.gate_proj")
        else:
            for part in ("qweight", "qzeros", "scales", "g_idx"):
                del tensors[f"{at}experts.5.up_proj.{part}"]
            tensors[at + "experts.5.up_proj.weight"] = rng.standard_normal((32, 64)).astype(np.float32)
        folder = tmp_path / "bad"
        folder.mkdir()
        write_safetensors(folder / "model.safetensors", tensors)
        (folder / "config.json").write_text((tmp_path / "q" / "config.json").read_text())
    with pytest.raises(ConfigError, match=message):
        pj.load_model(folder)
    assert json.loads((folder / "config.json").read_text())["quantization_config"]["quant_method"] == "gptq"


@pytest.mark.skipif(not cpu_kernels.available(), reason="no C++ compiler: XLA's grouped product on the mesh")
@pytest.mark.parametrize("quantize", [None, "int8"])
def test_tp2_holds_half_of_each_expert_and_runs_the_expert_kernel_per_device(moe, quantize):
    """On a "tp" mesh every expert is split as a dense MLP is (gate / up on their width, down on its input: each device
    holds and reads half of each stack, int8 values leaf by leaf), and the engine's forms run the experts in
    pocketjax's kernels per device (three calls per sparse layer in the program, none of XLA's grouped product, which
    on CPU multiplies every expert), within float error of one device."""
    import jax
    from pocketjax.model.decoder import forward_logits

    folder, model, _ = moe["qwen3_moe"]
    two = pj.load_model(folder, tp=2, quantize=quantize)
    for name, axis in (("expert_gate", 1), ("expert_up", 1), ("expert_down", 2)):
        w = two.params["layers"][0][name]
        w = w if quantize is None else w.values
        halves = [s.data.shape for s in w.addressable_shards]
        want = tuple(n // 2 if a == axis else n for a, n in enumerate(w.shape))
        assert halves == [want, want], (name, w.shape, halves)
    tokens = np.asarray(prompts_of(model.config.vocab_size, 9, (7, 7)), np.int32)
    program = jax.jit(lambda p, t: forward_logits(p, two.config, t, impl="cpu")).lower(two.params, tokens).as_text()
    kernel = "pocketjax_expert_matmul" if quantize is None else "pocketjax_expert_quantized_matmul"
    calls = program.count(f"custom_call @{kernel}(")
    assert calls == 3 * model.config.num_layers, f"{calls} calls of {kernel}"
    one = model if quantize is None else pj.load_model(folder, quantize=quantize)
    got = forward_logits(two.params, two.config, tokens, impl="cpu")
    # int8: dense linears on a mesh take XLA's integer product (two-digit activations), not bitwise the kernel's
    np.testing.assert_allclose(np.asarray(got), np.asarray(forward_logits(one.params, one.config, tokens, impl="cpu")),
                               atol=TOLERANCE if quantize is None else 1e-3, rtol=0)
