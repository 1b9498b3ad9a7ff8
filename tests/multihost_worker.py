"""One process of a multi-process job for tests/test_multihost.py and benchmarks/bench_multihost.py.

    python tests/multihost_worker.py SCENARIO --coordinator 127.0.0.1:PORT --num-processes N --process-id I
        --checkpoint DIR --tp T --dp D --out OUT.json

Every process runs the same script (JAX is multi-controller) and writes its own OUT.json.{process id}:
- generate: logits of a prompt, greedy completions with logprobs, then a request that process 0 cancels after
  its third token (the others only follow it); then new weights (`updated`).
- die-1: a long request on every process; process 1 exits abruptly after 4 tokens; process 0 records the error its
  request ends with, and when.
- die-0: process 0 exits abruptly once its LLM runs (JAX's client terminates the others at once, whatever they are
  doing, so there is nothing to gain from dying later); process 1 records its error if it gets to.
The parent sets XLA_FLAGS (devices per process) and JAX_PLATFORMS=cpu in the child's environment.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from functools import partial
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
        new_params = train_step(model.params)
        mark("new params")
    # one slot per replica: the fewest compiled shapes (each compile is seconds on a busy 2-core box)
    llm = pj.LLM(model, max_batch_size=args.dp, max_seq_len=256, compile_cache_dir=args.compile_cache_dir)
    if args.scenario == "generate":
        mark("logits")
        outs = llm.generate(PROMPTS, greedy())
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
        if args.process_id == 1:  # process 0's broadcast of the update comes first: this loop waits for the call
            time.sleep(0.5)
        llm.update_params(new_params)
        result["after_update"] = [o.token_ids for o in llm.generate(PROMPTS, greedy())]
        llm.close()
        mark("closed")
        group = llm.scheduler.group
        result["exchanges"] = group.exchanges if group else 0
        result |= updated_by_hand(llm.engine, model.params, new_params)
        mark("updated")
        with pj.LLM(dataclasses.replace(model, params=new_params), max_batch_size=args.dp, max_seq_len=256,
                    compile_cache_dir=args.compile_cache_dir) as fresh:
            result["fresh"] = [o.token_ids for o in fresh.generate(PROMPTS, greedy())]
        mark("fresh")
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


def greedy():
    """The sampling of the update checks: greedy, so every engine on the same weights answers the same tokens (and
    that of the first completions, so no new program compiles for them)."""
    import pocketjax as pj

    return pj.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=2)


def train_step(params):
    """New weights as a jitted training step returns them, on the params' own shardings (so served as they are):
    every floating leaf moved by up to 5% (a change cheap to compile: seconds less per job than jax.random's)."""
    import jax
    import jax.numpy as jnp

    def move(x):
        return x * (1 + 0.05 * jnp.sin(997.0 * x)) if jnp.issubdtype(x.dtype, jnp.floating) else x

    return jax.jit(partial(jax.tree.map, move), out_shardings=jax.tree.map(lambda x: x.sharding, params))(params)


def updated_by_hand(engine, loaded, new_params) -> dict:
    """A Scheduler over the job's engine stepped by hand, so each step's news is known: an update back to the `loaded`
    weights broadcast in the same step as the requests (which must all run on them), then a `finish_running` update
    to `new_params` while a request runs (it ends on the old weights; the requests queued meanwhile wait, then run
    on the new ones). Process 0's stop is the last broadcast; the others take it in one more step."""
    from pocketjax.serve.distributed import ProcessGroup
    from pocketjax.serve.scheduler import Scheduler

    scheduler = Scheduler(engine, group=ProcessGroup.current())

    def run(handles) -> list[list[int]]:
        while not all(h.done() for h in handles):
            scheduler.step()
        return [h.result().token_ids for h in handles]

    scheduler.update_params(loaded)  # no loop: queued for the next step's broadcast, with the requests below
    same_step = run([scheduler.submit(p, greedy()) for p in PROMPTS])
    running = scheduler.submit(PROMPTS[0], greedy())
    scheduler.step()  # admitted and prefilled on the loaded weights
    scheduler.update_params(new_params, finish_running=True)
    tokens = run([running] + [scheduler.submit(p, greedy()) for p in PROMPTS])
    if scheduler.group.leader:
        scheduler.stop()
    else:
        scheduler.step()
    return {"same_step": same_step, "finished_running": tokens[0], "held": tokens[1:]}


if __name__ == "__main__":
    sys.exit(main())
