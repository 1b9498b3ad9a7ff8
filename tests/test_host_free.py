"""Issue 66: no host in a decode step. No program on the decode path holds a branch the device decides (an HLO
`conditional`, or a `while` whose trip count depends on the data): on XLA:GPU each executed one copies its predicate
to the host and drains the stream, and neither joins a CUDA graph. A decode step and its sampler are one program, so
a generated token costs one dispatch and one host read."""
import re

import numpy as np
import pytest

import pocketjax as pj
from pocketjax.engine.plan import DECODE_CHAIN, SPARSE_CHAIN, signatures
from pocketjax.engine.request import BatchedRequest
from pocketjax.engine.sampling import EXACT

from test_structured import EOS, byte_tokenizer

OPTIONS = dict(max_batch_size=1, max_seq_len=32, prefill_chunk=16, min_kv_bucket=32, compile_cache_dir="off")
SAMPLERS = ("sample_first", "sample_first_masked", "decode_sample", "sample_next_masked", "sample_verify")


def device_branches(hlo: str) -> list[str]:
    """The lines of compiled HLO text that decide a branch on the device: conditionals, and while loops without a
    known trip count."""
    return [line.strip()[:160] for line in hlo.splitlines()
            if "conditional(" in line or (re.search(r"\bwhile\(", line) and "known_trip_count" not in line)]


@pytest.fixture(scope="module")
def engine(hf_checkpoint):
    model = pj.load_model(hf_checkpoint("qwen3_gqa4_headdim", eos_token_id=EOS))
    speculative = dict(method="ngram", num_speculative_tokens=2, prompt_lookup_max=2, prompt_lookup_min=1)
    return pj.Engine(model, tokenizer=byte_tokenizer(), speculative=speculative, **OPTIONS)


def test_no_decode_path_program_decides_a_branch_on_the_device(engine):
    """Every signature warm-up compiles (prompt logprobs, structured outputs, speculation, steering and hidden
    states included), and every sampler in the variants compiled on first use (EXACT, penalized verification)."""
    calls = signatures(engine.rules, prompt_logprobs=True, steering=True, return_hidden=True)
    assert {c.step for c in calls} >= {"prefill", "prefill_scored", "decode", *SAMPLERS[1:], "verify"}
    calls += [c._replace(paths=EXACT) for c in calls if c.step in SAMPLERS and not c.steered and not c.captured]
    calls += [c._replace(penalized=True) for c in calls if c.step == "sample_verify"]
    found = {call: device_branches(engine.lower(call).compile().as_text()) for call in calls}
    assert {call: lines for call, lines in found.items() if lines} == {}


def test_warm_up_compiles_a_handful_of_sampler_variants(engine):
    """The variants stay few: at most four sampler programs per step kind and row count (`plan.WARM`); the verify
    sampler has a penalized twin of each but GREEDY (a penalized batch never runs GREEDY)."""
    calls = signatures(engine.rules)
    most = max(len(DECODE_CHAIN), len(SPARSE_CHAIN))
    for step in SAMPLERS[1:]:
        assert 0 < len([c for c in calls if c.step == step]) <= (2 * most - 1 if step == "sample_verify" else most)
    assert not [c for c in calls if c.step == "sample_first"]  # structured: every first token takes the masked one


def test_a_decode_token_costs_one_dispatch_and_one_host_read(engine, monkeypatch):
    """Steady decoding (no masks from the host) runs one program per step, and reads its tokens once."""
    import pocketjax.engine.engine as engine_module

    req = BatchedRequest(0, [1, 2, 3, 4, 5], pj.SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, seed=1,
                                                               ignore_eos=True))
    engine.allocate_slot(req)
    engine.batch_prefill([req])
    runs, reads = [], []
    run = engine.device.run
    monkeypatch.setattr(engine.device, "run", lambda name, *a: runs.append(name) or run(name, *a))
    monkeypatch.setattr(engine_module, "to_host", lambda x, read=engine_module.to_host: reads.append(1) or read(x))
    pending = engine.decode_dispatch([req])
    steps = 1
    while not req.finished:
        following = engine.decode_dispatch([req], after=pending)
        engine.decode_collect(pending)
        pending, steps = following, steps + 1
    engine.decode_collect(pending)
    engine.free_slot(req.request_id)
    assert len(req.generated_tokens) == 6
    ran = [name for name in runs]
    assert set(ran) == {"decode_sample"} and len(ran) == len(reads) == 5  # the last dispatch finds the row done


