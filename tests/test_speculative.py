"""Speculative decoding (prompt-lookup drafts): token-for-token identical to plain decoding (greedy and seeded),
the same distribution when unseeded (chi-square, with a wrong acceptance rule that must fail it), the drafter
against a brute-force search, the scheduler and LLM paths, warm-up."""
import argparse
import dataclasses
from collections import Counter

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2_contingency

import pocketjax as pj
from pocketjax.engine import runner
from pocketjax.engine.config import EngineConfig, SpeculativeConfig
from pocketjax.engine.engine import Engine
from pocketjax.engine.request import BatchedRequest
from pocketjax.engine.sampling_params import SamplingParams
from pocketjax.engine.speculative import EXPLORE, MAX_SKIP, Backoff, NgramIndex, Speculator
from pocketjax.errors import ConfigError, RequestError
from pocketjax.model import cpu_kernels
from pocketjax.serve.cli import add_model_args, engine_config

SPEC = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
SIZES = dict(max_batch_size=2, max_seq_len=128, prefill_chunk=32)  # few shapes: rows 1 and 2, one kv bucket
GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(hf_checkpoint):
    return pj.load_model(hf_checkpoint("qwen3_gqa4_headdim"))


@pytest.fixture(scope="module")
def engines(model):
    """(plain, speculative) engines of the same sizes: their prefill and decode programs are shared. The speculative
    one verifies whenever a draft exists: these tests check exactness; the policy on time is tested apart."""
    spec = Engine(model, **SIZES, speculative=SPEC)
    spec.speculator.pays = lambda *_: True
    return Engine(model, **SIZES), spec


def prompts(seed: int, lengths, vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(0, vocab, n)] for n in lengths]


def run(engine: Engine, prompt_list, params, speculative: bool) -> list[BatchedRequest]:
    """Allocate, prefill, and step to completion (speculative steps or plain ones); frees the slots."""
    params = params if isinstance(params, list) else [params] * len(prompt_list)
    reqs = [BatchedRequest(i, list(p), s) for i, (p, s) in enumerate(zip(prompt_list, params))]
    for r in reqs:
        engine.allocate_slot(r)
    engine.batch_prefill(reqs)
    while not all(r.finished for r in reqs):
        (engine.batch_speculative_step if speculative else engine.batch_decode_step)(reqs)
    for r in reqs:
        engine.free_slot(r.request_id)
    return reqs


def accepted(engine: Engine) -> tuple[int, int]:
    return engine.speculator.total_accepted, engine.speculator.total_proposed


def assert_same(plain: list[BatchedRequest], spec: list[BatchedRequest]) -> None:
    """Bit for bit: the tokens, the logprobs and the top logprobs (ids in order, values) where the native CPU
    kernels run (a verify computes each position as a decode does); within 1e-4 with XLA's forms."""
    for a, b in zip(plain, spec):
        assert b.generated_tokens == a.generated_tokens
        assert b.finish_reason == a.finish_reason
        if cpu_kernels.available():
            assert [(lp, list(top.items())) for lp, top in b.logprobs] == \
                [(lp, list(top.items())) for lp, top in a.logprobs]
            continue
        assert len(b.logprobs) == len(a.logprobs)
        np.testing.assert_allclose([e[0] for e in b.logprobs], [e[0] for e in a.logprobs], atol=1e-4)
        for x, y in zip(a.logprobs, b.logprobs):
            assert list(x[1]) == list(y[1])  # the same top ids, in order
            np.testing.assert_allclose(list(y[1].values()), list(x[1].values()), atol=1e-4)


# ---- config -------------------------------------------------------------------------------------------------------

