"""pocketjax's optional native CPU kernels behind `jax.ffi`, compiled at first use with the system C++ compiler:
the product of every float weight (`skinny_matmul`, csrc/skinny_matmul.cc), of int8 / int4 weights
(`quantized_matmul`, same file: int8 dequantized in registers, int4 an integer product), of a mixture-of-experts
layer's (token, expert) pairs against its stacked experts in place (`expert_matmul`, `expert_quantized_matmul`, same
file: each pair the product of its row alone) and attention over the slotted cache
(`attention`, csrc/attention.cc).

Why native code in a pure-JAX library: (1) batch invariance (issue 43): XLA:CPU chooses its dot and reduction
algorithms, and so their summation order, from the shapes it sees (1 row vs 2, a prefill chunk vs a decode batch,
the kv-length bucket), so a request's logprobs changed with the requests beside it; both kernels compute every
output element by one fixed sequence of operations whatever the batch. (2) Speed: XLA:CPU has no bf16 product form
that streams a bf16 weight at the memory's bandwidth at 1-8 rows.

pocketjax is pure Python, so there is no install-time build: the first `available()` (when an Engine is made, outside
any jit trace, with a log line) compiles both sources into one library in a cache directory (POCKETJAX_KERNEL_CACHE,
else $XDG_CACHE_HOME/pocketjax/kernels, else ~/.cache/pocketjax/kernels, else a private temporary directory), named by
a hash of (sources, flags, compiler version, jaxlib version, CPU flags); built under a temporary name and renamed into
place, so concurrent processes never load a half-written library.

The cache is code this process runs, so it is not a way in (docs/security.md): the folder must be owned by this user
and not writable by group or others (created 0700), else nothing is loaded from or built into it (a warning names it
and why) and the library is built into a private temporary folder for this process instead: a refusal would leave
the engine on XLA's forms and lose batch invariance for a permission. A cached file is opened once, without
following a symlink, and must be a regular file owned by this user, not writable by group or others, carrying the
hash in its bytes (`pocketjax_build_key`); it is then loaded through that same descriptor (/proc/self/fd/N), so the
bytes checked are the bytes loaded. No compiler (POCKETJAX_CXX, else CXX, else c++ / g++ / clang++ on PATH;
POCKETJAX_CXX=none), a failed build, an unwritable cache or POCKETJAX_CPU_KERNELS=off: one log line and
`available()` is False; callers keep XLA's forms (and lose the bitwise batch invariance, README "Guarantees").
Nothing here raises into user code.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from pallas_kernels import reference

from ..errors import ConfigError
from .quant import TILE_ROWS, QuantizedWeight, dequantize

log = logging.getLogger("pocketjax")

SOURCES = tuple(Path(__file__).resolve().parent / "csrc" / name for name in ("skinny_matmul.cc", "attention.cc"))
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-Wno-psabi", "-ffp-contract=off")  # no -ffast-math and no
# contraction: sums and products as written (FMAs only where the source asks); no -march=native: the ISA is chosen
# at run time, so a cache shared between CPUs stays correct
TARGET = "pocketjax_skinny_matmul"
QUANTIZED_TARGET = "pocketjax_quantized_matmul"
ATTENTION_TARGET = "pocketjax_attention"
EXPERT_TARGET = "pocketjax_expert_matmul"
EXPERT_QUANTIZED_TARGET = "pocketjax_expert_quantized_matmul"
LIBRARY = "pocketjax_cpu_kernels"
BLOCK_ROWS = 8  # rows register-blocked in one pass over the weight (more rows: one pass per 8)
ISAS = {"auto": 0, "portable": 1, "avx2": 2, "avx512": 3, "avx512bf16": 4}  # the kernel's `isa` (csrc: ResolveIsa)


def cache_dir() -> Path:
    """Where compiled kernels live: POCKETJAX_KERNEL_CACHE, else the XDG cache (~/.cache) under pocketjax/kernels;
    with no home directory either, a private temporary directory (built once per process)."""
    if os.environ.get("POCKETJAX_KERNEL_CACHE"):
        return Path(os.environ["POCKETJAX_KERNEL_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "pocketjax" / "kernels"
    try:
        return Path.home() / ".cache" / "pocketjax" / "kernels"
    except (RuntimeError, KeyError):  # no HOME and no passwd entry
        return private_dir()


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
    parts = [*(source.read_bytes().hex() for source in SOURCES), " ".join(FLAGS), version, jaxlib.__version__,
             cpu_flags(), platform.machine()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def unsafe(info: os.stat_result) -> str | None:
    """Why a cache folder or file with this stat is not ours alone (None: it is): another owner, or writable by group
    or others (either could put code there that this process would run)."""
    if info.st_uid != os.geteuid():
        return f"is owned by uid {info.st_uid}, not this user (uid {os.geteuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by group or others (mode {stat.filemode(info.st_mode)})"
    return None


def safe_dir(directory: Path) -> Path:
    """`directory` (created 0700 if missing) where it is this user's alone, else a private temporary folder for this
    process (logged with the reason): no library is loaded from or built into a folder others can write."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    why = unsafe(directory.stat())
    if why is None:
        return directory
    private = private_dir()
    log.warning("pocketjax cpu kernels: the cache folder %s %s: nothing is loaded from or built there; building "
                "into %s for this process (chmod go-w / chown it, or set POCKETJAX_KERNEL_CACHE)", directory, why,
                private)
    return private


