"""Versions of the native CPU kernels (csrc/skinny_matmul.cc, csrc/attention.cc) timed against this tree's in ONE
process: every product of one decode step of a model's shapes (bench_streams' step), or with `--weights attention`
every layer's decode attention (`--keys` positions per row, each layer its own cache), each version's program in
turn within every round, their outputs asserted bitwise equal. Reports each version's median and the median of its
per-round speedup over this tree's kernels (tree time / version time, paired within a round).

    python benchmarks/kernel_ab.py --variant git:HEAD~1 [--variant path/to/skinny_matmul.cc ...]
                                   [--weights float32,int8,attention] [--rows 1,2,4,8] [--keys 161] [--rounds 15]
                                   [--json OUT] [--quick]

Why: on a shared 2-core box a process's speed drifts 20-30% between runs, so versions timed in separate processes
(separate checkouts and kernel caches) cannot resolve a 10% change. Here each version is compiled with the tree's
flags (cpu_kernels.FLAGS) into a library of its own, registered under its own FFI target names, and each round runs
all of them back to back (rotating which goes first), so the drift falls on every version alike and the paired ratio
cancels it. A version is `git:REV` (both sources at that revision) or a source file: a file named attention.cc takes
the attention kernel's place, any other the products'; the other source is this tree's. It must keep the FFI
handlers' names and attributes. Pass `--bits-may-differ` for a version meant to change the sums.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import itertools
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: pocketjax + siblings

from benchmarks.bench_streams import step_cases, step_products  # noqa: E402
from benchmarks.common import (add_options, add_quick, machine, markdown_table, parse, parse_ints,  # noqa: E402
                               write_json)
from benchmarks.presets import PRESETS  # noqa: E402
from pocketjax.model import cpu_kernels  # noqa: E402

QUICK = dict(model="qwen3-tiny", weights="float32,int8", rows="1,3", rounds=3)
REPO = Path(__file__).resolve().parent.parent
# each source's FFI handlers: the cpu_kernels global naming the target -> the handler's symbol
HANDLERS = {"skinny_matmul.cc": {"TARGET": "PocketjaxSkinnyMatmul", "QUANTIZED_TARGET": "PocketjaxQuantizedMatmul"},
            "attention.cc": {"ATTENTION_TARGET": "PocketjaxAttention"}}


def version_sources(spec: str) -> tuple[str, ...]:
    """The C++ sources of a --variant, in cpu_kernels.SOURCES' order: both at `git:REV`, or the file given in place
    of the tree's source of its name (attention.cc), or of the products' (any other name)."""
    if spec.startswith("git:"):
        return tuple(subprocess.run(["git", "-C", str(REPO), "show", f"{spec[4:]}:{path.relative_to(REPO)}"],
                                    capture_output=True, text=True, check=True).stdout
                     for path in cpu_kernels.SOURCES)
    mine = Path(spec).name if Path(spec).name in HANDLERS else "skinny_matmul.cc"
    return tuple(Path(spec).read_text() if path.name == mine else path.read_text() for path in cpu_kernels.SOURCES)


@functools.cache  # XLA keeps a target name's first handler for the process: one registration per source
def register(sources: tuple[str, ...]) -> dict[str, str]:
    """Compile `sources` into one library as cpu_kernels does and register its handlers under names of their own
    (the sources' hash); the cpu_kernels globals that select them (TARGET, QUANTIZED_TARGET, ATTENTION_TARGET)
    mapped to those names."""
    suffix = "_" + hashlib.sha256("\0".join(sources).encode()).hexdigest()[:12]
    with tempfile.TemporaryDirectory() as tmp:  # a loaded library outlives its file
        files = [Path(tmp) / path.name for path in cpu_kernels.SOURCES]
        for file, source in zip(files, sources):
            file.write_text(source)
        lib_path = Path(tmp) / "kernels.so"
        cmd = [cpu_kernels.find_compiler(), *cpu_kernels.FLAGS, "-isystem", jax.ffi.include_dir(), *map(str, files),
               "-o", str(lib_path)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"a --variant does not build:\n{done.stderr[-3000:]}")
        lib = ctypes.CDLL(str(lib_path))
    targets = {}
    for handlers in HANDLERS.values():
        for name, symbol in handlers.items():
            targets[name] = getattr(cpu_kernels, name) + suffix
            jax.ffi.register_ffi_target(targets[name], jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return targets


def attention_cases(model: str, rows: list[int], keys: int) -> Iterator[tuple[str, list, int, jax.Array]]:
    """("attention", every layer's (k, v) cache, rows, q) per row count: the preset's heads, one slot per row, each
    row's query at position keys - 1 (so it reads `keys` keys of every layer), float32."""
    config = PRESETS[model]
    heads, kv_heads, dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    rng = np.random.default_rng(0)
    for count in rows:
        shape = (count, kv_heads, keys, dim)
        caches = [tuple(jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
                  for _ in range(config["num_hidden_layers"])]
        yield "attention", caches, count, jnp.asarray(rng.standard_normal((count, 1, heads, dim)), jnp.float32)


def step_attention(caches: list):
    """One jitted program: every layer's decode attention of q over its own cache."""
    rows, _, keys, dim = caches[0][0].shape

    def run(q, caches):
        slots, starts = jnp.arange(rows, dtype=jnp.int32), jnp.full((rows,), keys - 1, jnp.int32)
        return [cpu_kernels.attention(q, k, v, slots, starts, jnp.ones((rows,), jnp.int32), dim ** -0.5)
                for k, v in caches]
    return jax.jit(run)


def programs(versions: dict[str, dict[str, str]], weights: list, x: jax.Array) -> dict:
    """Each version's step program, traced and compiled with its targets (checked in the lowered module) and run
    once; the outputs of every version returned beside the programs."""
    out = {}
    for name, targets in versions.items():
        with mock.patch.multiple(cpu_kernels, **targets):
            program = step_attention(weights) if isinstance(weights[0], tuple) else step_products(weights, True)
            called = set(re.findall(r"custom_call @(\w+)", program.lower(x, weights).as_text()))
            if not called or not called <= set(targets.values()):
                raise RuntimeError(f"{name}: the traced program calls {sorted(called)}, not its own {targets}")
            result = jax.block_until_ready(program(x, weights))
        out[name] = (program, result)
    return out


def compare(versions: dict[str, dict[str, str]], weights: list, x: jax.Array, rounds: int, same_bits: bool) -> dict:
    """Median ms per version and its paired per-round speedup over the first version (this tree's kernel)."""
    runs = programs(versions, weights, x)
    names = list(runs)
    base = runs[names[0]][1]
    for name in names[1:]:
        if same_bits and not all(np.array_equal(a, b) for a, b in zip(base, runs[name][1])):
            raise RuntimeError(f"{name} gives other bits than this tree's kernel (--bits-may-differ if it should)")
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds):
        for name in names[i % len(names):] + names[:i % len(names)]:  # who goes first rotates
            program, _ = runs[name]
            start = time.perf_counter()
            jax.block_until_ready(program(x, weights))
            times[name].append(time.perf_counter() - start)
    return {"ms": {n: 1e3 * statistics.median(t) for n, t in times.items()},
            "speedup": {n: statistics.median(a / b for a, b in zip(times[names[0]], t)) for n, t in times.items()},
            "times_s": times}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variant", action="append", default=[],
                   help="a kernel source file (attention.cc: the attention kernel), or git:REV (repeatable)")
    p.add_argument("--bits-may-differ", action="store_true", help="do not require the tree kernel's bits")
    add_options(p, model="qwen3-0.6b", weights="float32,int8", rows="1,2,4,8", keys=161, rounds=15, json=None)
    args = parse(add_quick(p, QUICK), argv, QUICK)
    if not args["variant"]:
        raise SystemExit("--variant: at least one kernel version to time against this tree's")
    forms = args["weights"].split(",")
    products = ",".join(f for f in forms if f != "attention")
    step = step_cases(args["model"], products or "float32", args["rows"])  # checks the arguments before any compile
    cases = itertools.chain(step if products else (), attention_cases(args["model"], parse_ints(args["rows"]),
                                                                      args["keys"]) if "attention" in forms else ())
    versions = {"tree": {name: getattr(cpu_kernels, name) for handlers in HANDLERS.values() for name in handlers}}
    versions.update({spec: register(version_sources(spec)) for spec in args["variant"]})
    records = [{"weights": form, "rows": rows, "calls": len(weights),
                **compare(versions, weights, x, args["rounds"], not args["bits_may_differ"])}
               for form, weights, rows, x in cases]
    write_json(args["json"], {"settings": args, "machine": machine("cpu", "usable_cores", "jax", "loadavg"),
                              "records": records})
    names = list(versions)
    print(markdown_table(["model", "weights", "rows", *(f"{n} ms" for n in names),
                          *(f"{n} speedup" for n in names[1:])], (
        [args["model"], r["weights"], r["rows"], *(f"{r['ms'][n]:.2f}" for n in names),
         *(f"{r['speedup'][n]:.3f}x" for n in names[1:])] for r in records)))


if __name__ == "__main__":
    main()