def test_config_parses_vllm_spelling_and_refuses_what_it_does_not_know():
    assert EngineConfig.of(speculative=SPEC).speculative == SpeculativeConfig(**SPEC)
    assert SpeculativeConfig.of('{"method": "ngram", "num_speculative_tokens": 2}').num_speculative_tokens == 2
    assert EngineConfig.of().speculative is None
    with pytest.raises(ConfigError, match="draft_model"):
        EngineConfig.of(speculative=dict(method="ngram", draft_model="x"))
    with pytest.raises(ConfigError, match="'eagle'"):
        EngineConfig.of(speculative=dict(method="eagle"))
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        SpeculativeConfig.of(dict(num_speculative_tokens=0))
    with pytest.raises(ConfigError, match="prompt_lookup_min"):
        SpeculativeConfig.of(dict(prompt_lookup_min=5, prompt_lookup_max=2))
    with pytest.raises(ConfigError, match="JSON"):
        SpeculativeConfig.of("{method: ngram}")


def test_cli_flag_takes_vllm_json():
    parser = argparse.ArgumentParser()
    add_model_args(parser)
    flag = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1}'
    config = engine_config(parser.parse_args(["--speculative-config", flag]))
    assert config.speculative == SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_min=1)
    assert engine_config(parser.parse_args([])).speculative is None
    with pytest.raises(ConfigError, match="lookahead"):
        engine_config(parser.parse_args(["--speculative-config", '{"lookahead": 3}']))


# ---- drafting ----------------------------------------------------------------------------------------------------