@functools.cache
def private_dir() -> Path:
    """A temporary folder only this user can write (0700), made once per process."""
    return Path(tempfile.mkdtemp(prefix="pocketjax-kernels-"))


def open_library(lib: Path, key: str) -> int:
    """A read-only descriptor of `lib`, opened once without following a symlink, if it is a regular file owned by this
    user, not writable by group or others, whose bytes (read from that descriptor) carry the build key `key`;
    ConfigError naming what is wrong otherwise (OSError where it cannot be opened). The caller closes it."""
    fd = os.open(lib, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        info = os.fstat(fd)
        why = "is not a regular file" if not stat.S_ISREG(info.st_mode) else unsafe(info)
        if why is None and not descriptor_carries_key(fd, key):
            why = "does not carry its build key"
        if why is not None:
            raise ConfigError(f"{lib}: {why}")
        return fd
    except BaseException:
        os.close(fd)
        raise


def descriptor_carries_key(fd: int, key: str) -> bool:
    """Whether the file open as `fd` embeds `key` (built from the sources and flags hashed as `key`)."""
    with os.fdopen(os.dup(fd), "rb") as f:
        return f"pocketjax-build-key:{key}".encode() in f.read()


def carries_key(lib: Path, key: str) -> bool:
    """Whether `lib` may be loaded as the library built as `key` (`open_library`'s checks pass)."""
    try:
        os.close(open_library(lib, key))
        return True
    except (OSError, ConfigError):
        return False


def load(lib: Path) -> ctypes.CDLL:
    """`lib` (a name `build` gave: it carries its key) loaded from the one descriptor `open_library` checked, so a file
    swapped in after the check is never what runs (Linux's /proc/self/fd; elsewhere the path, after the check).
    ConfigError / OSError where it may not or cannot be loaded."""
    fd = open_library(lib, lib.stem.rsplit("-", 1)[1])
    try:
        fd_path = f"/proc/self/fd/{fd}"
        return ctypes.CDLL(fd_path if os.path.exists(fd_path) else str(lib))
    finally:
        os.close(fd)


def build(compiler: str | None = None, directory: Path | None = None) -> Path | None:
    """The compiled kernel library, built into `directory` (default `cache_dir()`) unless a library carrying the
    same build key is already there; None when there is no compiler or the build fails (logged, never raised)."""
    compiler = compiler or find_compiler()
    if compiler is None:
        log.info("pocketjax cpu kernels: no C++ compiler (POCKETJAX_CXX / CXX / c++); XLA's product and attention "
                 "forms (not batch-invariant)")
        return None
    try:
        directory = safe_dir(Path(directory or cache_dir()))
        key = build_key(compiler)
        lib = directory / f"{LIBRARY}-{key}.so"
        if os.path.lexists(lib):
            try:
                os.close(open_library(lib, key))
                return lib
            except (OSError, ConfigError) as e:
                log.warning("pocketjax cpu kernels: %s; rebuilding it", e)
        fd, tmp = tempfile.mkstemp(prefix=lib.stem + ".", suffix=".tmp", dir=directory)
        os.close(fd)
        try:
            cmd = [compiler, *FLAGS, f"-DPOCKETJAX_BUILD_KEY=\"{key}\"", "-isystem", jax.ffi.include_dir(),
                   *map(str, SOURCES), "-o", tmp]
            log.info("pocketjax cpu kernels: compiling %s (once per machine, ~30 s)", lib.name)
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            if done.returncode:
                log.warning("pocketjax cpu kernels: build failed (%s); XLA's forms (not batch-invariant):\n%s",
                            " ".join(cmd), done.stderr[-2000:])
                return None
            os.chmod(tmp, 0o755)  # the linker's mode follows the umask: never group-writable (open_library refuses)
            os.replace(tmp, lib)  # atomic: another process sees no file or the whole one
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        log.info("pocketjax cpu kernels: built %s", lib)
        return lib
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("pocketjax cpu kernels: cannot build (%s); XLA's forms (not batch-invariant)", e)
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
        lib = load(path)
        jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(lib.PocketjaxSkinnyMatmul), platform="cpu")
        jax.ffi.register_ffi_target(QUANTIZED_TARGET, jax.ffi.pycapsule(lib.PocketjaxQuantizedMatmul),
                                    platform="cpu")
        jax.ffi.register_ffi_target(ATTENTION_TARGET, jax.ffi.pycapsule(lib.PocketjaxAttention), platform="cpu")
        jax.ffi.register_ffi_target(EXPERT_TARGET, jax.ffi.pycapsule(lib.PocketjaxExpertMatmul), platform="cpu")
        jax.ffi.register_ffi_target(EXPERT_QUANTIZED_TARGET, jax.ffi.pycapsule(lib.PocketjaxExpertQuantizedMatmul),
                                    platform="cpu")
    except (OSError, AttributeError, ValueError, RuntimeError, ConfigError) as e:
        log.warning("pocketjax cpu kernels: cannot load %s (%s); XLA's forms (not batch-invariant)", path, e)
        return None
    lib.PocketjaxSkinnyMatmulIsa.restype = ctypes.c_int
    log.info("pocketjax cpu kernels: %s loaded (products: %s with a bf16 weight and x, %s otherwise)", path.name,
             resolved_isa_name(jnp.bfloat16, jnp.bfloat16, lib=lib), resolved_isa_name(jnp.float32, lib=lib))
    return lib


