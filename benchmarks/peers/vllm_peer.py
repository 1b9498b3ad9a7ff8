"""vLLM's CPU build, offline: `LLM.generate` on token-id prompts, no tokenizer, greedy, `ignore_eos`, in its own venv
(bench_engine.py --vllm-python; the one-time setup is in benchmarks/README.md).

Per concurrency c, c prompts in one generate call: prefill tok/s from a max_tokens=1 call; decode tok/s from a
max_tokens=gen_len call on fresh prompts minus that prefill time, over gen_len - 1 tokens (prefix caching is off and
every call has new prompts, so the full call's prefill is a real one). One untimed round per c first. Threads:
vLLM's default binding (on 2 cores it computes on one and its scheduler spins on the other; binding both was ~2x
slower), so spec "threads" is recorded, not applied. `VLLM_CPU_KVCACHE_SPACE` (GiB) defaults to 2.

    /path/to/vllm-venv/bin/python -m benchmarks.peers.vllm_peer --json-in SPEC.json --json-out OUT.json
"""
from __future__ import annotations

import os
import time
from types import SimpleNamespace

from benchmarks.peers import Emit, Prompts, Skip, main, record, vocab_size

KVCACHE_GIB = "2"


def run(spec: SimpleNamespace, emit: Emit) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KVCACHE_GIB)
    try:
        import vllm
        from vllm import LLM, SamplingParams
    except ImportError as e:
        raise Skip(f"vllm is not importable by this interpreter ({e}); give bench_engine --vllm-python "
                   "(see benchmarks/README.md)") from e

    t0 = time.perf_counter()
    llm = LLM(model=spec.checkpoint, skip_tokenizer_init=True, dtype=spec.kind, seed=spec.seed,
              max_model_len=spec.prompt_len + spec.gen_len + 16, max_num_seqs=max(spec.concurrency),
              enable_prefix_caching=False)
    startup_s = time.perf_counter() - t0
    print(f"vllm {spec.kind}: started in {startup_s:.0f} s", flush=True)
    prompts = Prompts(vocab_size(spec.checkpoint), seed=spec.seed)

    def timed(c: int, max_tokens: int) -> float:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0, detokenize=False)
        batch = [{"prompt_token_ids": p} for p in prompts.make(c, spec.prompt_len)]
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outs), "vLLM stopped early"
        return seconds

    for c in spec.concurrency:
        timed(c, 1), timed(c, spec.gen_len)  # warm-up: this batch size's shapes
        runs = [(timed(c, 1), timed(c, spec.gen_len)) for _ in range(spec.repeats)]
        binding = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
        emit([record("vllm", spec, c, [p for p, _ in runs], [max(g - p, 1e-9) for p, g in runs],
                     dtype=spec.kind, threads=f"vllm's binding ({binding})", startup_s=startup_s,
                     kvcache_gib=os.environ["VLLM_CPU_KVCACHE_SPACE"],
                     versions={"vllm": vllm.__version__, "torch": __import__("torch").__version__})])


if __name__ == "__main__":  # vLLM starts worker processes that re-import the main module
    main(run, "vllm", hard_exit=True)
