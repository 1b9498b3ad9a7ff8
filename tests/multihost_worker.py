"""One process of a multi-process job for tests/test_multihost.py and benchmarks/bench_multihost.py.

    python tests/multihost_worker.py SCENARIO --coordinator 127.0.0.1:PORT --num-processes N --process-id I
        --checkpoint DIR --tp T --dp D --out OUT.json

Every process runs the same script (JAX is multi-controller) and writes its own OUT.json.{process id}:
- generate: logits of a prompt, greedy completions with logprobs, then a request that process 0 cancels after
  its third token (the others only follow it).
- die-1: a long request on every process; process 1 exits abruptly after 4 tokens; process 0 records the error its
  request ends with, and when.
- die-0: process 0 exits abruptly once its LLM runs (JAX's client terminates the others at once, whatever they are
  doing, so there is nothing to gain from dying later); process 1 records its error if it gets to.
The parent sets XLA_FLAGS (devices per process) and JAX_PLATFORMS=cpu in the child's environment.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROMPTS = [[5, 17, 42, 9, 88, 3], [7, 7, 1, 250, 31], [100, 2, 64]]
LOGITS_PROMPT = [[3, 14, 15, 92, 65, 35, 89, 79]]
MAX_TOKENS = 8


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scenario", choices=["generate", "die-0", "die-1"])
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--out", required=True)
    parser.add_argument("--compile-cache-dir", default="off")
    args = parser.parse_args()

    start = time.perf_counter()

    def mark(stage: str) -> None:  # progress on stderr: where a slow or stuck child spends its time
        print(f"[worker {args.process_id}] {stage} at {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)

    from pocketjax.serve import distributed
    distributed.initialize(args.coordinator, args.num_processes, args.process_id, heartbeat_timeout_s=10)

    import pocketjax as pj
    from pocketjax.model.sharding import make_mesh, to_host

    mark("joined")
    model = pj.load_model(args.checkpoint, mesh=make_mesh(tp=args.tp, dp=args.dp))
    out_path = f"{args.out}.{args.process_id}"
    result: dict = {"process_id": args.process_id, "devices": [str(d) for d in model.mesh.devices.flat]}
    if args.scenario == "generate":  # before the LLM: its loop's collectives must not interleave with others
        result["logits"] = to_host(pj.logits(model, LOGITS_PROMPT)).tolist()
    # one slot per replica: the fewest compiled shapes (each compile is seconds on a busy 2-core box)
    llm = pj.LLM(model, max_batch_size=args.dp, max_seq_len=256, compile_cache_dir=args.compile_cache_dir)
    if args.scenario == "generate":
        mark("logits")
        outs = llm.generate(PROMPTS, pj.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2))
        result["tokens"] = [o.token_ids for o in outs]
        result["logprobs"] = [[lp for lp, _ in o.logprobs] for o in outs]
        result["finish"] = [o.finish_reason for o in outs]
        mark("generated")
        handle = llm.submit(PROMPTS[0], pj.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
        if args.process_id == 0:
            for i, _ in enumerate(handle):
                if i == 2:
                    handle.cancel()
        done = handle.result(timeout=60)
        result["cancelled"] = {"finish_reason": done.finish_reason, "tokens": done.token_ids}
        mark("cancelled")
        llm.close()
        mark("closed")
        group = llm.scheduler.group
        result["exchanges"] = group.exchanges if group else 0
        Path(out_path).write_text(json.dumps(result))
        return 0

    victim = int(args.scenario[-1])
    if victim == 0 and args.process_id == 0:
        Path(out_path).write_text(json.dumps({"died_at": time.time()}))
        os._exit(17)
    handle = llm.submit(PROMPTS[0], pj.SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True))
    try:
        for i, _ in enumerate(handle):
            if i == 3 and args.process_id == victim:
                Path(out_path).write_text(json.dumps({"died_at": time.time()}))
                os._exit(17)  # abruptly: no shutdown, sockets closed by the OS
        result["completed"] = True
    except pj.errors.PocketJaxError as error:
        result.update(error=type(error).__name__, message=str(error)[:400])
    result["at"] = time.time()
    Path(out_path).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # JAX's own client would abort this process later anyway: its peer is gone


if __name__ == "__main__":
    sys.exit(main())