def disabled() -> bool:
    """POCKETJAX_CPU_KERNELS=off (read at each trace): XLA's forms, e.g. to profile the step without the kernels."""
    return os.environ.get("POCKETJAX_CPU_KERNELS", "").strip().lower() in ("0", "off", "false", "no")


def available() -> bool:
    """True where the kernels are compiled, loaded and registered in this process, unless POCKETJAX_CPU_KERNELS=off.
    The first call builds them: `Engine(...)` and `load_model` make it outside any jit trace (a ~30 s compile
    inside a trace would stall it); harmless off the CPU."""
    return not disabled() and _library() is not None


def resolved_isa_name(x_dtype, w_dtype=jnp.float32, isa: str = "auto", lib: ctypes.CDLL | None = None) -> str:
    """Which product code path (an ISAS name) `isa` runs on this CPU for an x of `x_dtype` and a w of `w_dtype`."""
    lib = lib or _library()
    code = lib.PocketjaxSkinnyMatmulIsa(ctypes.c_int(ISAS[isa]), ctypes.c_int(jnp.dtype(x_dtype) == jnp.bfloat16),
                                        ctypes.c_int(jnp.dtype(w_dtype) == jnp.bfloat16))
    return {v: k for k, v in ISAS.items()}[code]


def skinny_matmul(x: jax.Array, w: jax.Array, isa: str = "auto", streams: bool = True) -> jax.Array:
    """x [rows, in] (float32 or bfloat16) @ w [out, in].T for a float32 or bfloat16 w: f32 sums, in x's dtype.

    Any row count; each output element is computed the same way whatever the row count (batch invariance).
    Differentiable (the derivative is XLA's product) and vmappable (one call per batch element). Call only where
    `available()`; on one device (XLA cannot partition the call: on a mesh it would gather w).
    `isa` forces a code path (tests, benchmarks): one of ISAS (`resolved_isa_name` says which runs). `streams`
    False: the vector paths' register blocks take adjacent weight rows instead of NB sequential streams (csrc: `Blocks`;
    the same bits, slower at 1-4 rows: for tests and `benchmarks/bench_streams.py`).
    """
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1] or w.dtype not in (jnp.float32, jnp.bfloat16):
        raise ConfigError(f"skinny_matmul: x [rows, in] and a float32 or bfloat16 w [out, in], got {x.shape} "
                          f"{x.dtype} and {w.shape} {w.dtype}")
    if x.dtype not in (jnp.float32, jnp.bfloat16) or isa not in ISAS:
        raise ConfigError(f"skinny_matmul: x float32 or bfloat16 and isa one of {tuple(ISAS)}, got {x.dtype}, {isa!r}")
    if not available():
        raise ConfigError("skinny_matmul: the CPU kernels are not available in this process (see the log)")
    return _product(x, w, isa, streams)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _product(x: jax.Array, w: jax.Array, isa: str, streams: bool) -> jax.Array:
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), x.dtype),
                            vmap_method="sequential")
    return call(x, w, isa=np.int32(ISAS[isa]), streams=streams)