def brute_force_draft(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The longest suffix (n_max..n_min) with an earlier occurrence, its most recent one, and the k tokens after
    it continued periodically: searched from scratch."""
    last = len(tokens) - 1
    for n in range(n_max, n_min - 1, -1):
        if last + 1 < n:
            continue
        suffix = tokens[last + 1 - n:]
        for end in range(last - 1, n - 2, -1):
            if tokens[end + 1 - n: end + 1] == suffix:
                extended = list(tokens)
                while len(extended) < last + 1 + k:
                    extended.append(extended[len(extended) - (last - end)])
                return extended[end + 1: end + 1 + k]
    return []


def test_ngram_index_matches_a_brute_force_search_as_the_context_grows():
    rng = np.random.default_rng(0)
    for trial in range(20):
        tokens = [int(t) for t in rng.integers(0, 4 + trial % 5, 6)]
        index = NgramIndex(1 + trial % 2, 3 + trial % 3)
        for _ in range(40):
            assert index.propose(tokens, 4) == brute_force_draft(tokens, 4, index.sizes[-1], index.sizes[0])
            tokens += [int(t) for t in rng.integers(0, 4 + trial % 5, int(rng.integers(1, 4)))]
    assert NgramIndex(2, 2).propose([7, 7, 7], 3) == [7, 7, 7]  # a loop of period 1 drafts k tokens


def test_backoff_skips_more_after_each_miss_and_resets_on_acceptance():
    backoff = Backoff()
    waits = []
    for _ in range(6):
        backoff.record(0)
        waits.append(sum(not backoff.due() for _ in range(MAX_SKIP + 1)))
    assert waits == [1, 3, 7, 15, 16, 16]
    backoff.record(2)
    assert backoff.due()


def test_step_clock_verifies_only_where_drafts_pay_for_the_verify():
    speculator = Speculator(SpeculativeConfig())
    assert speculator.pays(4, 4, [0.1])  # nothing timed yet: try a verify
    clock = speculator.clock
    for seconds in (9.0, 0.3, 0.3):
        clock.observe("verify", 4, seconds)  # a slow one among them (a neighbour, a first run): ignored
    assert clock.seconds("verify", 4) == pytest.approx(0.3) and not speculator.pays(4, 4, [8.0])  # time plain steps
    for seconds in (5.0, 0.1, 0.1):
        clock.observe("plain", 4, seconds)
    assert clock.ratio(4) == pytest.approx(3.0)
    assert speculator.pays(4, 4, [3.0, 3.0, 2.5])
    assert [speculator.pays(4, 4, [3.0, 3.0, 1.5]) for _ in range(EXPLORE)] == [False] * (EXPLORE - 2) + [True, False]
    assert speculator.pays(8, 8, [0.5])  # another row bucket is timed on its own
    for seconds in (0.3, 0.9, 0.3):
        clock.observe("fed", 4, seconds)  # the host-fed step after a verify: 0.2 s more than a pipelined one
    assert clock.ratio(4) == pytest.approx(5.0) and not speculator.pays(4, 4, [3.0, 3.0, 2.5])
    assert speculator.pays(4, 4, [6.0, 6.0, 4.5])


def test_a_new_request_expects_what_the_engine_accepted_so_far():
    speculator = Speculator(SpeculativeConfig(num_speculative_tokens=4))
    old, new = (BatchedRequest(i, [1, 2, 3], GREEDY) for i in ("old", "new"))
    assert speculator.expected(new) == 2.0  # nothing verified yet: k / 2
    for accepted in (0, 0, 1):
        speculator.record(old, 4, accepted)
    assert speculator.expected(new) == pytest.approx(1 / 3)  # the mean over every verified row
    assert speculator.expected(old) == pytest.approx(0.75 * (0.75 * 2.0 * 0.75) + 0.25)  # its own running mean


# ---- exactness ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["alone", "batched", "chunked"])
def test_identical_to_plain_decoding_with_its_own_drafts(engines, model, case):
    """Greedy, with the drafter's own proposals: the random model's loops give it something to accept."""
    plain, spec = engines
    lengths = {"alone": (7,), "batched": (5, 20), "chunked": (70, 45)}[case]  # chunked: prompts over prefill_chunk
    ps = prompts(len(case), lengths, model.config.vocab_size)
    before = accepted(spec)
    assert_same(run(plain, ps, GREEDY, False), run(spec, ps, GREEDY, True))
    assert accepted(spec)[0] > before[0]


def run_with_drafts(engine: Engine, prompt_list, params, truth, seed: int, then_decode: bool = False
                    ) -> list[BatchedRequest]:
    """Verify steps only, each row's draft the true continuation `truth` (what plain decoding gave) cut to a random
    length 0..k and, one time in three, wrong at a random place: every position and every accepted count occurs.
    `then_decode`: each verify is followed by a decode step queued on device after it, before either is read (its
    token and position come from the verify's accepted counts); slots are then taken in reverse, so a dense step
    reorders the verify's rows."""
    rng = np.random.default_rng(seed)
    k = engine.speculator.k
    reqs = [BatchedRequest(i, list(p), s) for i, (p, s) in enumerate(zip(prompt_list, params))]
    for r in (reversed(reqs) if then_decode else reqs):
        engine.allocate_slot(r)
    engine.batch_prefill(reqs)
    while not all(r.finished for r in reqs):
        drafts = []
        for r, want in zip(reqs, truth):
            g = len(r.generated_tokens)
            d = list(want[g: g + int(rng.integers(0, k + 1))])
            if d and rng.random() < 1 / 3:
                d[int(rng.integers(len(d)))] = int(rng.integers(model_vocab(engine)))
            drafts.append(d)
        verify = engine.verify_dispatch(reqs, drafts)
        following = engine.decode_dispatch(reqs, after=verify) if then_decode else None
        engine.collect(verify)
        if following is not None:
            engine.collect(following)
    for r in reqs:
        engine.free_slot(r.request_id)
    return reqs


def model_vocab(engine: Engine) -> int:
    return engine.model.config.vocab_size


@pytest.mark.parametrize("case", ["greedy_penalties", "seeded_penalties", "mixed_penalties", "seeded_neutral"])
def test_identical_to_plain_decoding_with_true_drafts(engines, model, case):
    """Drafts of the true continuation, cut and corrupted at random: at every verify position the sampled token,
    its logprobs and the penalty state must be what plain decoding had (a frequency penalty that keeps breaking the
    loops turns a missed count into other tokens; sampling, a wrong random stream). `mixed_penalties`: one row
    penalizes, its neighbour samples without (the sampler's penalized branch serves both); `seeded_neutral`: no row
    penalizes (the branch that skips the penalty state), seeded sampling with logprobs."""
    plain, spec = engines
    sp = {"greedy_penalties": [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=3,
                                              frequency_penalty=0.3, presence_penalty=0.1)] * 2,
          "seeded_penalties": [SamplingParams(max_tokens=40, temperature=t, top_p=0.95, seed=s, ignore_eos=True,
                                              repetition_penalty=1.1, frequency_penalty=0.3)
                               for s, t in ((1, 0.3), (2, 1.0))],
          "mixed_penalties": [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, frequency_penalty=0.3),
                              SamplingParams(max_tokens=40, temperature=0.8, seed=5, ignore_eos=True, logprobs=2)],
          "seeded_neutral": [SamplingParams(max_tokens=40, temperature=t, top_k=k, seed=s, ignore_eos=True, logprobs=3)
                             for s, t, k in ((3, 0.5, 0), (4, 1.0, 20))]}[case]
    ps = prompts(3, (5, 20), model.config.vocab_size)
    want = run(plain, ps, sp, False)
    before = dict(spec.speculator.histogram)
    got = run_with_drafts(spec, ps, sp, [r.generated_tokens for r in want], seed=len(case))
    assert_same(want, got)
    new = {n for n, c in spec.speculator.histogram.items() if c > before.get(n, 0)}
    assert new >= {0, 1, 2, 3}  # rows accepted every count, in steps where their neighbours accepted others


