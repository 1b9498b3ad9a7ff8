"""engine/structured.py: constrained decoding (llguidance) — outputs validate, the masks reach the sampler before
everything else, unconstrained rows are untouched, and pipelining changes nothing.

Two models: the embedded one (trained, so its constrained outputs end) for validation against `jsonschema` / `re`,
and a tiny random checkpoint with a byte-level tokenizer of 257 tokens under a model vocabulary of 301 (ids past the
tokenizer's are never allowed) for the engine-level checks, on one warmed-up engine.
"""
import json
import re
import threading
from dataclasses import asdict, replace

import jsonschema
import llguidance
import numpy as np
import pytest
from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask

import pocketjax as pj
from pocketjax.engine.plan import signatures
from pocketjax.engine.request import BatchedRequest
from pocketjax.engine.sampling import mask_logits
from pocketjax.errors import StructuredOutputError
from pocketjax.serve.llm import DEFAULT_MODEL

EOS = 256  # the tiny tokenizer's only special token, the tiny checkpoint's eos_token_id
CHOICES = ["yes", "no", "naïve \"q\"", "日本"]  # quotes and non-ASCII
OPTIONS = dict(max_batch_size=2, max_seq_len=32, prefill_chunk=16, min_kv_bucket=32, compile_cache_dir="off")
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "quote": {"type": "string", "pattern": "^[\"\\\\é日]{1,3}$"},  # escapes and non-ASCII
        "kind": {"enum": ["tool", "café", "日本"]},
        "score": {"type": "number", "minimum": -10, "maximum": 10},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9},
                                                   "ok": {"type": "boolean"}},
                  "required": ["id", "ok"], "additionalProperties": False},
    },
    "required": ["name", "quote", "kind", "score", "count", "tags", "owner"],
    "additionalProperties": False,
}