@_product.defjvp
def _product_jvp(isa, streams, primals, tangents):
    """The product is bilinear: its tangent is XLA's dots of the tangents (transposable, so grad works too)."""
    x, w = primals
    dx, dw = tangents
    nk = (((1,), (1,)), ((), ()))

    def dot(a, b):
        return jax.lax.dot_general(a.astype(jnp.float32), b.astype(jnp.float32), nk)

    tangent = dot(dx, w) + dot(x, dw)
    return _product(x, w, isa, streams), tangent.astype(x.dtype)


def quantized_applies(w: QuantizedWeight) -> bool:
    """Whether `quantized_matmul` takes `w`: quant.py's int8 or packed int4 [out, in] (2-D, not a scan's stacked
    [layers, ...]), groups a multiple of 8 (int8) or 32 (int4) columns (a GPTQ perm: quant.matmul gathers x first),
    int4 values row-major or tiled (`quant.tile_rows`)."""
    values = {8: jnp.int8, 4: jnp.uint8}.get(w.bits)
    return (values is not None and w.values.ndim == 2 and w.values.dtype == values and w.scale.ndim == 2
            and w.group_size % (32 if w.bits == 4 else 8) == 0 and w.group_size * w.scale.shape[1] == w.shape[1]
            and (not w.tiled or (w.bits == 4 and w.values.shape[0] % TILE_ROWS == 0)))