def test_stop_tokens_max_tokens_and_prefix_reuse_inside_accepted_runs(engines, model):
    """A stop token or max_tokens reached inside an accepted run cuts it there; a prompt reusing a cached prefix
    (of a slot a speculative request wrote, rejected drafts included) decodes as it does from scratch."""
    plain, spec = engines
    ps = prompts(11, (6, 12), model.config.vocab_size)
    free = run(plain, ps, GREEDY, False)
    assert all(r.finish_reason == "length" for r in free)
    for req, p in zip(free, ps):  # the first token the loop repeats, as a stop token: it falls inside a run
        tokens = req.generated_tokens
        repeat = next(t for i, t in enumerate(tokens) if t in tokens[:i] and i > 8)
        stop = SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=(repeat,))
        assert_same(run(plain, [p], stop, False), run(spec, [p], stop, True))
    for n in (9, 10, 11, 17):  # max_tokens at every offset of a run of 3 drafts + 1
        capped = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        assert_same(run(plain, ps, capped, False), run(spec, ps, capped, True))
    reuse = [ps[0] + free[0].generated_tokens[:20] + [3, 4], ps[1] + [5]]
    got = run(spec, reuse, GREEDY, True)
    assert got[0].cached_prefix_len > len(ps[0])
    assert_same(run(plain, reuse, GREEDY, False), got)


def test_int8_kv_cache_is_identical_to_plain_decoding(model):
    plain = Engine(model, **SIZES, kv_dtype="int8")
    spec = Engine(model, **SIZES, kv_dtype="int8", speculative=SPEC)
    ps = prompts(5, (9, 30), model.config.vocab_size)
    assert_same(run(plain, ps, GREEDY, False), run(spec, ps, GREEDY, True))
    assert accepted(spec)[0] > 0


# ---- the distribution when unseeded --------------------------------------------------------------------------------

def first_tokens(engine: Engine, prompt: list[int], draft: list[int] | None, n: int, sp: SamplingParams,
                 count: int) -> Counter:
    """How often each sequence of the first n tokens comes out over `count` unseeded requests, 2 at a time: the
    first step verifies `draft` (None: plain decoding), the rest decode plainly."""
    seen = Counter()
    for start in range(0, count, 2):
        reqs = [BatchedRequest(f"r{start + i}", prompt, sp) for i in range(2)]
        for r in reqs:
            engine.allocate_slot(r)
        engine.batch_prefill(reqs)
        if draft is not None:
            engine.verify_collect(engine.verify_dispatch(reqs, [draft] * 2))
        while any(len(r.generated_tokens) < n and not r.finished for r in reqs):
            engine.batch_decode_step(reqs)
        for r in reqs:
            seen[tuple(r.generated_tokens[:n])] += 1
            engine.free_slot(r.request_id)
    return seen