@pytest.fixture(scope="module")
def embedded():
    from pocketjax.serve.llm import DEFAULT_MODEL
    from pocketjax.serve.tokenizer import Tokenizer

    return pj.load_model(DEFAULT_MODEL), Tokenizer.from_folder(DEFAULT_MODEL)


def served(model, tokenizer, decode_steps: int) -> tuple[list, int]:
    """A mixed workload through the scheduler, driven step by step: greedy, seeded top-p with top logprobs,
    penalties, a stop string, stop ids, a request cancelled mid-way and three joining while others decode. Returns
    every completion (token ids, logprobs, finish reason; the cancelled one's reason only) and the largest number of
    tokens one dispatch delivered to a request."""
    engine = pj.Engine(model, max_batch_size=3, max_seq_len=96, prefill_chunk=32, decode_steps=decode_steps,
                       compile_cache_dir="off")
    sched = pj.Scheduler(engine, tokenizer=tokenizer)
    prompts = [tokenizer.encode(text) for text in ("def fib(n):\n", "class A:\n", "import os\n", "x = [",
                                                   "for i in", "return ")]
    params = [pj.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              pj.SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=5, logprobs=3),
              pj.SamplingParams(max_tokens=30, temperature=0.7, seed=6, repetition_penalty=1.2, presence_penalty=0.3,
                                stop=["\n"]),
              pj.SamplingParams(max_tokens=40, temperature=1.0, seed=7, stop_token_ids=tokenizer.encode(" ")),
              pj.SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True),
              pj.SamplingParams(max_tokens=12, temperature=0.8, top_k=5, seed=8)]
    handles = [sched.submit(p, sp) for p, sp in zip(prompts[:3], params[:3])]
    most, seen = 0, {}
    for i in range(400):
        if i == 3:
            handles += [sched.submit(p, sp) for p, sp in zip(prompts[3:], params[3:])]  # join the running ones
        if i == 6:
            handles[4].cancel()
        if not sched.step():
            break
        for h in handles:
            n = len(h.request.generated_tokens)
            most, seen[id(h)] = max(most, n - seen.get(id(h), 0)), n
    out = [h.result() for h in handles]
    return [(c.token_ids, c.logprobs, c.finish_reason) if c.finish_reason != "cancelled" else c.finish_reason
            for c in out], most


def test_decode_steps_give_the_tokens_of_single_steps(embedded):
    """decode_steps = 4 and 8: the same tokens, logprobs and finish reasons as one step per dispatch, bit for bit,
    with requests joining, one cancelled, a stop string, stop ids and lengths ending rows on the device."""
    single, most = served(*embedded, 1)
    assert most == 1 and single[4] == "cancelled"
    assert {c[2] for c in single if c != "cancelled"} >= {"length", "stop"}
    for steps in (4, 8):
        multi, most = served(*embedded, steps)
        assert most > 1  # several tokens arrived from one dispatch
        assert multi == single


def test_an_admission_reads_nothing_before_the_next_decode_is_queued(hf_checkpoint, monkeypatch):
    """A step that admits a request while another decodes queues the prefill, its first-token sampler and the next
    decode step before any host read: the first token stays on device (in the slot's state) and is read with the
    decode step before it, not at once (a drain per admission)."""
    import pocketjax.engine.engine as engine_module
    from pocketjax.serve.scheduler import Scheduler

    engine = pj.Engine(pj.load_model(hf_checkpoint("qwen3_gqa4_headdim", eos_token_id=EOS)),
                       **{**OPTIONS, "max_batch_size": 2})
    greedy = pj.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = ([1, 2, 3], [4, 5, 6, 7])
    sched = Scheduler(engine)
    handles = [sched.submit(prompts[0], greedy)]
    sched.step()
    sched.step()
    events = []
    run = engine.device.run
    monkeypatch.setattr(engine.device, "run", lambda name, *a: events.append(name) or run(name, *a))
    monkeypatch.setattr(engine_module, "to_host", lambda x, read=engine_module.to_host: events.append("read") or read(x))
    handles.append(sched.submit(prompts[1], greedy))
    sched.step()
    start = events.index("prefill")
    assert events[start: start + 3] == ["prefill", "sample_first", "decode_sample"], events
    assert len(handles[1].request.generated_tokens) == 1  # read in the same scheduler step, after the queueing
    while sched.step():
        pass
    monkeypatch.undo()
    for prompt, handle in zip(prompts, handles):  # the tokens of the request run alone
        req = BatchedRequest("alone", prompt, greedy)
        engine.allocate_slot(req)
        tokens = engine.batch_prefill([req])
        while not req.finished:
            tokens += engine.batch_decode_step([req])
        engine.free_slot(req.request_id)
        assert handle.result().token_ids == tokens