def quantized_matmul(x: jax.Array, w: QuantizedWeight, isa: str = "auto", streams: bool = True) -> jax.Array:
    """x [rows, in] (float32 or bfloat16) @ W.T for quant.py's int8 or int4 W, in x's dtype, reading 8 or 5.25
    (int4, groups of 32) bits per weight instead of a dequantized weight's 32 written and read back. Any row count;
    each row's bits depend on that row and W only (batch invariance).

    int8: bitwise `skinny_matmul(x, quant.dequantize(W))` on the same code path, `auto` included (each weight
    dequantized in registers). int4: an integer product (what makes it faster than dequantizing, which was compute bound): each x
    row rounded to 16-bit integers, x ~= s * xi with s = max|row| / 32767 (the precision of int8's two digits; at most
    half a step per value), products exact in int32 per 32 columns, the group scales then the row's s in float32:
    within ~1e-4 of the float product of `dequantize(W)` relative to its largest term (`tests/test_cpu_kernels.py`
    checks it bitwise against a numpy model of those steps). Differentiable in x and W's scale (XLA's product with the
    dequantized weight). Call only where `available()` and `quantized_applies(W)`, on one device. `isa`, `streams`:
    as `skinny_matmul` (tiled int4 ignores `streams`: a tile is one stream)."""
    if x.ndim != 2 or not quantized_applies(w) or x.shape[1] != w.shape[1]:
        raise ConfigError(f"quantized_matmul: x [rows, in] and a 2-D int8 / int4 QuantizedWeight [out, in] with groups "
                          f"of 8k / 32k columns, got {x.shape} and {w.shape} {w.bits}-bit (group {w.group_size})")
    if x.dtype not in (jnp.float32, jnp.bfloat16) or isa not in ISAS:
        raise ConfigError(f"quantized_matmul: x float32 or bfloat16 and isa one of {tuple(ISAS)}, got {x.dtype}, "
                          f"{isa!r}")
    if not available():
        raise ConfigError("quantized_matmul: the CPU kernels are not available in this process (see the log)")
    zero = jnp.zeros(w.scale.shape, jnp.int8) if w.zero is None else w.zero  # None: symmetric, no subtraction
    return _quantized_product(x, w.values, w.scale.astype(jnp.float32), zero.astype(jnp.int8), isa, w.zero is not None,
                              w.tiled, streams)


@functools.partial(jax.custom_jvp, nondiff_argnums=(4, 5, 6, 7))
def _quantized_product(x, values, scale, zero, isa, has_zero, tiled, streams):
    call = jax.ffi.ffi_call(QUANTIZED_TARGET, jax.ShapeDtypeStruct((x.shape[0], values.shape[0]), x.dtype),
                            vmap_method="sequential")
    return call(x, values, scale, zero, isa=np.int32(ISAS[isa]), has_zero=has_zero, tiled=tiled, streams=streams)


@_quantized_product.defjvp
def _quantized_product_jvp(isa, has_zero, tiled, streams, primals, tangents):
    """Bilinear in x and scale: XLA's dots with the dequantized weight (and its scale's tangent)."""
    x, values, scale, zero = primals
    dx, _, dscale, _ = tangents
    nk = (((1,), (1,)), ((), ()))

    def weight(s):
        bits = 4 if values.dtype == jnp.uint8 else 8
        return dequantize(QuantizedWeight(values=values, scale=s, zero=zero, bits=bits, tiled=tiled))

    tangent = (jax.lax.dot_general(dx.astype(jnp.float32), weight(scale), nk)
               + jax.lax.dot_general(x.astype(jnp.float32), weight(dscale), nk))
    return _quantized_product(x, values, scale, zero, isa, has_zero, tiled, streams), tangent.astype(x.dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array, starts: jax.Array, q_lengths: jax.Array,
              sm_scale: float, k_scale: jax.Array | None = None, v_scale: jax.Array | None = None) -> jax.Array:
    """Causal GQA attention of q [B, Tq, Hq, D] (query i of row b at position starts[b] + i; rows i >= q_lengths[b]
    are padding, zeros out) over cache rows `slots` of k, v [S, Hkv, T, D] (float32, bfloat16, int8 or float8 with
    float32 k_scale / v_scale [S, Hkv, T]), in a fixed summation order per query row (csrc/attention.cc): its bits
    depend only on its position, its query and its keys, never on the batch, the chunk or the length bucket. The
    numerics of `pallas_kernels.reference` (within float32 rounding of it); differentiable through the reference.
    Call only where `available()`, on one device."""
    return _attention(q, k, v, slots, starts, q_lengths, k_scale, v_scale, float(sm_scale))


