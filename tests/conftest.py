"""Shared fixtures. XLA_FLAGS must be set before jax is imported anywhere, so TP2 runs on two CPU devices."""
import os
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["POCKETJAX_COMPILE_CACHE_DIR"] = "off"  # tests never write the user's compile cache (their own tests opt in)
# the CPU kernel (model/cpu_kernels.py) builds once per test session, into a folder of its own, not the user's cache
os.environ.setdefault("POCKETJAX_KERNEL_CACHE", tempfile.mkdtemp(prefix="pocketjax-kernels-"))

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)

import contextlib  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402
from types import ModuleType  # noqa: E402

import pytest  # noqa: E402

class MissingOracle:
    """Stands in for a reference library that is not installed: a test that touches it is skipped, not failed.

    CI's second leg (Python 3.12, the GPU host's JAX) has no torch, transformers or peft; with `torch =
    oracle("torch")` at the top of a module every test that needs no reference still runs there, and each one
    that compares against the library skips with this reason (pytest -ra lists them). Private names raise
    AttributeError, so pytest's and hypothesis's probing of module globals never skips anything.
    """

    def __init__(self, name: str):
        self.name = name

    def __getattr__(self, attr: str):
        if attr.startswith("_"):
            raise AttributeError(attr)
        pytest.skip(f"needs {self.name} as the reference (not installed: CI's torch-free leg)")


def oracle(name: str) -> ModuleType | MissingOracle:
    """The reference library `name` (torch, transformers, peft) if installed, else a stand-in that skips."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return MissingOracle(name)


# Tiny Qwen configs covering the parity matrix: Qwen2 with bias, Qwen3 with QK-norm and explicit head_dim,
# tied and untied, GQA ratios 1, 2, 3 and 4, odd vocab sizes, RoPE scaling.
TINY_CONFIGS: dict[str, dict] = {
    "qwen2_gqa2_tied": dict(model_type="qwen2", vocab_size=257, hidden_size=64, intermediate_size=128,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            tie_word_embeddings=True, rope_theta=10000.0),
    "qwen2_mha_untied": dict(model_type="qwen2", vocab_size=300, hidden_size=64, intermediate_size=96,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                             tie_word_embeddings=False, rope_theta=1000000.0),
    "qwen3_gqa4_headdim": dict(model_type="qwen3", vocab_size=301, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                               tie_word_embeddings=False, rope_theta=1000000.0),
    "qwen3_gqa3_bias_tied": dict(model_type="qwen3", vocab_size=263, hidden_size=48, intermediate_size=80,
                                 num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                 attention_bias=True, tie_word_embeddings=True, rope_theta=10000.0),
    "qwen3_kv1": dict(model_type="qwen3", vocab_size=280, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                      tie_word_embeddings=True, rope_theta=10000.0),
    "qwen2_yarn": dict(model_type="qwen2", vocab_size=257, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=512, rope_theta=10000.0,
                       rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen3_linear": dict(model_type="qwen3", vocab_size=257, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


def hf_config(name: str, dtype: str = "float32", **overrides) -> dict:
    """config.json as transformers 5 saves a Qwen2/Qwen3 model (rope_parameters, layer_types, its defaults)."""
    cfg = {**TINY_CONFIGS[name], **overrides}
    model_type = cfg["model_type"]
    rope = {**(cfg.pop("rope_scaling", None) or {}), "rope_theta": cfg.pop("rope_theta")}
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    out = {"architectures": [f"{model_type.capitalize()}ForCausalLM"], "attention_dropout": 0.0,
           "bos_token_id": None, "dtype": dtype, "eos_token_id": None, "hidden_act": "silu",
           "initializer_range": 0.02, "max_position_embeddings": 32768, "max_window_layers": 0,
           "pad_token_id": None, "rms_norm_eps": 1e-06, "rope_parameters": rope, "sliding_window": None,
           "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False}
    if model_type == "qwen3":
        out |= {"attention_bias": False, "head_dim": 128}
    out |= cfg
    out["layer_types"] = ["full_attention"] * out["num_hidden_layers"]
    return dict(sorted(out.items()))


def hf_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor transformers' Qwen2/Qwen3ForCausalLM saves, by name (written out here, not pocketjax's)."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    qwen3 = config["model_type"] == "qwen3"
    head_dim = config["head_dim"] if qwen3 else hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    layer = {"input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,),
             "mlp.gate_proj.weight": (inter, hidden), "mlp.up_proj.weight": (inter, hidden),
             "mlp.down_proj.weight": (hidden, inter), "self_attn.q_proj.weight": (q, hidden),
             "self_attn.k_proj.weight": (kv, hidden), "self_attn.v_proj.weight": (kv, hidden),
             "self_attn.o_proj.weight": (hidden, q)}
    if not qwen3 or config["attention_bias"]:  # Qwen2 always has q/k/v biases; Qwen3's flag adds o_proj's too
        layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    if qwen3 and config["attention_bias"]:
        layer["self_attn.o_proj.bias"] = (hidden,)
    if qwen3:
        layer |= {"self_attn.q_norm.weight": (head_dim,), "self_attn.k_norm.weight": (head_dim,)}
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config["num_hidden_layers"]):
        shapes |= {f"model.layers.{i}.{k}": v for k, v in layer.items()}
    return dict(sorted(shapes.items()))


def shard_size_bytes(size: str) -> int:
    """transformers' max_shard_size strings: "20KB" is 20 * 10**3 bytes, "5MiB" is 5 * 2**20."""
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "KB": 10**3, "MB": 10**6, "GB": 10**9}
    unit = next(u for u in units if size.upper().endswith(u))
    return int(float(size[:-len(unit)]) * units[unit])


