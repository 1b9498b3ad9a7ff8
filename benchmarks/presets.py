"""Random-weight Hugging Face checkpoints for benchmarks: `qwen3-micro` (smoke test), `qwen3-tiny` (CI-fast),
`qwen3-0.6b` (real shapes) and `qwen3-moe` (Qwen3-30B-A3B's layers, shallow) beside `qwen3-moe-dense`, with micro
MoE models of both types (`qwen3-moe-micro`, `qwen2-moe-micro`).

Weights are drawn with numpy and written with pocketjax's safetensors writer, so building the 0.6B preset takes
seconds and needs no torch. transformers loads the folders as-is (same tensor names, config and dtype).
"""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np

from pocketjax.model.checkpoint import expected_shapes, open_checkpoint, write_safetensors
from pocketjax.model.config import ModelConfig

PRESETS = {
    "qwen3-micro": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
                        tie_word_embeddings=True),  # the smoke test's: smallest compile times
    "qwen3-tiny": dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                       tie_word_embeddings=True),
    "qwen3-0.6b": dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       tie_word_embeddings=True),
    # Qwen2.5-32B's shapes (the seed's workload, benchmarks/device_check_decode.py seed: random weights made on the
    # device, never written) and a micro Qwen2 (biases on q/k/v, no q/k norms) for its dry run on CPU
    "qwen2.5-32b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", attention_bias=True,
                        vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
                        tie_word_embeddings=False),
    "qwen2.5-micro": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", attention_bias=True,
                          vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
                          tie_word_embeddings=False),
    # Qwen3-30B-A3B's layer shapes (issue 68: 2048 hidden, 32 / 4 heads of 128, 128 experts of width 768, 8 active,
    # renormalized) at 4 of its 48 layers: 3.1B parameters (6.2 GB in bfloat16), 0.85B active per token (embedding
    # and lm_head included: `ModelConfig.num_params(active=True)`). Beside it a
    # dense Qwen3 with the same active parameters per token (an MLP of 8 x 768 = 6144, the same attention and depth):
    # what MoE decode is compared against (`bench_engine.py --model qwen3-moe`, then `--model qwen3-moe-dense`)
    "qwen3-moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936,
                      hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                      num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                      num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                      max_position_embeddings=40960, tie_word_embeddings=False),
    "qwen3-moe-dense": dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=4,
                            num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                            tie_word_embeddings=False),
    # micro MoE models for smoke tests, the GGUF writer's test and the GPU script's dry run: qwen3_moe (renormalized
    # top-k) and qwen2_moe (no renormalization, a shared expert behind its sigmoid gate, biases on q/k/v)
    "qwen3-moe-micro": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=512,
                            hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                            num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                            max_position_embeddings=1024, tie_word_embeddings=False),
    "qwen2-moe-micro": dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", attention_bias=True,
                            vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                            shared_expert_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                            norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                            tie_word_embeddings=False),
}


def preset_config(name: str, dtype: str = "float32") -> dict:
    return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
            "attention_bias": False, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "torch_dtype": dtype,
            "bos_token_id": 0, "eos_token_id": 1, "use_sliding_window": False, **PRESETS[name]}


def build_preset(name: str, folder: str | Path, dtype: str = "float32", seed: int = 0) -> Path:
    """Write config.json + model.safetensors for a preset into folder (skipped if already there)."""
    folder = Path(folder)
    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    cfg = preset_config(name, dtype)
    shapes = expected_shapes(ModelConfig.from_dict(cfg))
    rng = np.random.default_rng(seed)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    tensors = {}
    for tensor, shape in shapes.items():
        if len(shape) == 1:
            array = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        else:
            array = rng.standard_normal(shape, dtype=np.float32) * (1.0 / np.sqrt(shape[-1]))
        tensors[tensor] = array.astype(np_dtype)
    write_safetensors(folder / "model.safetensors", tensors)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


OUTLIER_CHANNELS = (7, 100)