def _reference_attention(q, k, v, slots, starts, q_lengths, k_scale, v_scale, sm_scale):
    scales = {} if k_scale is None else {"k_scale": k_scale, "v_scale": v_scale}
    return reference.prefill_attention(q, k, v, starts, q_lengths, sm_scale=sm_scale, slots=slots, **scales)


@functools.partial(jax.custom_jvp, nondiff_argnums=(8,))
def _attention(q, k, v, slots, starts, q_lengths, k_scale, v_scale, sm_scale):
    quantized = k_scale is not None
    dummy = jnp.zeros((1,), jnp.float32)
    compute = reference.compute_dtype(q, k)
    call = jax.ffi.ffi_call(ATTENTION_TARGET, jax.ShapeDtypeStruct(q.shape, q.dtype), vmap_method="sequential")
    return call(q, k, v, k_scale if quantized else dummy, v_scale if quantized else dummy, slots.astype(jnp.int32),
                starts.astype(jnp.int32), q_lengths.astype(jnp.int32), sm_scale=np.float32(sm_scale),
                quantized=quantized, compute_bf16=jnp.dtype(compute) == jnp.bfloat16)


@_attention.defjvp
def _attention_jvp(sm_scale, primals, tangents):
    """The reference's derivative (the kernel computes the same function up to float32 rounding)."""
    def ref(q, k, v, k_scale, v_scale):
        return _reference_attention(q, k, v, slots, starts, q_lengths, k_scale, v_scale, sm_scale)

    q, k, v, slots, starts, q_lengths, k_scale, v_scale = primals
    float_tangents = [t for i, t in enumerate(tangents) if i not in (3, 4, 5)]
    _, tangent = jax.jvp(ref, (q, k, v, k_scale, v_scale), tuple(float_tangents))
    return _attention(*primals, sm_scale), tangent



def expert_matmul(x: jax.Array, w: jax.Array, ids: jax.Array, isa: str = "auto", streams: bool = True) -> jax.Array:
    """y [P, out], y[p] = x[p] @ w[ids[p]].T for x [P, in] (float32 or bfloat16), stacked float32 or bfloat16 experts
    w [E, out, in] and int32 ids [P] in [0, E) (mixture-of-experts pairs: model/moe.py), in x's dtype.

    The experts' weights are read in place, each chosen expert's rows once for all its pairs, the others never; each
    pair bitwise `skinny_matmul(x[p:p+1], w[ids[p]])`, whatever the other pairs (batch invariance). Differentiable
    (XLA's products of the gathered experts). Call only where `available()`, on one device; `isa`, `streams`: as
    `skinny_matmul`."""
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2] or ids.shape != x.shape[:1]:
        raise ConfigError(f"expert_matmul: x [P, in], w [E, out, in] and ids [P], got {x.shape}, {w.shape}, {ids.shape}")
    if x.dtype not in (jnp.float32, jnp.bfloat16) or w.dtype not in (jnp.float32, jnp.bfloat16) or isa not in ISAS:
        raise ConfigError(f"expert_matmul: x and w float32 or bfloat16, isa one of {tuple(ISAS)}, got {x.dtype}, "
                          f"{w.dtype}, {isa!r}")
    if not available():
        raise ConfigError("expert_matmul: the CPU kernels are not available in this process (see the log)")
    return _expert_product(x, w, ids.astype(jnp.int32), isa, streams)


@functools.partial(jax.custom_jvp, nondiff_argnums=(3, 4))
def _expert_product(x, w, ids, isa, streams):
    call = jax.ffi.ffi_call(EXPERT_TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype),
                            vmap_method="sequential")
    return call(x, w, ids, isa=np.int32(ISAS[isa]), streams=streams)


