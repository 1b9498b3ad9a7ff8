"""Versions of the native product kernel (csrc/skinny_matmul.cc) timed against this tree's in ONE process: every
product of one decode step of a model's shapes (bench_streams' step), each version's program in turn within every
round, their outputs asserted bitwise equal. Reports each version's median and the median of its per-round speedup
over this tree's kernel (tree time / version time, paired within a round).

    python benchmarks/kernel_ab.py --variant git:HEAD~1 [--variant path/to/skinny_matmul.cc ...]
                                   [--weights float32,int8] [--rows 1,2,4,8] [--rounds 15] [--json OUT] [--quick]

Why: on a shared 2-core box a process's speed drifts 20-30% between runs, so versions timed in separate processes
(separate checkouts and kernel caches) cannot resolve a 10% change. Here each version is compiled with the tree's
flags (cpu_kernels.FLAGS) into a library of its own, registered under its own FFI target names, and each round runs
all of them back to back (rotating which goes first), so the drift falls on every version alike and the paired ratio
cancels it. A version is a source file, or `git:REV` (that revision's csrc/skinny_matmul.cc); it must keep the FFI
handlers' names and attributes. Pass `--bits-may-differ` for a version meant to change the sums.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import hashlib
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere: pocketjax + siblings

from benchmarks.bench_streams import step_cases, step_products  # noqa: E402
from benchmarks.common import add_options, add_quick, machine, markdown_table, parse, write_json  # noqa: E402
from pocketjax.model import cpu_kernels  # noqa: E402

QUICK = dict(model="qwen3-tiny", weights="float32,int8", rows="1,3", rounds=3)
REPO = Path(__file__).resolve().parent.parent
SOURCE = "pocketjax/model/csrc/skinny_matmul.cc"


def version_source(spec: str) -> str:
    """The C++ source a --variant names: a file, or `git:REV` (the kernel at that revision of this repository)."""
    if not spec.startswith("git:"):
        return Path(spec).read_text()
    return subprocess.run(["git", "-C", str(REPO), "show", f"{spec[4:]}:{SOURCE}"], capture_output=True, text=True,
                          check=True).stdout


@functools.cache  # XLA keeps a target name's first handler for the process: one registration per source
def register(source: str) -> dict[str, str]:
    """Compile `source` as cpu_kernels does and register its two product handlers under names of their own (the
    source's hash); the cpu_kernels globals that select them (TARGET, QUANTIZED_TARGET) mapped to those names."""
    suffix = "_" + hashlib.sha256(source.encode()).hexdigest()[:12]
    with tempfile.TemporaryDirectory() as tmp:  # a loaded library outlives its file
        src, lib_path = Path(tmp) / "kernel.cc", Path(tmp) / "kernel.so"
        src.write_text(source)
        cmd = [cpu_kernels.find_compiler(), *cpu_kernels.FLAGS, "-isystem", jax.ffi.include_dir(), str(src),
               "-o", str(lib_path)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"a --variant does not build:\n{done.stderr[-3000:]}")
        lib = ctypes.CDLL(str(lib_path))
    targets = {"TARGET": cpu_kernels.TARGET + suffix, "QUANTIZED_TARGET": cpu_kernels.QUANTIZED_TARGET + suffix}
    jax.ffi.register_ffi_target(targets["TARGET"], jax.ffi.pycapsule(lib.PocketjaxSkinnyMatmul), platform="cpu")
    jax.ffi.register_ffi_target(targets["QUANTIZED_TARGET"], jax.ffi.pycapsule(lib.PocketjaxQuantizedMatmul),
                                platform="cpu")
    return targets


def programs(versions: dict[str, dict[str, str]], weights: list, x: jax.Array) -> dict:
    """Each version's step program, traced and compiled with its targets (checked in the lowered module) and run
    once; the outputs of every version returned beside the programs."""
    out = {}
    for name, targets in versions.items():
        with mock.patch.multiple(cpu_kernels, **targets):
            program = step_products(weights, True)
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
    p.add_argument("--variant", action="append", default=[], help="a kernel source file, or git:REV (repeatable)")
    p.add_argument("--bits-may-differ", action="store_true", help="do not require the tree kernel's bits")
    add_options(p, model="qwen3-0.6b", weights="float32,int8", rows="1,2,4,8", rounds=15, json=None)
    args = parse(add_quick(p, QUICK), argv, QUICK)
    if not args["variant"]:
        raise SystemExit("--variant: at least one kernel version to time against this tree's")
    cases = step_cases(args["model"], args["weights"], args["rows"])  # checks the arguments before any compile
    versions = {"tree": {"TARGET": cpu_kernels.TARGET, "QUANTIZED_TARGET": cpu_kernels.QUANTIZED_TARGET}}
    versions.update({spec: register(version_source(spec)) for spec in args["variant"]})
    records = [{"weights": form, "rows": rows, "products": len(weights),
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