# the projections each RMSNorm feeds: what `plant_outliers(compensate=True)` scales back
NORM_CONSUMERS = {"input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                  "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj")}


def plant_outliers(src: str | Path, dst: str | Path, factor: float, channels: tuple[int, ...] = OUTLIER_CHANNELS,
                   compensate: bool = False) -> Path:
    """A copy of checkpoint `src` in `dst` whose every layer's input and post-attention RMSNorm weights are `factor`
    times larger at `channels`: the inputs of q/k/v and gate/up then carry those few channels `factor` times larger at
    every token, the "massive activations" real Qwen checkpoints have (LLM.int8(); Sun et al. 2024). The float model
    stays a valid model; only quantized products that share one step across a row's channels notice.

    `compensate` also divides those channels' input columns of q/k/v and gate/up by `factor` (SmoothQuant run
    backwards), so the float model computes the same function as `src` up to rounding: a trained model keeps its
    perplexity, and what a quantized variant loses on the copy is the outliers' cost alone."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, f in open_checkpoint(src).items():
        array = np.array(f.tensor(name))
        if name.endswith(("input_layernorm.weight", "post_attention_layernorm.weight")):
            array[list(channels)] *= factor
        elif compensate and any(name.endswith(f"{m}.weight") for ms in NORM_CONSUMERS.values() for m in ms):
            array[:, list(channels)] /= factor
        tensors[name] = array
    write_safetensors(dst / "model.safetensors", tensors)
    for extra in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / extra).exists():
            (dst / extra).write_bytes((src / extra).read_bytes())
    return dst


# HF module name -> llama.cpp's GGUF tensor name (the names convert_hf_to_gguf.py writes for qwen2 / qwen3, and for
# qwen2moe / qwen3moe: the router, the experts stacked [num_experts, out, in] as one tensor each, the shared expert).
GGUF_LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp", "mlp.experts.gate_proj": "ffn_gate_exps",
                    "mlp.experts.up_proj": "ffn_up_exps", "mlp.experts.down_proj": "ffn_down_exps",
                    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
                    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp"}
GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}
GGUF_FLOAT_MODULES = ("ffn_gate_inp", "ffn_gate_inp_shexp")  # routers stay float32, as convert_hf_to_gguf.py keeps them


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name of an HF tensor; one expert's tensor (mlp.experts.<e>.<proj>) names its layer's stack."""
    if hf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)  # model.layers.<n>.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    if module.startswith("mlp.experts."):
        module = "mlp.experts." + module.rsplit(".", 1)[1]
    return f"blk.{layer}.{GGUF_LAYER_NAMES[module]}.{kind}"


def gguf_tensors(hf_names, cfg: ModelConfig) -> dict[str, list[str]]:
    """GGUF tensor name -> the HF tensors it holds, in checkpoint order: one each, or a layer's experts in id order."""
    names: dict[str, list[str]] = {}
    for name in hf_names:
        names.setdefault(gguf_tensor_name(name), []).append(name)
    for name, parts in names.items():
        if len(parts) > 1:
            parts.sort(key=lambda n: int(n.split(".experts.")[1].split(".")[0]))
            if len(parts) != cfg.moe.num_experts:
                raise ValueError(f"{name}: {len(parts)} experts in the checkpoint, config says {cfg.moe.num_experts}")
    return names