def chi_square_p(a: Counter, b: Counter) -> float:
    """p-value of "a and b are samples of one distribution" (categories rarer than 10 in both pooled)."""
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    table = [[a[k] for k in keys] + [sum(a.values()) - sum(a[k] for k in keys)],
             [b[k] for k in keys] + [sum(b.values()) - sum(b[k] for k in keys)]]
    table = [row for row in zip(*table) if sum(row)]  # drop an empty "other" column
    return chi2_contingency(np.array(table).T)[1]


@pytest.fixture(scope="module")
def sampled(engines, model):
    """A prompt, a draft the model often accepts (its greedy continuation), and the plain first 3 tokens of 800
    unseeded requests (top_k 3: 27 outcomes)."""
    plain, spec = engines
    prompt = prompts(21, (8,), model.config.vocab_size)[0]
    draft = run(plain, [prompt], SamplingParams(max_tokens=3, temperature=0.0), False)[0].generated_tokens[:2]
    sp = SamplingParams(max_tokens=3, temperature=1.5, top_k=3, ignore_eos=True)
    return prompt, draft, sp, first_tokens(plain, prompt, None, 3, sp, 800)


def test_unseeded_sampling_keeps_the_distribution(engines, sampled):
    _, spec = engines
    prompt, draft, sp, want = sampled
    before = accepted(spec)
    got = first_tokens(spec, prompt, draft, 3, sp, 800)
    rate = (accepted(spec)[0] - before[0]) / (accepted(spec)[1] - before[1])
    assert 0.1 < rate < 0.95, "the test needs drafts accepted often, and rejected often"
    assert chi_square_p(want, got) > 1e-3


def test_the_chi_square_test_fails_an_acceptance_rule_that_accepts_every_draft(engines, sampled, monkeypatch):
    """The wrong rule (every draft accepted, as if p(t) were 1) must fail the very test above."""
    _, spec = engines
    prompt, draft, sp, want = sampled
    kind = runner.STEP_KINDS["sample_verify"]
    original = kind.function

    def accept_all(penalties, logits, plan):
        penalties, out, _ = original(penalties, logits, plan)
        k = plan.drafts.shape[1]
        tokens = out.tokens.at[:, :k].set(jnp.where(jnp.arange(k) < plan.num_drafts[:, None], plan.drafts,
                                                    out.tokens[:, :k]))
        return penalties, type(out)(tokens, out.logprobs, out.top_ids, out.top_logprobs), jnp.asarray(plan.num_drafts)

    monkeypatch.setitem(runner.STEP_KINDS, "sample_verify", dataclasses.replace(kind, function=accept_all))
    assert chi_square_p(want, first_tokens(spec, prompt, draft, 3, sp, 800)) < 1e-6


# ---- serving -----------------------------------------------------------------------------------------------------

def test_verify_dispatch_refuses_bad_drafts_and_plain_engines(engines, model):
    from test_structured import byte_tokenizer  # a tokenizer for the tiny checkpoint, so it serves a constraint
    plain, spec = engines
    spec.use_tokenizer(byte_tokenizer())
    req = BatchedRequest("x", [1, 2, 3], GREEDY)
    structured = BatchedRequest("s", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0,
                                                               structured=pj.Structured(regex="[a-z]+")))
    spec.allocate_slot(req)
    try:
        spec.batch_prefill([req])
        with pytest.raises(RequestError, match="at most 3"):
            spec.verify_dispatch([req], [[1, 2, 3, 4]])
        spec.allocate_slot(structured)
        spec.batch_prefill([structured])
        assert spec.speculator.due([req]) == [True]
        assert spec.speculator.due([req, structured]) == [False, False]  # a batch holding one decodes plainly
        with pytest.raises(RequestError, match="structured"):
            spec.verify_dispatch([structured], [[]])
        assert all(len(t) == 1 for t in spec.batch_speculative_step([req, structured]))
        spec.free_slot("s")  # the engine has two slots
        biased = BatchedRequest("b", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0.0, logit_bias={5: 1.0}))
        spec.allocate_slot(biased)
        spec.batch_prefill([biased])
        with pytest.raises(RequestError, match="'b' has token limits"):  # the message says which rule refuses it
            spec.verify_dispatch([biased], [[]])
    finally:
        for request_id in ("x", "s", "b"):
            if spec.slots.slot_of(request_id) is not None:
                spec.free_slot(request_id)
    with pytest.raises(RequestError, match="does not speculate"):
        plain.verify_dispatch([], [])