@_expert_product.defjvp
def _expert_product_jvp(isa, streams, primals, tangents):
    """Bilinear in x and w: XLA's products with each pair's expert gathered."""
    x, w, ids = primals
    dx, dw, _ = tangents

    def product(a, b):
        return jnp.einsum("pk,pnk->pn", a.astype(jnp.float32), jnp.take(b, ids, axis=0).astype(jnp.float32))

    return _expert_product(x, w, ids, isa, streams), (product(dx, w) + product(x, dw)).astype(x.dtype)


def expert_quantized_applies(w: QuantizedWeight) -> bool:
    """Whether `expert_quantized_matmul` takes `w`: stacked experts [E, out, in] in quant.py's int8 / int4 form,
    untiled, groups of 8k (int8) or 32k (int4) columns, no permutation."""
    values = {8: jnp.int8, 4: jnp.uint8}.get(w.bits)
    return (values is not None and w.values.ndim == 3 and w.values.dtype == values and w.scale.ndim == 3
            and not w.tiled and w.perm is None and w.group_size % (32 if w.bits == 4 else 8) == 0
            and w.group_size * w.scale.shape[-1] == w.shape[-1])


def expert_quantized_matmul(x: jax.Array, w: QuantizedWeight, ids: jax.Array, isa: str = "auto",
                            streams: bool = True) -> jax.Array:
    """`expert_matmul` for quantized experts (`expert_quantized_applies`): each pair bitwise
    `quantized_matmul(x[p:p+1], expert ids[p])`, the experts read in place. Differentiable in x (XLA's product with
    the gathered experts dequantized). Call only where `available()`, on one device."""
    if x.ndim != 2 or not expert_quantized_applies(w) or x.shape[1] != w.shape[-1] or ids.shape != x.shape[:1]:
        raise ConfigError(f"expert_quantized_matmul: x [P, in], stacked int8 / int4 experts [E, out, in] and ids [P], "
                          f"got {x.shape}, {w.shape} {w.bits}-bit, {ids.shape}")
    if x.dtype not in (jnp.float32, jnp.bfloat16) or isa not in ISAS:
        raise ConfigError(f"expert_quantized_matmul: x float32 or bfloat16 and isa one of {tuple(ISAS)}, got "
                          f"{x.dtype}, {isa!r}")
    if not available():
        raise ConfigError("expert_quantized_matmul: the CPU kernels are not available in this process (see the log)")
    zero = jnp.zeros(w.scale.shape, jnp.int8) if w.zero is None else w.zero
    return _expert_quantized_product(x, w.values, w.scale.astype(jnp.float32), zero.astype(jnp.int8),
                                     ids.astype(jnp.int32), isa, w.zero is not None, streams)


@functools.partial(jax.custom_jvp, nondiff_argnums=(5, 6, 7))
def _expert_quantized_product(x, values, scale, zero, ids, isa, has_zero, streams):
    call = jax.ffi.ffi_call(EXPERT_QUANTIZED_TARGET, jax.ShapeDtypeStruct((x.shape[0], values.shape[1]), x.dtype),
                            vmap_method="sequential")
    return call(x, values, scale, zero, ids, isa=np.int32(ISAS[isa]), has_zero=has_zero, streams=streams)


@_expert_quantized_product.defjvp
def _expert_quantized_product_jvp(isa, has_zero, streams, primals, tangents):
    """Linear in x: XLA's product with each pair's expert gathered and dequantized."""
    x, values, scale, zero, ids = primals
    dx = tangents[0]
    bits = 4 if values.dtype == jnp.uint8 else 8
    experts = dequantize(QuantizedWeight(values=jnp.take(values, ids, axis=0), scale=jnp.take(scale, ids, axis=0),
                                         zero=jnp.take(zero, ids, axis=0), bits=bits))
    tangent = jnp.einsum("pk,pnk->pn", dx.astype(jnp.float32), experts)
    return _expert_quantized_product(x, values, scale, zero, ids, isa, has_zero, streams), tangent.astype(x.dtype)
