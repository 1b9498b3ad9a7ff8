"""Roofline bounds for the engine benchmark: this machine's measured peaks and a model's byte / FLOP accounting.

Decode is bandwidth-bound: every step reads all weights once (the lm_head included) plus each sequence's cached
K/V, whatever the batch. Prefill is compute-bound: 2 FLOPs per weight per token, plus causal attention. A measured
figure divided by its bound says how much of the machine the engine uses; the bounds come from this machine's own
measured read bandwidth and matmul throughput, not from a datasheet.

    PYTHONPATH=. python benchmarks/roofline.py [--dtype float32] [--json peaks.json]
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, astuple, dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pocketjax.model.config import ModelConfig


def best_seconds(fn, repeats: int) -> float:
    """Fastest of `repeats` timed calls after one warm-up call (peaks are best cases: the minimum is the estimate)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def read_bandwidth(n_bytes: int, repeats: int) -> dict[str, float]:
    """bytes/s of two jitted read-only passes over one float32 array far larger than the caches, as a decode step
    reads its weights: a row reduction (`a.sum(axis=1)`, rows split across the cores) and a matrix-vector product
    (`a @ x`, the batch-1 product). Nothing large is written, so this is the read bandwidth decode is bound by; a
    copy also writes, and its figure swings with the write path (28.5 and 49 GB/s in one run on a 2-core box).
    """
    a = jnp.ones((n_bytes // 4096, 1024), jnp.float32)
    x = jnp.ones((1024,), jnp.float32)
    forms = {"reduce": jax.jit(lambda a: a.sum(axis=1)), "gemv": jax.jit(lambda a: a @ x)}
    return {name: a.nbytes / best_seconds(lambda f=f: f(a).block_until_ready(), repeats) for name, f in forms.items()}


def jax_copy_bandwidth(n_bytes: int, repeats: int) -> float:
    """bytes/s of a jitted elementwise pass over a large float32 array (one read, one write per element).

    The input is donated so the output reuses its buffer: a fresh 256 MiB output per call would time the kernel's
    page faults on first touch (measured ~8x slower here), not the memory system.
    """
    scale = jax.jit(lambda a: a * 1.0001, donate_argnums=0)
    state = [jnp.ones((n_bytes // 4,), jnp.float32)]

    def step():
        state[0] = scale(state[0]).block_until_ready()

    return 2 * n_bytes / best_seconds(step, repeats)


def matmul_flops(n: int, dtype: str, repeats: int) -> float:
    """FLOP/s of one n x n x n jitted matmul in dtype (XLA:CPU's best case: large and square)."""
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32).astype(dtype)
    mm = jax.jit(lambda x, y: x @ y)
    return 2 * n**3 / best_seconds(lambda: mm(a, a).block_until_ready(), repeats)


@dataclass(frozen=True)
class Peaks:
    """Measured peaks of this machine: read bandwidth (bytes/s, the roofline: best of the read passes), the copy
    bandwidth beside it (information only), and matmul FLOP/s."""

    bandwidth_bytes_s: float
    read_reduce_bytes_s: float
    read_gemv_bytes_s: float
    copy_bytes_s: float
    matmul_flop_s: float
    matmul_dtype: str
    matmul_n: int
    probe_bytes: int


def measure_peaks(dtype: str = "float32", probe_bytes: int = 1 << 30, matmul_n: int = 2048,
                  repeats: int = 8) -> Peaks:
    """Measure read bandwidth (the best read pass counts), copy bandwidth and dtype matmul throughput."""
    read = read_bandwidth(probe_bytes, repeats)
    copy = jax_copy_bandwidth(min(probe_bytes, 256 << 20), repeats)
    flops = matmul_flops(matmul_n, dtype, repeats)
    return Peaks(max(read.values()), read["reduce"], read["gemv"], copy, flops, dtype, matmul_n, probe_bytes)


def best_of(a: Peaks, b: Peaks) -> Peaks:
    """Each peak at its best over two measurements (on a shared machine, neighbours only ever lower them)."""
    return Peaks(*(max(x, y) if isinstance(x, float) else x for x, y in zip(astuple(a), astuple(b))))


def spread(a: Peaks, b: Peaks) -> float:
    """How far two read-bandwidth measurements (start and end of a run) differ, as a share of the larger."""
    return abs(a.bandwidth_bytes_s - b.bandwidth_bytes_s) / max(a.bandwidth_bytes_s, b.bandwidth_bytes_s)


# ---- model accounting -----------------------------------------------------------------------------------------------

def itemsize(dtype: str) -> int:
    return jnp.dtype(dtype).itemsize


def layer_matmul_params(config: ModelConfig) -> float:
    """Weights of one decoder layer that a token multiplies through (q, k, v, o and its MLP), averaged over the layers:
    a sparse layer counts its router, its top_k experts and its shared expert (`num_params(active=True)`)."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    mlp = sum(3 * h * config.intermediate_size if config.moe is None or not config.moe.sparse(n) else
              config.moe.num_experts * h + 3 * h * (config.moe.top_k * config.moe.intermediate_size
                                                    + config.moe.shared_intermediate_size)
              for n in range(config.num_layers)) / config.num_layers
    return h * q + 2 * h * kv + q * h + mlp


def experts_read(num_experts: int, top_k: int, rows: int) -> float:
    """Distinct experts a sparse layer reads for `rows` tokens, in expectation when each token's top_k are a uniform
    draw: E (1 - (1 - k/E)^rows). Random-weight routers are close to uniform; a trained one is skewed (fewer)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** rows)


def weight_bytes_per_step(config: ModelConfig, dtype: str, batch: int) -> float:
    """Weight bytes one decode step reads: every layer, the norms and the full lm_head, plus `batch` embedding rows;
    of a sparse layer's experts only those its `batch` rows route to (`experts_read`: pocketjax's expert kernels read
    the chosen experts in place, each once per step).

    A tied model's lm_head is the embedding matrix (read once, in full); an untied one reads its lm_head in full
    and only the looked-up rows of the embedding.
    """
    h, v, moe = config.hidden_size, config.vocab_size, config.moe
    total = float(config.num_params(active=moe is not None))
    if moe is not None:  # active counts top_k experts per sparse layer: a batch reads the union of its rows' experts
        extra = experts_read(moe.num_experts, moe.top_k, batch) - moe.top_k
        total += sum(extra * 3 * h * moe.intermediate_size for n in range(config.num_layers) if moe.sparse(n))
    if not config.tie_word_embeddings:
        total -= v * h - batch * h  # the untied embedding: only `batch` rows are gathered
    return total * itemsize(dtype)


def kv_bytes_per_token(config: ModelConfig, dtype: str) -> int:
    """Cached K and V bytes of one token position across all layers."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize(dtype)


def decode_bytes(config: ModelConfig, dtype: str, batch: int, context: float) -> float:
    """Bytes a decode step must read: all weights once + each of `batch` sequences' K/V over `context` positions."""
    return weight_bytes_per_step(config, dtype, batch) + batch * context * kv_bytes_per_token(config, dtype)


def attention_flops(config: ModelConfig, query_positions: np.ndarray) -> float:
    """QK^T and PV FLOPs (2 each per multiply-add) for queries at the given 0-based positions (causal: p+1 keys)."""
    keys = float(np.sum(np.asarray(query_positions, np.float64) + 1))
    return 4.0 * config.num_layers * config.num_heads * config.head_dim * keys


def prefill_flops(config: ModelConfig, batch: int, prompt_len: int) -> float:
    """FLOPs a prefill of `batch` prompts of `prompt_len` tokens must do; logits only for each prompt's last token."""
    per_token = 2.0 * config.num_layers * layer_matmul_params(config)
    lm_head = 2.0 * config.hidden_size * config.vocab_size
    attn = attention_flops(config, np.arange(prompt_len))
    return batch * (prompt_len * per_token + lm_head + attn)


def decode_flops(config: ModelConfig, batch: int, context: float) -> float:
    """FLOPs of one decode step of `batch` sequences, each attending over `context` positions."""
    per_token = 2.0 * config.num_layers * layer_matmul_params(config) + 2.0 * config.hidden_size * config.vocab_size
    attn = 4.0 * config.num_layers * config.num_heads * config.head_dim * context
    return batch * (per_token + attn)


def decode_bound_tok_s(config: ModelConfig, dtype: str, batch: int, context: float, peaks: Peaks) -> dict:
    """Decode roofline at this batch: the bandwidth bound, the compute bound, and the tokens/s the tighter allows."""
    step_bytes = decode_bytes(config, dtype, batch, context)
    step_flops = decode_flops(config, batch, context)
    t_bw = step_bytes / peaks.bandwidth_bytes_s
    t_fl = step_flops / peaks.matmul_flop_s
    return {"step_bytes": step_bytes, "step_flops": step_flops, "bandwidth_bound_tok_s": batch / t_bw,
            "compute_bound_tok_s": batch / t_fl, "roofline_tok_s": batch / max(t_bw, t_fl)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Measure this machine's read bandwidth and matmul FLOP/s.")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--probe-mib", type=int, default=1024)
    p.add_argument("--matmul-n", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    peaks = measure_peaks(args.dtype, args.probe_mib << 20, args.matmul_n, args.repeats)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(peaks), f, indent=2)
    print("| measure | value |\n|---|---:|")
    print(f"| read bandwidth, row reduction (GB/s) | {peaks.read_reduce_bytes_s / 1e9:.2f} |")
    print(f"| read bandwidth, matrix-vector product (GB/s) | {peaks.read_gemv_bytes_s / 1e9:.2f} |")
    print(f"| copy bandwidth (GB/s, read + write) | {peaks.copy_bytes_s / 1e9:.2f} |")
    print(f"| matmul {args.matmul_n}^3 {args.dtype} (GFLOP/s) | {peaks.matmul_flop_s / 1e9:.1f} |")


if __name__ == "__main__":
    main()