@pytest.fixture(scope="module")
def coder():
    """The embedded code model (real tokenizer, real copying), plain and speculative, at small sizes."""
    sizes = dict(max_batch_size=2, max_seq_len=128, prefill_chunk=128, compile_cache_dir="off")
    plain = pj.LLM(**sizes)
    spec = pj.LLM(plain.model, **sizes, speculative=dict(method="ngram", num_speculative_tokens=4))
    spec.engine.speculator.pays = lambda *_: True  # verify whenever a draft exists: the policy on time is tested apart
    yield plain, spec
    plain.close()
    spec.close()


CODE = '''def area(width, height):
    """Return the area of a rectangle."""
    return width * height


def volume(width, height, depth):
    """Return the volume of a box."""
    return width * height * depth


def perimeter(width, height):
    """'''


def test_llm_streams_the_same_text_with_stop_strings_and_accepts_drafts_on_code(coder):
    plain, spec = coder
    for sp in (SamplingParams(max_tokens=48, temperature=0.0), SamplingParams(max_tokens=48, temperature=0.0,
                                                                            stop=["height *", "\n\n\n"])):
        both = [CODE, CODE.replace("rectangle", "square")]  # one prefill width: fewer programs to compile
        want, got = plain.generate(both, sp), spec.generate(both, sp)
        assert [c.text for c in got] == [c.text for c in want]
        assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
        assert "".join(spec.stream(CODE, sp)) == want[0].text
    assert spec.engine.speculator.total_accepted > 20  # the model copies its own docstrings and arguments


def test_scheduler_cancel_mid_run_frees_the_slot(coder):
    _, spec = coder
    sched = spec.scheduler
    handle = spec.submit(CODE, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))
    stream = iter(handle)
    next(stream)
    handle.cancel()
    assert handle.result(timeout=60).finish_reason == "cancelled"
    again = spec.generate(CODE, SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert len(again.token_ids) == 8 and spec.engine.num_free_slots == spec.engine.num_slots
    assert not sched.running


def test_engine_speculative_step_follows_the_decode_policy(engines, model, monkeypatch):
    """Engine.batch_speculative_step runs the server's policy (decode_policy.DecodePolicy): where the drafts would not
    pay (`Speculator.pays` says no) it runs plain steps, with the same tokens."""
    plain, spec = engines
    monkeypatch.setattr(spec.speculator, "pays", lambda *_: False)
    before = accepted(spec)
    ps = [[5, 6, 7, 8] * 6]  # a loop the drafter predicts
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert ([r.generated_tokens for r in run(spec, ps, sp, True)]
            == [r.generated_tokens for r in run(plain, ps, sp, False)])
    assert accepted(spec) == before  # nothing was verified


def test_warmup_covers_the_verify_shapes(engines, model):
    engine = engines[1]
    engine.warmup(progress=False)
    compiled, before = engine.compiled_count(), accepted(engine)
    ps = prompts(3, (5, 30), model.config.vocab_size)
    run(engine, ps, [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=2),
                     SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True)], True)
    assert accepted(engine)[1] > before[1]  # verify steps ran
    assert engine.compiled_count() == compiled


