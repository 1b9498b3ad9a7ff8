"""The Triton attention kernels as JAX functions: launched through jax-triton on a GPU, through Triton's interpreter
on CPU (tests), and compiled offline for any CUDA target to read what the binary uses.

Why jax-triton: it compiles a `@triton.jit` function with the official Triton installed beside it and launches
the PTX through jaxlib's `triton_kernel_call` custom call, which never goes through XLA's own Triton emitter,
the component that refuses compute capability < 8.0 (jax#26799). Official Triton compiles `tl.dot` for sm75 with
FMA instructions (tensor-core mma only from sm80), so these kernels run on Turing (T4, RTX 20xx).

`decode_attention` and `prefill_attention` have the Pallas kernels' signatures; `interpret=True` runs the kernel
in Triton's interpreter (CPU torch tensors via `jax.pure_callback`; TRITON_INTERPRET=1 must be set before
triton is imported), so the same jitted wrapper, padding
and split-K combine are tested on a machine without a GPU; only the final `triton_call` differs on a GPU.
jax_triton and torch are imported when first needed (`tuning.jax_triton_unsupported` says whether jax-triton
can launch here); pocketjax imports this module only for the "triton" attention path.
"""
from __future__ import annotations

import functools
import re
import subprocess
import tempfile

import jax
import numpy as np

from pallas_kernels.triton_blocks import Launch
from pallas_kernels.triton_decode import plan_decode
from pallas_kernels.triton_prefill import plan_prefill

# Triton's names for the dtypes the kernels take (jax_triton keeps the same map, but only imports on a GPU jax).
TRITON_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "int8": "i8", "int32": "i32",
                 "float8_e4m3fn": "fp8e4nv"}


def run(launch: Launch, interpret: bool = False):
    """The attention result of `launch`: its kernel run by jax-triton, or by Triton's interpreter (CPU)."""
    if interpret:
        outs = jax.pure_callback(functools.partial(_interpret, launch), launch.out_shape, *launch.args)
    else:
        import jax_triton

        outs = jax_triton.triton_call(*launch.args, kernel=launch.kernel, out_shape=launch.out_shape,
                                      grid=launch.grid, num_warps=launch.num_warps, num_stages=launch.num_stages,
                                      name=f"pocketjax_{launch.kernel.__name__}", **launch.meta)
    return launch.finish(tuple(outs))


def _interpret(launch: Launch, *args):
    """Host side of interpret mode: the kernel over torch CPU tensors, outputs pre-filled with NaN (an element the
    kernel forgets to write shows up)."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(launch.kernel, InterpretedFunction):  # tl.cdiv & co. too: fixed when triton is imported
        raise RuntimeError(  # noqa: TRY004  (an environment problem, not a bad argument)
            "interpret=True needs TRITON_INTERPRET=1 in the environment before triton is imported: "
            "Triton makes a kernel compiled or interpreted when it is defined")
    ins = [torch.from_numpy(np.array(a)) for a in args]
    outs = [torch.full(o.shape, float("nan"), dtype=getattr(torch, np.dtype(o.dtype).name)) for o in launch.out_shape]
    launch.kernel[launch.grid](*ins, *outs, num_warps=launch.num_warps, num_stages=launch.num_stages, **launch.meta)
    return tuple(o.numpy() for o in outs)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_k", "interpret", "num_splits"))
def decode_attention(q, k_cache, v_cache, lengths, *, sm_scale=None, block_k=None, interpret=False,
                     slots=None, num_splits=None, k_scale=None, v_scale=None):
    """[S, q_heads, D] attention of query row s over keys 0..lengths[s]-1 of cache row slots[s] (Triton kernel).

    Arguments as `pallas_kernels.decode_attention`; interpret=True runs Triton's interpreter on CPU.
    """
    launch = plan_decode(q, k_cache, v_cache, lengths, sm_scale=sm_scale, block_k=block_k, slots=slots,
                         num_splits=num_splits, k_scale=k_scale, v_scale=v_scale, target="cpu" if interpret else None)
    return run(launch, interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "block_q", "block_k", "interpret"))
def prefill_attention(q, k_cache, v_cache, starts, q_lengths, *, sm_scale=None, block_q=None, block_k=None,
                      interpret=False, slots=None, k_scale=None, v_scale=None):
    """[B, Tq, q_heads, D] causal attention of new tokens at positions starts[b] + i (Triton kernel).

    Arguments as `pallas_kernels.prefill_attention`; interpret=True runs Triton's interpreter on CPU.
    """
    launch = plan_prefill(q, k_cache, v_cache, starts, q_lengths, sm_scale=sm_scale, block_q=block_q,
                          block_k=block_k, slots=slots, k_scale=k_scale, v_scale=v_scale,
                          target="cpu" if interpret else None)
    return run(launch, interpret)


def compile_offline(launch: Launch, capability: int):
    """`launch`'s kernel compiled by official Triton for CUDA compute capability `capability` (75, 80, 90, ...),
    no GPU needed: ptxas ships in the triton wheel. Pointers are assumed 16-byte aligned, as jax-triton does."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = launch.kernel.arg_names
    arrays = [*launch.args, *launch.out_shape]
    signature = {name: "*" + TRITON_DTYPES[np.dtype(a.dtype).name] for name, a in zip(names, arrays)}
    signature.update({name: "constexpr" for name in launch.meta})
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(arrays))}
    source = ASTSource(launch.kernel, signature, constexprs=dict(launch.meta), attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", capability, 32),
                          options=dict(num_warps=launch.num_warps, num_stages=launch.num_stages,
                                       enable_fp_fusion=True))  # as jax-triton compiles by default


def resource_usage(compiled) -> dict:
    """{"shared", "registers", "spill_stores", "spill_loads"} of a compiled kernel: shared bytes from Triton's
    metadata, the rest from `ptxas -v` over its PTX, run as Triton runs it for that architecture."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    capability = compiled.metadata.target.arch
    with tempfile.TemporaryDirectory() as tmp:
        ptx = f"{tmp}/kernel.ptx"
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        cmd = [get_ptxas(capability).path, "-v", f"--gpu-name={sm_arch_from_capability(capability)}", ptx,
               "-o", f"{tmp}/kernel.cubin"]
        log = subprocess.run(cmd, check=True, capture_output=True, text=True).stderr
    number = lambda pattern: int(re.search(pattern, log).group(1))
    return dict(shared=int(compiled.metadata.shared), registers=number(r"Used (\d+) registers"),
                spill_stores=number(r"(\d+) bytes spill stores"), spill_loads=number(r"(\d+) bytes spill loads"))