def build_hf_checkpoint(folder: Path, name: str, seed: int = 0, dtype: str = "float32",
                        max_shard_size: str | None = None, **overrides) -> Path:
    """Save a random-weight Qwen2/Qwen3 checkpoint in transformers' layout with numpy + safetensors (no torch).

    Weights are scaled up so logits are far from uniform: every 1-D tensor (norms and biases) 1 + 0.2 N(0, 1),
    every matrix N(0, 0.08), the distribution the transformers-built fixture drew with torch.
    transformers loads the folder as its own (tests/test_checkpoint_builder.py checks that in the first CI leg),
    so the parity tests compare against it while the second leg runs without torch on the same weights.
    """
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = hf_config(name, dtype=dtype, **overrides)
    rng = np.random.default_rng(seed)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[dtype]
    tensors = {}
    for tensor, shape in hf_tensor_shapes(config).items():
        draw = rng.standard_normal(shape, dtype=np.float32)
        tensors[tensor] = (1.0 + 0.2 * draw if len(shape) == 1 else 0.08 * draw).astype(np_dtype)
    shards: list[dict] = [{}]
    limit = shard_size_bytes(max_shard_size) if max_shard_size else None
    for tensor, array in tensors.items():
        if limit and shards[-1] and sum(a.nbytes for a in shards[-1].values()) + array.nbytes > limit:
            shards.append({})
        shards[-1][tensor] = array
    if len(shards) == 1:
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, folder / file, metadata={"format": "pt"})
            weight_map |= dict.fromkeys(shard, file)
        index = {"metadata": {"total_parameters": sum(a.size for a in tensors.values()),
                              "total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {"_from_model_config": True, "output_attentions": False, "output_hidden_states": False,
                  "use_cache": True}
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return folder


def build_hf_checkpoint_with_transformers(folder: Path, name: str, seed: int = 0, dtype: str = "float32",
                                          max_shard_size: str | None = None, **overrides) -> Path:
    """The same checkpoint as transformers' save_pretrained writes it (torch's random weights): the layout oracle."""
    import torch
    import transformers

    cfg = {**TINY_CONFIGS[name], **overrides}
    cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
           "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)}[cfg.pop("model_type")]
    torch.manual_seed(seed)
    config = cls[0](**cfg, max_window_layers=0, use_sliding_window=False)
    model = cls[1](config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)
    return folder


# A test session compiles thousands of programs, and jit keeps each one (with its code pages) for the life of the
# process: one pytest process over the whole suite under jax 0.11 ran past the kernel's memory-map limit
# (vm.max_map_count, 65,530: a test of the batch-invariance matrix adds ~1,000) and XLA aborted mid-compile (CI
# leg 2, stop 49). After a test that leaves the process past these bounds, the compiled programs are dropped (the
# next test compiles what it needs).
MAX_MEMORY_MAPS = int(os.environ.get("POCKETJAX_TEST_MAX_MAPS", 30_000))
MAX_RSS_BYTES = 8 << 30


def process_footprint() -> tuple[int, int]:
    """(memory maps, resident bytes) of this process (Linux; (0, 0) elsewhere)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            maps = sum(1 for _ in f)
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0, 0
    return maps, rss


@pytest.fixture(autouse=True)
def bounded_compiled_programs():
    yield
    maps, rss = process_footprint()
    if maps > MAX_MEMORY_MAPS or rss > MAX_RSS_BYTES:
        jax.clear_caches()
        print(f"\n[conftest] {maps} memory maps, {rss >> 20} MiB resident: jax.clear_caches()", flush=True)


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """hf_checkpoint(name, **overrides) -> folder of a saved random-weight checkpoint, built once per session."""
    cache: dict[str, Path] = {}

    def make(name: str, **overrides) -> Path:
        key = name + json.dumps(overrides, sort_keys=True)
        if key not in cache:
            folder = tmp_path_factory.mktemp(name)
            cache[key] = build_hf_checkpoint(folder, name, **overrides)
        return cache[key]

    return make


FIXTURES = Path(__file__).resolve().parent / "fixtures"
# The official Qwen tokenizers (tests/fixtures/README.md) under a tiny random body: Qwen3's and Qwen2.5's real
# vocabulary (151,936 rows, the tokenizer's 151,669 tokens padded as the released models pad them) and their chat
# templates with tools, so structured outputs and tool calls run against the token pieces real models use.
QWEN_TOKENIZERS: dict[str, tuple[str, dict]] = {
    "qwen3": ("qwen3_kv1", dict(num_key_value_heads=2)),
    "qwen2.5": ("qwen2_gqa2_tied", {}),
}
QWEN_VOCAB = 151936
QWEN_EOS, QWEN_PAD = 151645, 151643  # <|im_end|>, <|endoftext|>: the released generation_config's eos ids


def unpack_qwen_tokenizer(name: str, folder: Path) -> Path:
    """tokenizer.json and tokenizer_config.json of `name` ("qwen3", "qwen2.5") decompressed into `folder`."""
    import lzma

    folder.mkdir(parents=True, exist_ok=True)
    for packed in sorted((FIXTURES / name).glob("*.json.xz")):
        (folder / packed.name.removesuffix(".xz")).write_bytes(lzma.decompress(packed.read_bytes()))
    return folder


@pytest.fixture(scope="session")
def qwen_checkpoint(tmp_path_factory):
    """qwen_checkpoint("qwen3" | "qwen2.5") -> folder of a random-weight checkpoint of that family's shape (hidden
    64, 2 layers, 4 heads, 2 KV heads, tied embeddings) with the official tokenizer and its 151,936-row vocabulary,
    built once per session."""
    cache: dict[str, Path] = {}

    def make(name: str) -> Path:
        if name not in cache:
            base, overrides = QWEN_TOKENIZERS[name]
            folder = tmp_path_factory.mktemp(name.replace(".", "_"))
            build_hf_checkpoint(folder, base, vocab_size=QWEN_VOCAB, bos_token_id=QWEN_PAD, eos_token_id=QWEN_EOS,
                                **overrides)
            generation = json.loads((folder / "generation_config.json").read_text())
            generation |= {"bos_token_id": QWEN_PAD, "eos_token_id": [QWEN_EOS, QWEN_PAD], "pad_token_id": QWEN_PAD}
            (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
            cache[name] = unpack_qwen_tokenizer(name, folder)
        return cache[name]

    return make


@contextlib.contextmanager
def served(llm, api_key: str | None = None, **app_options):
    """(BackgroundServer, openai.OpenAI client) of `llm` served on 127.0.0.1 (`create_app(llm, api_key=api_key,
    **app_options)`) while the block runs: the client never retries, so a test sees every status as sent.

    POCKETJAX_TEST_WARMUP=1 warms the engine up first, as `pocketjax serve` does by default: the serving battery
    then runs on a warmed-up server (CI runs it cold, as `--no-warmup` serves)."""
    import openai

    if os.environ.get("POCKETJAX_TEST_WARMUP") == "1":
        llm.engine.warmup(progress=False)

    from pocketjax.serve.http.server import BackgroundServer, create_app

    with BackgroundServer(create_app(llm, api_key=api_key, **app_options)) as server:
        yield server, openai.OpenAI(base_url=server.url + "/v1", api_key=api_key or "unused", max_retries=0,
                                    timeout=120)


@pytest.fixture
def abstract_gpu():
    """The GPU host's H200 as an abstract device for the test's duration, so jit(...).lower(lowering_platforms=
    ("cuda",)) works on a CPU host: since JAX 0.11 Pallas's Triton lowering asks for the GPU it targets and raises
    "No supported GPU devices found" without one (0.10 lowers the same with or without it)."""
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H200", num_cores=132, platform="gpu")
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("gpu",), abstract_device=device)):
        yield device


# Tiny mixture-of-experts configs (issue 68): qwen3_moe with every layer sparse (so it also loads stacked for scan),
# renormalized top-2 of 8; qwen2_moe with a dense layer among sparse ones (mlp_only_layers), top-3 of 8 without
# renormalizing, and the shared expert behind its sigmoid gate.
MOE_CONFIGS: dict[str, dict] = {
    "qwen3_moe": dict(model_type="qwen3_moe", vocab_size=263, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, attention_bias=False),
    "qwen2_moe": dict(model_type="qwen2_moe", vocab_size=257, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False,
                      decoder_sparse_step=1, mlp_only_layers=[1], tie_word_embeddings=True, qkv_bias=True),
}


def moe_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor transformers' Qwen2Moe/Qwen3MoeForCausalLM saves, by name (its per-expert layout, written out
    here from transformers' modules, not pocketjax's)."""
    h, vocab, layers = config["hidden_size"], config["vocab_size"], config["num_hidden_layers"]
    qwen3 = config["model_type"] == "qwen3_moe"
    d = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    e, i, dense = config["num_experts"], config["moe_intermediate_size"], config["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, h)
    for n in range(layers):
        at = f"model.layers.{n}."
        shapes |= {at + "input_layernorm.weight": (h,), at + "post_attention_layernorm.weight": (h,),
                   at + "self_attn.q_proj.weight": (q, h), at + "self_attn.k_proj.weight": (kv, h),
                   at + "self_attn.v_proj.weight": (kv, h), at + "self_attn.o_proj.weight": (h, q)}
        if config.get("qkv_bias", False) or config.get("attention_bias", False):
            shapes |= {at + "self_attn.q_proj.bias": (q,), at + "self_attn.k_proj.bias": (kv,),
                       at + "self_attn.v_proj.bias": (kv,)}
        if qwen3 and config.get("attention_bias", False):
            shapes[at + "self_attn.o_proj.bias"] = (h,)
        if qwen3:
            shapes |= {at + "self_attn.q_norm.weight": (d,), at + "self_attn.k_norm.weight": (d,)}
        if n in config["mlp_only_layers"] or (n + 1) % config["decoder_sparse_step"]:
            shapes |= {at + "mlp.gate_proj.weight": (dense, h), at + "mlp.up_proj.weight": (dense, h),
                       at + "mlp.down_proj.weight": (h, dense)}
            continue
        shapes[at + "mlp.gate.weight"] = (e, h)
        for x in range(e):
            shapes |= {f"{at}mlp.experts.{x}.gate_proj.weight": (i, h), f"{at}mlp.experts.{x}.up_proj.weight": (i, h),
                       f"{at}mlp.experts.{x}.down_proj.weight": (h, i)}
        if not qwen3:
            s = config["shared_expert_intermediate_size"]
            shapes |= {at + "mlp.shared_expert.gate_proj.weight": (s, h), at + "mlp.shared_expert.up_proj.weight": (s, h),
                       at + "mlp.shared_expert.down_proj.weight": (h, s), at + "mlp.shared_expert_gate.weight": (1, h)}
    return dict(sorted(shapes.items()))


def build_moe_checkpoint(folder: Path, name: str, seed: int = 0, dtype: str = "float32",
                         max_shard_size: str = "40KB", **overrides) -> Path:
    """A random-weight qwen2_moe / qwen3_moe checkpoint in transformers' layout, sharded (numpy + safetensors, no
    torch), drawn as `build_hf_checkpoint` draws: 1-D tensors 1 + 0.2 N(0, 1), matrices N(0, 0.08); the router's rows
    N(0, 0.5), so each token's top experts stand apart (no near-ties between the k-th and the next)."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    folder.mkdir(parents=True, exist_ok=True)
    cfg = {**MOE_CONFIGS[name], **overrides}
    config = {"architectures": [{"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}[
                  cfg["model_type"]]], "attention_dropout": 0.0, "bos_token_id": None, "dtype": dtype,
              "eos_token_id": None, "hidden_act": "silu", "initializer_range": 0.02, "max_position_embeddings": 32768,
              "output_router_logits": False, "rms_norm_eps": 1e-06, "router_aux_loss_coef": 0.001,
              "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "sliding_window": None,
              "use_cache": True, "use_sliding_window": False, **cfg}
    config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    rng = np.random.default_rng(seed)
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype]
    shards: list[dict] = [{}]
    limit = shard_size_bytes(max_shard_size)
    for tensor, shape in moe_tensor_shapes(config).items():
        draw = rng.standard_normal(shape, dtype=np.float32)
        scale = 0.5 if tensor.endswith("mlp.gate.weight") else 0.08
        array = (1.0 + 0.2 * draw if len(shape) == 1 else scale * draw).astype(np_dtype)
        if shards[-1] and sum(a.nbytes for a in shards[-1].values()) + array.nbytes > limit:
            shards.append({})
        shards[-1][tensor] = array
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, folder / file, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=2) + "\n")
    return folder


@pytest.fixture(scope="session")
def moe_checkpoint(tmp_path_factory):
    """moe_checkpoint("qwen3_moe" | "qwen2_moe", **overrides) -> folder of a random-weight sharded MoE checkpoint
    (`build_moe_checkpoint`), built once per session."""
    cache: dict[str, Path] = {}

    def make(name: str, **overrides) -> Path:
        key = name + json.dumps(overrides, sort_keys=True)
        if key not in cache:
            cache[key] = build_moe_checkpoint(tmp_path_factory.mktemp(name), name, **overrides)
        return cache[key]

    return make