def test_scheduler_times_each_step_as_the_device_ran_it(model, monkeypatch):
    """The StepClock gets a pipelined plain step's time from its call to the next, and a verify's from when the
    device went idle for it to when its tokens were read. Here reading a step is where the host waits for the device
    (a fake clock: 1 s per plain step, 5 s per verify): charging each call's interval to the step it queued, as the
    clock once did, reads a verify's 5 s into the call after it, and the ratio the cost rule uses comes out wrong."""
    from pocketjax.engine import decode_policy
    from pocketjax.serve import scheduler as scheduler_module

    fake = argparse.Namespace(now=0.0)
    monkeypatch.setattr(decode_policy, "time", argparse.Namespace(perf_counter=lambda: fake.now))
    engine = Engine(model, **SIZES, speculative=SPEC)
    engine.speculator.pays = lambda *_: True  # verify whenever a draft exists
    for name, cost in (("decode_collect", 1.0), ("verify_collect", 5.0)):
        def collect(step, _read=getattr(engine, name), _cost=cost):
            fake.now += 0.0 if step.collected else _cost
            return _read(step)
        setattr(engine, name, collect)
    sched = scheduler_module.Scheduler(engine)
    repeat = [5, 6, 7, 8] * 6  # a loop the drafter predicts, then free tokens
    handles = [sched.submit(repeat + p, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
               for p in prompts(11, (4, 9), model.config.vocab_size)]
    while sched.has_work():
        sched.step()
    assert all(h.result().finish_reason == "length" for h in handles)
    timed = {kind: {t for (k, _), times in engine.speculator.clock.times.items() if k == kind for t in times}
             for kind in ("plain", "verify", "fed")}
    assert timed == {"plain": {1.0}, "verify": {5.0}, "fed": {1.0}}  # every kind ran and was timed


def test_a_decode_step_queued_on_device_after_a_verify_is_exact(engines, model):
    """The decode step after a verify reads the verify's drawn token and accepted count on device: tokens,
    logprobs, penalty counts and the random stream as plain decoding's, for every accepted count, with a stop token
    and max_tokens falling inside accepted runs (the following row is then discarded)."""
    plain, spec = engines
    ps = prompts(21, (6, 17), model.config.vocab_size)
    free = run(plain, ps, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), False)
    stop = free[1].generated_tokens[13]  # a token the second request meets mid-way
    sp = [SamplingParams(max_tokens=29, temperature=0.0, ignore_eos=True, logprobs=2, frequency_penalty=0.3),
          SamplingParams(max_tokens=30, temperature=0.9, seed=7, ignore_eos=True, repetition_penalty=1.1,
                         stop_token_ids=[stop])]
    want = run(plain, ps, sp, False)
    before = dict(spec.speculator.histogram)
    got = run_with_drafts(spec, ps, sp, [r.generated_tokens for r in want], seed=3, then_decode=True)
    assert_same(want, got)
    assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
    new = {n for n, c in spec.speculator.histogram.items() if c > before.get(n, 0)}
    assert new >= {0, 1, 2, 3}
    assert spec.num_free_slots == spec.num_slots


def test_scheduler_leaves_speculation_on_device_and_stays_exact(engines, model):
    """Through the Scheduler with a cost rule that verifies on some steps and not others: a step after a verify
    is queued on device (no host round trip) and the output is what plain decoding gives."""
    from itertools import cycle

    from pocketjax.serve.scheduler import Scheduler

    plain, _ = engines
    spec = Engine(model, **SIZES, speculative=SPEC)
    verdicts = cycle([True, True, False, True, False, False, False])
    spec.speculator.pays = lambda *_: next(verdicts)
    followed = []
    dispatch = spec.decode_dispatch

    def counted(requests, after=None):
        followed.append(type(after).__name__)
        return dispatch(requests, after=after)

    spec.decode_dispatch = counted
    repeat = [5, 6, 7, 8] * 4
    ps = [repeat + p for p in prompts(12, (3, 8), model.config.vocab_size)]
    sp = [SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True, logprobs=1),
          SamplingParams(max_tokens=33, temperature=0.7, seed=9, ignore_eos=True, presence_penalty=0.2)]
    want = run(plain, ps, sp, False)
    spec.warmup(progress=False)
    compiled = spec.compiled_count()
    sched = Scheduler(spec)
    handles = [sched.submit(p, s) for p, s in zip(ps, sp)]
    while sched.has_work():
        sched.step()
    assert [h.result().token_ids for h in handles] == [r.generated_tokens for r in want]
    assert "PendingVerify" in followed and spec.speculator.total_accepted > 0
    assert spec.compiled_count() == compiled  # the step after a verify is one of the plain decode's programs
