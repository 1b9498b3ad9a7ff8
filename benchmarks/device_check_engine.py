"""The engine under each attention path (xla, pallas, triton): greedy tokens against XLA's, and decode tok/s.

A GPU check (benchmarks/device_check.sh): the embedded model, 8 prompts at once, greedy, float32 by default (tokens
must be equal, not merely close; --dtype float16 for Turing's fast path, never bfloat16 there). A path that cannot run
on this device falls back to XLA, as `resolve_impl` logs; the "ran" column says what actually ran, and a path that
falls back to one measured above is not compiled again ("the program xla ran"). Each path's row is printed (and the
JSON written) as it ends, so a run cut short by its cap keeps what it measured. Times the second generate (the first
compiles). On CPU every path runs XLA.
    python benchmarks/device_check_engine.py --json OUT.json [--impls xla,pallas,triton] [--max-tokens 64]
"""
from __future__ import annotations

import argparse
import json
import time

import jax

import pocketjax as pj
from pocketjax.model.layers import resolve_impl


def measure(impl: str, prompts: list[str], max_tokens: int, dtype: str) -> dict:
    """One path's tokens and timing: compile (first generate), then the timed generate."""
    llm = pj.LLM(None, max_batch_size=len(prompts), max_seq_len=512, dtype=dtype, attention_impl=impl)
    sampling = pj.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    llm.generate(prompts, sampling)
    start = time.perf_counter()
    outs = llm.generate(prompts, sampling)
    seconds = time.perf_counter() - start
    tokens = [list(o.token_ids) for o in outs]
    return dict(impl=impl, ran=llm.engine.impl, tokens=tokens, seconds=seconds,
                tok_s=sum(map(len, tokens)) / seconds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True)
    p.add_argument("--impls", default="xla,pallas,triton")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")  # exact: equal greedy tokens are a fair demand
    args = p.parse_args()
    prompts = [f"def function_{i}(x):" for i in range(8)]
    device = jax.devices()[0]
    machine = {"device": device.device_kind, "platform": device.platform,
               "compute_capability": getattr(device, "compute_capability", None)}
    records: list[dict] = []
    print(f"{'impl':8} {'ran':8} {'tok/s':>8} {'equal to xla':>12}", flush=True)
    for impl in args.impls.split(","):
        ran = resolve_impl(impl, device=device)
        same = next((r for r in records if r.get("ran") == ran and "tokens" in r), None)
        if same is not None:  # a fallback to a path measured above: the same program, not worth a compile
            record = dict(impl=impl, ran=ran, same_as=same["impl"], tok_s=same["tok_s"])
        else:
            try:
                record = measure(impl, prompts, args.max_tokens, args.dtype)
            except Exception as e:  # noqa: BLE001  (one broken path must not hide the others' numbers)
                record = dict(impl=impl, ran="error", error=f"{type(e).__name__}: {e}"[:2000])
        records.append(record)
        xla = next((r["tokens"] for r in records if r.get("ran") == "xla" and "tokens" in r), None)
        for r in records:
            r["tokens_equal_xla"] = None if xla is None or "tokens" not in r else r["tokens"] == xla
        with open(args.json, "w") as f:  # after every path: a run cut short by its cap keeps what it measured
            json.dump({"machine": machine, "records": records}, f, indent=1)
        print(f"{impl:8} {record['ran']:8} {record.get('tok_s', float('nan')):8.1f} "
              f"{record['tokens_equal_xla']!s:>12}" + (f"  {record['error']}" if "error" in record else "")
              + (f"  (the program {record['same_as']} ran)" if "same_as" in record else ""), flush=True)
    if any(r["ran"] == "error" or r["tokens_equal_xla"] is False for r in records):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
