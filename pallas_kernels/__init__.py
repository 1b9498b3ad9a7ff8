"""Pallas attention kernels (Triton GPU backend, interpret mode on CPU) and their plain-JAX references.

Pick the implementation with `tuning.resolve_attention_impl`; `reference` is the "xla" path.
"""
from pallas_kernels import reference, tuning
from pallas_kernels.decode_attention import decode_attention
from pallas_kernels.prefill_attention import prefill_attention

__all__ = ["decode_attention", "prefill_attention", "reference", "tuning"]