def byte_tokenizer():
    """A byte-level BPE without merges: 256 byte tokens (every string can be spelled) and an EOS token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    assert tok.get_vocab_size(with_added_tokens=True) == EOS + 1
    return tok


@pytest.fixture(scope="module")
def tiny(hf_checkpoint):
    """(model, tokenizer, a warmed-up engine that serves structured outputs, its compiled_count after warm-up)."""
    model = pj.load_model(hf_checkpoint("qwen3_gqa4_headdim", eos_token_id=EOS))
    tok = byte_tokenizer()
    engine = pj.Engine(model, tokenizer=tok, **OPTIONS)
    engine.warmup(progress=False)
    return model, tok, engine, engine.compiled_count()


def drain(sched):
    while sched.has_work():
        sched.step()


def served(engine, jobs, pipeline=True):
    """Handles of (prompt, sampling) jobs run to the end on a fresh Scheduler over `engine`."""
    sched = pj.Scheduler(engine, pipeline=pipeline)
    handles = [sched.submit(p, s) for p, s in jobs]
    drain(sched)
    return handles


def text(tok, ids):
    return tok.decode([t for t in ids if t != EOS])


# ---- the API -------------------------------------------------------------------------------------------------------

def test_structured_is_hashable_and_survives_asdict_and_json():
    params = pj.SamplingParams(max_tokens=9, structured=pj.Structured(json_schema=SCHEMA))
    assert isinstance(params.structured.json_schema, str) and json.loads(params.structured.json_schema) == SCHEMA
    hash(params)
    for d in (asdict(params), json.loads(json.dumps(asdict(params)))):  # serve/lockstep.py's round trip
        assert pj.SamplingParams(**d) == params
    choice = pj.SamplingParams(structured=pj.Structured(choice=["a", "b"]))
    assert choice.structured.choice == ("a", "b")
    assert pj.SamplingParams(**json.loads(json.dumps(asdict(choice)))) == choice
    for bad, match in [(pj.Structured(), "exactly one"), (pj.Structured(regex="a", choice=["a"]), "exactly one"),
                       (pj.Structured(regex=3), "regex"), (pj.Structured(choice=[]), "choice"),
                       (pj.Structured(choice=["a", 1]), "choice"), (pj.Structured(json_schema="{"), "not valid JSON"),
                       (pj.Structured(json_schema="[1]"), "JSON object"), (pj.Structured(json_object="yes"), "bool")]:
        with pytest.raises(StructuredOutputError, match=match):
            pj.SamplingParams(structured=bad).validate()
    with pytest.raises(pj.errors.SamplingError, match="pocketjax.Structured"):
        pj.SamplingParams(structured="json").validate()


def test_mask_logits_matches_llguidance_numpy_reference():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 301)).astype(np.float32)
    allowed = rng.integers(-2**31, 2**31, (3, 10), dtype=np.int64).astype(np.int32)
    allowed[1] = -1  # all ones: untouched bit for bit
    expected = logits.copy()
    apply_token_bitmask_inplace(expected, allowed)
    got = np.asarray(mask_logits(logits, allowed))
    np.testing.assert_array_equal(got, expected)
    assert got[1].tobytes() == logits[1].tobytes()


# ---- outputs validate (embedded model) -------------------------------------------------------------------------------

@pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors").exists(), reason="no embedded model")
def test_every_constrained_output_validates_greedy_and_sampled():
    lark = 'start: "(" item ("," item){0,3} ")"\nitem: /[a-z]{1,4}/ | /[0-9]{1,3}/'
    cases = [  # (constraint, does this text satisfy it)
        (pj.Structured(json_schema=SCHEMA), lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        (pj.Structured(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (pj.Structured(regex=r"[0-9]{3}-[a-z]{2,6}( [A-Z])?"),
         lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,6}( [A-Z])?", t) is not None),
        (pj.Structured(choice=CHOICES), lambda t: t in CHOICES),
        (pj.Structured(grammar=lark), lambda t: re.fullmatch(r"\((?:[a-z]{1,4}|[0-9]{1,3})"
                                                             r"(?:,(?:[a-z]{1,4}|[0-9]{1,3})){0,3}\)", t) is not None),
    ]
    prompts = ["def parse(data):\n    return ", "# config\n"]
    seeds = range(3)
    jobs = []
    for structured, _ in cases:
        for prompt in prompts:
            jobs.append((prompt, pj.SamplingParams(max_tokens=100, temperature=0.0, structured=structured)))
            jobs += [(prompt, pj.SamplingParams(max_tokens=100, temperature=0.8, top_p=0.95, seed=s,
                                                structured=structured)) for s in seeds]
    with pj.LLM(max_batch_size=8, max_seq_len=192, prefill_chunk=32) as llm:
        outs = llm.generate([p for p, _ in jobs], [s for _, s in jobs])
    per_case = len(outs) // len(cases)
    for k, (structured, valid) in enumerate(cases):
        done = [o for o in outs[k * per_case:(k + 1) * per_case] if o.finish_reason == "stop"]
        # a sampled row may ramble inside a JSON string until max_tokens; most end, and every one that ends is valid
        assert len(done) >= per_case // 2, (structured.kind, [o.text for o in outs[k * per_case:(k + 1) * per_case]])
        for out in done:
            assert valid(out.text), (structured.kind, out.text)
        if structured.kind != "choice":  # sampling explores: not every seed gives the same answer
            assert len({o.text for o in done}) >= 2, (structured.kind, [o.text for o in done])


# ---- the engine (tiny random checkpoint) --------------------------------------------------------------------------

def test_constrained_outputs_of_a_random_model_validate_and_never_use_ids_past_the_tokenizer(tiny):
    model, tok, engine, _ = tiny
    pattern = r"[ab]{2}-[0-9]{1,3}"
    structured = pj.Structured(regex=pattern)
    jobs = [([3, 4, 5], pj.SamplingParams(max_tokens=20, temperature=t, seed=s, structured=structured))
            for t in (0.0, 1.5) for s in range(4)]
    for handle in served(engine, jobs):
        out = handle.result()
        assert out.finish_reason == "stop" and max(out.token_ids) <= EOS
        assert re.fullmatch(pattern, text(tok, out.token_ids)), out.token_ids


def test_unconstrained_rows_batched_with_constrained_ones_are_as_alone(tiny):
    model, tok, engine, _ = tiny
    plain = [([7, 8, 9], pj.SamplingParams(max_tokens=14, temperature=0.0, logprobs=3, ignore_eos=True)),
             ([10, 11], pj.SamplingParams(max_tokens=14, temperature=1.0, seed=5, logprobs=2, ignore_eos=True))]
    constrained = pj.SamplingParams(max_tokens=14, temperature=1.0, seed=9, logprobs=2,
                                    structured=pj.Structured(regex=r"[a-z]{3,20}"))
    free = pj.SamplingParams(max_tokens=14, temperature=1.0, seed=9, logprobs=2)
    for job in plain:
        alone = served(engine, [job])[0].result()
        mixed, mate = (h.result() for h in served(engine, [job, ([12, 13], constrained)]))
        assert re.fullmatch(r"[a-z]{3,20}", text(tok, mate.token_ids))
        assert mixed.token_ids == alone.token_ids
        # logprobs bit for bit as beside an unconstrained mate (the same batch shape: another row count is
        # another program, whose float rounding may differ in the last bit)
        beside = served(engine, [job, ([12, 13], free)])[0].result()
        assert mixed.logprobs == beside.logprobs and beside.token_ids == alone.token_ids


def test_pipelined_and_host_fed_schedulers_give_the_same_constrained_tokens(tiny, monkeypatch):
    model, tok, engine, _ = tiny
    deferred = []
    sample_deferred = engine._sample_deferred
    monkeypatch.setattr(engine, "_sample_deferred", lambda step: (deferred.append(1), sample_deferred(step)))
    jobs = [([3, 4], pj.SamplingParams(max_tokens=24, temperature=1.0, seed=s, logprobs=2,
                                       structured=pj.Structured(json_schema={"type": "object", "properties": {
                                           "a": {"type": "integer"}, "b": {"enum": ["x", "yz"]}}})))
            for s in range(3)] + [([5, 6, 7], pj.SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))]
    piped = [h.result() for h in served(engine, jobs, pipeline=True)]
    assert deferred  # the pipelined run deferred constrained samplers behind their forward passes
    count = len(deferred)
    host = [h.result() for h in served(engine, jobs, pipeline=False)]
    assert len(deferred) == count  # host-fed steps compute their masks at dispatch
    for a, b in zip(piped, host):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        # the two policies batch the rows differently (other programs): logprobs agree to float rounding
        np.testing.assert_allclose([lp for lp, _ in a.logprobs], [lp for lp, _ in b.logprobs], atol=1e-5)


def test_reported_logprobs_are_raw_by_default(tiny):
    """The default logprobs_mode ("raw_logprobs", vLLM's) reports the unconstrained log_softmax, as an unmasked row
    would for its token, while the token is the masked argmax. (The processed modes' masked distribution is checked
    in tests/test_logprobs_mode.py, with allowed_token_ids: the same bitmask path. A second engine here would add
    programs to the process-wide compiled_count the warm-up tests below compare against.)"""
    model, tok, engine, _ = tiny
    assert engine.config.logprobs_mode == "raw_logprobs"
    grammar = pj.Structured(regex=r"(ab|cd)[0-9]{2,4}")
    prompt = [20, 21, 22]
    req = BatchedRequest("lp", prompt, pj.SamplingParams(max_tokens=6, temperature=0.0, logprobs=5,
                                                         structured=grammar))
    engine.allocate_slot(req)
    try:
        engine.batch_prefill([req])
        while not req.finished:
            engine.batch_decode_step([req])
    finally:
        engine.free_slot("lp")
    ll = llguidance.LLTokenizer(tok.to_str(), n_vocab=model.config.vocab_size, eos_token=EOS)
    matcher = llguidance.LLMatcher(ll, grammar.grammar_text())  # an independent matcher fed the same tokens
    ids = prompt + req.generated_tokens
    logits = np.asarray(pj.logits(model, np.array([ids], np.int32)))[0].astype(np.float64)
    disallowed_reported = False
    for step, token in enumerate(req.generated_tokens):
        mask = allocate_token_bitmask(1, model.config.vocab_size)
        fill_next_token_bitmask(matcher, mask)
        row = logits[len(prompt) - 1 + step][None].copy()
        apply_token_bitmask_inplace(row, mask)
        masked = row[0] - np.logaddexp.reduce(row[0])
        assert token == int(np.argmax(masked)) and np.isfinite(masked).sum() < 100
        raw = logits[len(prompt) - 1 + step]
        reference = raw - np.logaddexp.reduce(raw)
        logprob, top = req.logprobs[step]
        np.testing.assert_allclose(logprob, reference[token], atol=2e-4)
        best = np.argsort(-reference)[:5]
        expected = {int(t): reference[t] for t in best if np.isfinite(reference[t])}
        assert set(top) == set(expected)
        np.testing.assert_allclose([top[t] for t in expected], list(expected.values()), atol=2e-4)
        disallowed_reported |= not np.isfinite(masked[list(top)]).all()
        assert matcher.consume_token(token)
    assert disallowed_reported  # raw: the grammar does not shape what is reported
    assert re.fullmatch(r"(ab|cd)[0-9]{2,4}", text(tok, req.generated_tokens))


def test_a_bad_constraint_fails_at_submit_and_its_batch_mates_are_served(tiny):
    model, tok, engine, _ = tiny
    good = ([7, 8, 9], pj.SamplingParams(max_tokens=6, temperature=0.0))
    expected = served(engine, [good])[0].result().token_ids
    sched = pj.Scheduler(engine)
    bad = [sched.submit([1, 2], pj.SamplingParams(structured=s)) for s in
           (pj.Structured(regex="[a-z"), pj.Structured(json_schema={"type": "nope"}),
            pj.Structured(grammar="start: undefined_rule"))]
    handle = sched.submit(*good)
    drain(sched)
    for b in bad:
        with pytest.raises(StructuredOutputError, match="does not compile"):
            b.result(timeout=0)
    assert handle.result().token_ids == expected
    without = pj.Engine(model, **OPTIONS)  # no tokenizer: nothing to compile against
    with pytest.raises(StructuredOutputError, match="tokenizer"):
        without.validate(BatchedRequest("x", [1], pj.SamplingParams(structured=pj.Structured(regex="a"))))


def test_without_llguidance_pocketjax_imports_and_a_constraint_says_what_to_install(tiny, monkeypatch):
    """llguidance is imported on the first constraint: a machine without it (the lent GPU host) imports pocketjax
    and serves unconstrained requests; a constrained one fails at submit with a StructuredOutputError naming it."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['llguidance'] = None; import pocketjax, pocketjax.serve.llm, "
            "pocketjax.engine.structured; print('imported')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "imported" in run.stdout, run.stderr[-2000:]
    model, tok, engine, _ = tiny
    good = ([7, 8, 9], pj.SamplingParams(max_tokens=6, temperature=0.0))
    expected = served(engine, [good])[0].result().token_ids
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` raises ImportError
    sched = pj.Scheduler(engine)
    bad = sched.submit([1, 2], pj.SamplingParams(structured=pj.Structured(regex="never compiled before [0-9]+")))
    handle = sched.submit(*good)
    drain(sched)
    with pytest.raises(StructuredOutputError, match=r"pip install 'llguidance"):
        bad.result(timeout=0)
    assert handle.result().token_ids == expected


@pytest.mark.parametrize("pipeline", [True, False])
def test_a_grammar_that_reaches_no_token_ends_its_request_with_the_error(tiny, pipeline):
    model, tok, engine, _ = tiny
    # <[290]> is a token id of the model's vocabulary past the tokenizer's (257): no text spells it, so after
    # "abc" the grammar allows nothing; `first` cannot start at all.
    stuck = pj.SamplingParams(max_tokens=10, structured=pj.Structured(grammar='start: "abc" <[290]>'))
    first = pj.SamplingParams(max_tokens=10, structured=pj.Structured(grammar="start: <[290]>"))
    mate = ([7, 8, 9], pj.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    handles = served(engine, [([1, 2], stuck), ([3], first), mate], pipeline=pipeline)
    with pytest.raises(StructuredOutputError, match="after 3 tokens: no token"):
        handles[0].result(timeout=0)
    with pytest.raises(StructuredOutputError, match="after 0 tokens: no token"):
        handles[1].result(timeout=0)
    assert handles[2].result().token_ids == served(engine, [mate])[0].result().token_ids
    assert not engine.slots.owner


def test_max_tokens_bounds_a_constrained_request(tiny):
    model, tok, engine, _ = tiny
    out = served(engine, [([5], pj.SamplingParams(max_tokens=5, temperature=1.0, seed=1,
                                                  structured=pj.Structured(regex="[a-z]{8,}")))])[0].result()
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert re.fullmatch("[a-z]{5}", text(tok, out.token_ids))


def test_compiled_count_is_flat_after_warmup_for_a_mixed_workload(tiny):
    model, tok, engine, warm = tiny
    mixed = [([1, 2, 3], pj.SamplingParams(max_tokens=8, temperature=0.0, structured=pj.Structured(
                 choice=["abc", "abd", "x"]))),
             ([4, 5], pj.SamplingParams(max_tokens=8, temperature=0.8, logprobs=4, seed=2)),
             ([6], pj.SamplingParams(max_tokens=8, temperature=1.0, seed=3, logprobs=1,
                                     structured=pj.Structured(json_object=True)))]
    for pipeline in (True, False):
        served(engine, mixed, pipeline=pipeline)
    assert engine.compiled_count() == warm
    calls = signatures(engine.rules)
    masked = [c for c in calls if c.step.endswith("_masked")]
    assert {c.step for c in masked} == {"sample_first_masked", "sample_next_masked"}
    assert not any(c.step == "sample_first" for c in calls)  # a structured engine's first tokens: all masked
    plain = signatures(replace(engine.rules, structured=False))  # no tokenizer: no mask warmed
    assert not any(c.step.endswith("_masked") for c in plain)
    assert "tensor<2x10xi32>" in engine.lower(masked[-1]).as_text()  # the mask is an argument of the lowered sampler


def test_a_deferred_sampler_keeps_the_pending_step_rules(tiny):
    model, tok, engine, warm = tiny
    constrained = BatchedRequest("c", [3, 4], pj.SamplingParams(max_tokens=10, temperature=0.0,
                                                                structured=pj.Structured(regex="[a-z]{10}")))
    freed = BatchedRequest("f", [5, 6], pj.SamplingParams(max_tokens=10, temperature=0.0,
                                                          structured=pj.Structured(regex="[0-9]{10}")))
    for r in (constrained, freed):
        engine.allocate_slot(r)
    try:
        engine.batch_prefill([constrained, freed])
        n = engine.decode_dispatch([constrained, freed])  # host-fed: masks at dispatch
        n1 = engine.decode_dispatch([constrained, freed], after=n)  # fed on device: its sampler waits for n
        assert n1.logits is not None and n1.out is None
        with pytest.raises(pj.errors.RequestError, match="collect that step first"):
            engine.decode_dispatch([constrained, freed], after=n1)
        with pytest.raises(pj.errors.RequestError, match="dispatch"):
            engine.decode_collect(n1)
        engine.free_slot("f")  # freed while its rows are in flight: dropped, and its deferred row touches nothing
        assert engine.decode_collect(n)[1] is None and n1.logits is None and n1.out is not None
        assert engine.decode_collect(n1)[1] is None
        while not constrained.finished:
            engine.batch_decode_step([constrained])
    finally:
        engine.free_slot("c")
    assert len(freed.generated_tokens) == 1 and freed.finish_reason == "cancelled"  # its prefill token only
    assert re.fullmatch("[a-z]{10}", text(tok, constrained.generated_tokens)) and constrained.finish_reason == "stop"
    assert engine.compiled_count() == warm


def test_past_the_cache_no_constraint_compiles_on_the_scheduler_thread(tiny, monkeypatch):
    """With the compiled-constraint cache shrunk to 1, three distinct constraints submitted together evict each other
    before any is admitted: each request keeps the matcher its validation compiled (on the submitting thread), so
    admission, under the scheduler's lock, compiles nothing and every answer still follows its regex."""
    model, tok, engine, _ = tiny
    monkeypatch.setattr(engine.constrainer, "cache_size", 1)
    compiled_on = []
    grammar_text = pj.Structured.grammar_text

    def recorded(self):
        compiled_on.append(threading.current_thread())
        return grammar_text(self)

    monkeypatch.setattr(pj.Structured, "grammar_text", recorded)
    patterns = ["[a-c]{4}", "[d-f]{4}", "[0-3]{4}"]
    with pj.Scheduler(engine).start() as sched:
        handles = sched.submit_many([([i + 1, 2], pj.SamplingParams(max_tokens=8, temperature=0.0,
                                                                    structured=pj.Structured(regex=p)), None)
                                     for i, p in enumerate(patterns)])
        outs = [h.result(timeout=120) for h in handles]
        loop = sched._thread
    assert len(compiled_on) == len(patterns) and loop not in compiled_on
    assert set(compiled_on) == {threading.current_thread()}
    for out, pattern in zip(outs, patterns):
        assert re.fullmatch(pattern, text(tok, out.token_ids)), (pattern, out.token_ids)