def write_gguf(folder: str | Path, out: str | Path, dtype: str = "float32") -> Path:
    """Write an HF Qwen2/Qwen3 folder's weights (dense, or qwen2_moe / qwen3_moe) as a GGUF file for llama.cpp
    (needs the `gguf` package).

    dtype: "float32", "float16", "bfloat16", or "q8_0" (every matrix, embedding and lm_head included, in llama.cpp's
    8-bit blocks of 32 with one float16 scale each, quantized by gguf's own reference `quants.quantize`, as
    llama-quantize / convert_hf_to_gguf.py --outtype q8_0 write them; routers stay float32 as there).

    For checkpoints without a tokenizer (the presets): the vocabulary is declared "no_vocab" with the model's size,
    which llama.cpp accepts for token-id input. Matrices keep their HF [out, in] layout (GGUF lists dims reversed,
    as llama.cpp expects) and Qwen's NEOX RoPE needs no Q/K permutation; 1-D norms are stored float32, as
    convert_hf_to_gguf.py does. A MoE layer's experts are stacked [num_experts, out, in] (llama.cpp's ffn_*_exps).
    Tensors are streamed to the file one at a time (a MoE preset's float32 GGUF is larger than this machine's RAM
    would hold twice). For a real checkpoint with tokenizer files prefer llama.cpp's own converter.
    """
    import gguf

    folder, out = Path(folder), Path(out)
    cfg = ModelConfig.from_folder(folder)
    if cfg.rope.rope_type != "default":
        raise ValueError(f"write_gguf handles default RoPE only, not {cfg.rope.rope_type!r}")
    if cfg.moe is not None and not all(cfg.moe.sparse(n) for n in range(cfg.num_layers)):
        raise ValueError("llama.cpp's qwen2moe / qwen3moe take sparse layers only (mlp_only_layers, sparse_step)")
    writer = gguf.GGUFWriter(str(out), cfg.model_type.replace("_", ""))  # qwen3_moe -> llama.cpp's qwen3moe
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope.theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("no_vocab")
    if cfg.moe is not None:  # llama.cpp normalizes qwen3moe's top-k weights and not qwen2moe's, as the configs do
        writer.add_expert_count(cfg.moe.num_experts)
        writer.add_expert_used_count(cfg.moe.top_k)
        writer.add_expert_feed_forward_length(cfg.moe.intermediate_size)
        if cfg.moe.shared_intermediate_size:
            writer.add_expert_shared_feed_forward_length(cfg.moe.shared_intermediate_size)
    file_type = {"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                 "bfloat16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype]
    writer.add_file_type(file_type)
    checkpoint = open_checkpoint(folder)
    tensors = gguf_tensors(checkpoint, cfg)

    def encoding(name: str, shape: tuple[int, ...]) -> tuple[np.dtype, object]:
        """(numpy dtype, raw GGML type or None) a tensor is stored in."""
        if len(shape) == 1 or dtype == "float32" or name.split(".")[-2] in GGUF_FLOAT_MODULES:
            return np.dtype(np.float32), None
        if dtype == "q8_0":
            return np.dtype(np.uint8), gguf.GGMLQuantizationType.Q8_0
        if dtype == "float16":
            return np.dtype(np.float16), None
        return np.dtype(np.uint16), gguf.GGMLQuantizationType.BF16

    def shape_of(parts: list[str]) -> tuple[int, ...]:
        one = tuple(checkpoint[parts[0]].header[parts[0]]["shape"])
        return (len(parts), *one) if len(parts) > 1 else one

    for name, parts in tensors.items():  # the table of contents first, then the data tensor by tensor
        shape = shape_of(parts)
        np_dtype, raw = encoding(name, shape)
        stored = gguf.quant_shape_to_byte_shape(shape, raw) if raw == gguf.GGMLQuantizationType.Q8_0 else shape
        writer.add_tensor_info(name, stored, np_dtype, int(np.prod(stored)) * np_dtype.itemsize, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, parts in tensors.items():
        array = np.stack([checkpoint[p].tensor(p) for p in parts]) if len(parts) > 1 else checkpoint[parts[0]].tensor(parts[0])
        np_dtype, raw = encoding(name, array.shape)
        if raw == gguf.GGMLQuantizationType.Q8_0:
            array = gguf.quants.quantize(array.astype(np.float32), raw)
        elif raw == gguf.GGMLQuantizationType.BF16:
            array = array.astype(ml_dtypes.bfloat16).view(np.uint16)
        else:
            array = array.astype(np_dtype)
        writer.write_tensor_data(np.ascontiguousarray(array))
    writer.close()
    return out


# GGUF encodings llama.cpp's own quantizer writes (llama_model_quantize), from the float32 GGUF: Q4_K_M is Ollama's and
# LM Studio's default, Q4_0 the fastest 4-bit one.
GGUF_QUANTIZED = {"q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}
GGUF_TYPES = ("float32", "float16", "bfloat16", "q8_0", *GGUF_QUANTIZED)


def quantize_gguf(src: str | Path, out: str | Path, kind: str, threads: int = 0) -> Path:
    """Quantize GGUF `src` to `kind` (a key of GGUF_QUANTIZED) with llama-cpp-python's `llama_model_quantize`, as
    llama-quantize does (no importance matrix)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, GGUF_QUANTIZED[kind])
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({src} -> {kind}) returned {rc}")
    return Path(out)


def gguf_file(folder: str | Path, kind: str, path: str | Path | None = None,
              out_dir: str | Path | None = None) -> Path:
    """`path`, else <out_dir or folder>/model-<kind>.gguf, written on first use: float and q8_0 by write_gguf,
    Q4_0 / Q4_K_M by llama.cpp's quantizer from the float32 GGUF (itself written first when missing). Written under
    a temporary name and renamed, so a crash mid-way leaves no truncated file to be picked up next time."""
    if kind not in GGUF_TYPES:
        raise ValueError(f"GGUF type {kind!r}: one of {', '.join(GGUF_TYPES)}")
    folder, out_dir = Path(folder), Path(out_dir or folder)
    out = Path(path) if path else out_dir / f"model-{kind}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    if kind in GGUF_QUANTIZED:
        quantize_gguf(gguf_file(folder, "float32", out_dir=out_dir), partial, kind)
    else:
        write_gguf(folder, partial, kind)
    partial.replace(out)
    return out
