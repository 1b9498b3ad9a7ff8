"""A hand-written CPU kernel behind `jax.ffi`: the bfloat16-weight decode product, compiled at first use.

XLA:CPU has no bf16 product form that streams a bf16 weight at the memory's bandwidth at 1-8 rows (its best reads
10-21 GB/s where float32 reads 23-35; benchmarks/README.md), so a bf16 decode step, half float32's bytes, was no
faster than float32. csrc/skinny_matmul.cc reads each weight row once for all rows, bf16 -> f32 by a shift, f32
FMAs (AVX-512 or AVX2 chosen at run time, a portable loop elsewhere), split over XLA's intra-op thread pool.

pocketjax is pure Python, so there is no install-time build: the first call compiles the source with the system C++
compiler into a cache directory (POCKETJAX_KERNEL_CACHE, else $XDG_CACHE_HOME/pocketjax/kernels, else
~/.cache/pocketjax/kernels), one file per hash of (source, flags, compiler version, jaxlib version, CPU flags), built
under a temporary name and renamed into place so concurrent processes never load a half-written library. No
compiler (POCKETJAX_CXX, else CXX, else c++ / g++ / clang++ on PATH; POCKETJAX_CXX=none disables the kernel) or a
failed build logs once and `skinny_matmul_available()` is False: callers keep XLA's form (as with
POCKETJAX_CPU_KERNELS=off).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from ..errors import ConfigError

log = logging.getLogger("pocketjax")

SOURCE = Path(__file__).resolve().parent / "csrc" / "skinny_matmul.cc"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-Wno-psabi")  # no -ffast-math: sums as
# written; no -march=native: the ISA is chosen at run time, so a cache shared between CPUs stays correct
TARGET = "pocketjax_skinny_matmul"
BLOCK_ROWS = 8  # rows register-blocked in one pass over the weight (more rows: one pass per 8)
ISAS = {"auto": 0, "portable": 1, "avx2": 2, "avx512": 3, "avx512bf16": 4}  # the kernel's `isa` (csrc: ResolveIsa)


def cache_dir() -> Path:
    """Where compiled kernels live: POCKETJAX_KERNEL_CACHE, else the XDG cache (~/.cache) under pocketjax/kernels."""
    if os.environ.get("POCKETJAX_KERNEL_CACHE"):
        return Path(os.environ["POCKETJAX_KERNEL_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pocketjax" / "kernels"


def find_compiler() -> str | None:
    """The C++ compiler to build with: POCKETJAX_CXX ("none" or "": no kernel), else CXX, else the first on PATH."""
    for name in ("POCKETJAX_CXX", "CXX"):
        if name in os.environ:
            chosen = os.environ[name].strip()
            return None if chosen.lower() in ("", "none", "off") else shutil.which(chosen)
    return next(filter(None, map(shutil.which, ("c++", "g++", "clang++"))), None)


def cpu_flags() -> str:
    """The CPU's feature flags (Linux /proc/cpuinfo), else the machine name: part of the cache key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def build_key(compiler: str) -> str:
    """The hash naming a compiled library: anything that changes the binary or what it may run on changes it."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    parts = [SOURCE.read_bytes().hex(), " ".join(FLAGS), version, jaxlib.__version__, cpu_flags(), platform.machine()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def build(compiler: str | None = None, directory: Path | None = None) -> Path | None:
    """The compiled kernel library, built into `directory` (default `cache_dir()`) unless already there; None when
    there is no compiler or the build fails (logged). `compiler` overrides `find_compiler()`."""
    compiler = compiler or find_compiler()
    if compiler is None:
        log.info("pocketjax cpu kernel: no C++ compiler (POCKETJAX_CXX / CXX / c++); bf16 products use XLA's form")
        return None
    directory = Path(directory or cache_dir())
    try:
        lib = directory / f"{TARGET}-{build_key(compiler)}.so"
        if lib.exists():
            return lib
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=lib.stem + ".", suffix=".tmp", dir=directory)
        os.close(fd)
        try:
            cmd = [compiler, *FLAGS, "-isystem", jax.ffi.include_dir(), str(SOURCE), "-o", tmp]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if done.returncode:
                log.warning("pocketjax cpu kernel: build failed (%s), bf16 products use XLA's form:\n%s",
                            " ".join(cmd), done.stderr[-2000:])
                return None
            os.replace(tmp, lib)  # atomic: another process sees no file or the whole one
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        log.info("pocketjax cpu kernel: built %s", lib)
        return lib
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("pocketjax cpu kernel: cannot build (%s); bf16 products use XLA's form", e)
        return None


@functools.cache
def _library() -> ctypes.CDLL | None:
    """This process's kernel library, built (or found in the cache), loaded and registered with XLA once; None
    (logged once) where it cannot be, or off the CPU backend."""
    if jax.default_backend() != "cpu":
        return None
    path = build()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.PocketjaxSkinnyMatmul), platform="cpu")
    except (OSError, AttributeError, ValueError, RuntimeError) as e:
        log.warning("pocketjax cpu kernel: cannot load %s (%s); bf16 products use XLA's form", path, e)
        return None
    lib.PocketjaxSkinnyMatmulIsa.restype = ctypes.c_int
    log.info("pocketjax cpu kernel: %s loaded (bf16 x: %s, f32 x: %s)", path.name,
             resolved_isa_name(jnp.bfloat16, lib=lib), resolved_isa_name(jnp.float32, lib=lib))
    return lib


def skinny_matmul_available() -> bool:
    """True where the kernel is compiled, loaded and registered in this process (builds it on the first call), unless
    POCKETJAX_CPU_KERNELS=off (read at each trace: XLA's forms, e.g. to profile the step without the kernel)."""
    if os.environ.get("POCKETJAX_CPU_KERNELS", "").strip().lower() in ("0", "off", "false", "no"):
        return False
    return _library() is not None


def resolved_isa_name(x_dtype, isa: str = "auto", lib: ctypes.CDLL | None = None) -> str:
    """Which code path (an ISAS name) `isa` runs on this CPU for an x of `x_dtype`."""
    lib = lib or _library()
    code = lib.PocketjaxSkinnyMatmulIsa(ctypes.c_int(ISAS[isa]), ctypes.c_int(jnp.dtype(x_dtype) == jnp.bfloat16))
    return {v: k for k, v in ISAS.items()}[code]


def skinny_matmul(x: jax.Array, w: jax.Array, isa: str = "auto") -> jax.Array:
    """x [rows, in] (float32 or bfloat16) @ w [out, in].T for a bfloat16 w: f32 sums, returned in x's dtype.

    Any row count is correct (one pass over the weight per BLOCK_ROWS rows); decode sizes are what it is for.
    Differentiable (the derivative is XLA's product) and vmappable (one call per batch element). Call only where
    `skinny_matmul_available()`; on one device (XLA cannot partition the call: on a mesh it would gather w).
    `isa` forces a code path (tests, benchmarks): one of ISAS (`resolved_isa_name` says which runs).
    """
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1] or w.dtype != jnp.bfloat16:
        raise ConfigError(f"skinny_matmul: x [rows, in] and a bfloat16 w [out, in], got {x.shape} {x.dtype} and "
                          f"{w.shape} {w.dtype}")
    if x.dtype not in (jnp.float32, jnp.bfloat16) or isa not in ISAS:
        raise ConfigError(f"skinny_matmul: x float32 or bfloat16 and isa one of {tuple(ISAS)}, got {x.dtype}, {isa!r}")
    if not skinny_matmul_available():
        raise ConfigError("skinny_matmul: the CPU kernel is not available in this process (see the log)")
    return _product(x, w, isa)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2,))
def _product(x: jax.Array, w: jax.Array, isa: str) -> jax.Array:
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), x.dtype),
                            vmap_method="sequential")
    return call(x, w, isa=np.int32(ISAS[isa]))


@_product.defjvp
def _product_jvp(isa, primals, tangents):
    """The product is bilinear: its tangent is XLA's dots of the tangents (transposable, so grad works too)."""
    x, w = primals
    dx, dw = tangents
    nk = (((1,), (1,)), ((), ()))

    def dot(a, b):
        return jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), nk)

    tangent = dot(dx, w) + dot(x, dw)
    return _product(x, w, isa), tangent.astype(x.dtype)
