"""Pallas attention kernels (Triton GPU backend, interpret mode on CPU) and their plain-JAX references.

`tuning` holds the block presets per GPU and says whether a device can run the kernels
(`tuning.triton_unsupported`); `reference` has the same signatures in plain JAX. The same kernels written in Triton
for GPUs below compute capability 8.0 (`triton_decode`, `triton_prefill`, launched by `triton_launch` through
jax-triton) import triton and are not imported here: import `pallas_kernels.triton_launch` to use them.
"""
from pallas_kernels import reference, tuning
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.prefill_attention import prefill_attention

__all__ = ["decode_attention", "prefill_attention", "reference", "tuning"]
