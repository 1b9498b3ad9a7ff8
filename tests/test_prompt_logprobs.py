"""Prompt log-probabilities from batched prefill, and LLM.score: against log_softmax(pj.logits) on the same tokens,
against transformers, and against the same requests run alone."""
from dataclasses import replace

import jax
import numpy as np
import pytest

import pocketjax as pj
from pocketjax.engine.request import BatchedRequest
from pocketjax.engine.plan import signatures
from pocketjax.errors import RequestError, SamplingError
from pocketjax.serve.llm import DEFAULT_MODEL

from test_engine import random_prompts, run
from conftest import oracle

torch = oracle("torch")
transformers = oracle("transformers")

# Two XLA programs (chunks attending over the slotted cache vs one causal pass) round differently: observed
# differences are ~1e-6 at |logprob| <= 10, i.e. ~10 float32 ulps; 2e-5 leaves room without hiding a wrong position
# (neighbouring positions' logprobs differ by ~1).
TOL = 2e-5
SIZES = dict(max_batch_size=4, max_seq_len=64, prefill_chunk=16)  # one set of sizes: the tests share compiled shapes


@pytest.fixture(scope="module")
def model(hf_checkpoint):
    return pj.load_model(hf_checkpoint("qwen3_gqa4_headdim"))


def reference(model: pj.Model, prompt: list[int], width: int = 64) -> np.ndarray:
    """log_softmax of pj.logits: float32 [T, vocab], row t scores token t + 1. Padded to one width, so every
    prompt shares one compiled forward (causal: the padding after a position cannot change its logits)."""
    padded = np.zeros((1, width), np.int32)
    padded[0, :len(prompt)] = prompt
    return np.asarray(jax.nn.log_softmax(pj.logits(model, padded)[0, :len(prompt)], axis=-1))


def check_prompt_logprobs(entries, prompt, ref, k, tol=TOL):
    assert len(entries) == len(prompt) and entries[0] is None
    for t in range(1, len(prompt)):
        logprob, top = entries[t]
        assert logprob == pytest.approx(ref[t - 1, prompt[t]], abs=tol), t
        best = np.argsort(-ref[t - 1], kind="stable")[:k]
        assert list(top) == best.tolist(), t
        np.testing.assert_allclose(list(top.values()), ref[t - 1, best], atol=tol)


def test_chunked_batched_prompt_logprobs_match_logits_and_leave_tokens_alone(model):
    """Chunks of 16 (prompt 40: 16 + 16 + 8; 17: a 1-token last chunk; 16: exactly one), k from 0 to 20, and a
    one-token prompt without prompt logprobs in the same chunks."""
    engine = pj.Engine(model, **SIZES)
    prompts = random_prompts(1, (40, 17, 16, 1), model.config.vocab_size)
    same = dict(max_tokens=3, ignore_eos=True)  # one length: the batch keeps one decode shape (fewer compiles)
    params = [pj.SamplingParams(temperature=0.0, prompt_logprobs=5, **same),
              pj.SamplingParams(temperature=0.9, seed=7, prompt_logprobs=0, **same),
              pj.SamplingParams(temperature=1.0, top_k=20, seed=3, prompt_logprobs=20, logprobs=2, **same),
              pj.SamplingParams(temperature=0.7, seed=1, **same)]
    reqs = run(engine, prompts, params)
    for req, prompt, sp in zip(reqs, prompts, params):
        if sp.prompt_logprobs is None:
            assert req.prompt_logprobs == []
        else:
            check_prompt_logprobs(req.prompt_logprobs, prompt, reference(model, prompt), sp.prompt_logprobs)
    # the same request alone and without prompt logprobs generates the same tokens (sampled ones too)
    for req, prompt, sp in zip(reqs, prompts, params):
        alone = run(engine, [prompt], [replace(sp, prompt_logprobs=None)])[0]
        assert alone.generated_tokens == req.generated_tokens and alone.prompt_logprobs == []


def test_token_budget_chunk_boundaries(model):
    """Budgets of 7 cut a prompt of 23 into 7 + 7 + 7 + 2: each chunk's last position scores the next chunk's
    first token."""
    engine = pj.Engine(model, **SIZES)
    prompt = random_prompts(2, (23,), model.config.vocab_size)[0]
    req = BatchedRequest("r", prompt, pj.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))
    engine.allocate_slot(req)
    sizes = []
    while not req.finished:
        before = len(req.prompt_logprobs)
        engine.batch_prefill([req], token_budget=7)
        sizes.append(len(req.prompt_logprobs) - before)
    engine.free_slot("r")
    # [None] + 7 (position 6 scores token 7, the next chunk's first), 7, 7, then 1: the last token scores nothing
    assert sizes == [8, 7, 7, 1]
    check_prompt_logprobs(req.prompt_logprobs, prompt, reference(model, prompt), 2)


def test_prompt_logprobs_agree_with_transformers(hf_checkpoint, model):
    folder = hf_checkpoint("qwen3_gqa4_headdim")  # the checkpoint `model` was loaded from
    prompt = random_prompts(3, (30,), model.config.vocab_size)[0]
    engine = pj.Engine(model, **SIZES)
    req = run(engine, [prompt], pj.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=4))[0]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1).numpy()
    check_prompt_logprobs(req.prompt_logprobs, prompt, ref, 4, tol=1e-4)  # two implementations: 1e-4


def test_prompt_logprobs_skip_prefix_reuse_and_leave_it_to_others(model):
    engine = pj.Engine(model, **SIZES)
    shared = random_prompts(4, (30,), model.config.vocab_size)[0]
    run(engine, [shared], pj.SamplingParams(max_tokens=2, temperature=0.0))  # slot caches `shared`
    scored = BatchedRequest("s", shared + [5, 6], pj.SamplingParams(max_tokens=2, temperature=0.0,
                                                                    prompt_logprobs=1))
    engine.allocate_slot(scored)
    assert scored.cached_prefix_len == 0  # every prompt position is computed, so every one is scored
    engine.batch_prefill([scored])
    engine.free_slot("s")
    check_prompt_logprobs(scored.prompt_logprobs, scored.prompt_tokens, reference(model, scored.prompt_tokens), 1)
    plain = BatchedRequest("p", shared + [5, 6, 7], pj.SamplingParams(max_tokens=2, temperature=0.0))
    engine.allocate_slot(plain)
    assert plain.cached_prefix_len == len(shared) + 2  # the scored request's prompt is cached for the next
    engine.free_slot("p")


def greedy_continuation(model: pj.Model, context: list[int], n: int) -> list[int]:
    ids = list(context)
    for _ in range(n):
        ids.append(int(reference(model, ids)[-1].argmax()))
    return ids[len(context):]


def test_score_matches_logits_and_flags_greedy(model):
    vocab = model.config.vocab_size
    context = random_prompts(5, (20,), vocab)[0]
    greedy = greedy_continuation(model, context, 4)
    off = greedy[:2] + [int(np.argsort(reference(model, context + greedy[:2])[-1])[-2])] + greedy[3:]  # 2nd best
    other_context = random_prompts(6, (9,), vocab)[0]
    with pj.LLM(model, **SIZES) as llm:
        scores = llm.score(context, [greedy, off, [7]])  # one context for every continuation
        paired = llm.score([context, other_context], [greedy, [3, 4, 5]])
    assert [s.greedy for s in scores] == [True, False, int(reference(model, context)[-1].argmax()) == 7]
    for (ctx, cont), score in zip([(context, greedy), (context, off), (context, [7]), (context, greedy),
                                   (other_context, [3, 4, 5])], scores + paired):
        ref = reference(model, ctx + cont)
        want = [ref[len(ctx) - 1 + i, token] for i, token in enumerate(cont)]
        assert score.token_ids == cont and len(score.logprobs) == len(cont)
        np.testing.assert_allclose(score.logprobs, want, atol=TOL)
        assert score.logprob == pytest.approx(sum(score.logprobs))
        assert score.greedy == all(ref[len(ctx) - 1 + i].argmax() == t for i, t in enumerate(cont))
    assert isinstance(scores[0], pj.Score)


@pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors").exists(), reason="no embedded model")
def test_score_text_splits_like_lm_eval():
    with pj.LLM(**SIZES) as llm:
        tok = llm.tokenizer
        ctx, cont = llm.encode_pair("def add(a, b):  ", "return a + b")  # trailing spaces join the continuation
        assert ctx + cont == tok.encode("def add(a, b):  return a + b")
        assert len(ctx) == len(tok.encode("def add(a, b):"))
        empty = llm.encode_pair("", "import os")[0]
        assert empty == [tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id]
        score = llm.score("def add(a, b):  ", "return a + b")[0]
    ref = reference(llm.model, ctx + cont)
    assert score.token_ids == cont
    np.testing.assert_allclose(score.logprobs, [ref[len(ctx) - 1 + i, t] for i, t in enumerate(cont)], atol=TOL)


def test_validation_errors(model):
    for bad in (-1, 21, 1.5, True, "3"):
        with pytest.raises(SamplingError, match="prompt_logprobs"):
            pj.SamplingParams(prompt_logprobs=bad).validate()
    for good in (None, 0, 20):
        pj.SamplingParams(prompt_logprobs=good).validate()
    engine = pj.Engine(model, **SIZES)
    with pytest.raises(SamplingError, match="prompt_logprobs"):
        engine.allocate_slot(BatchedRequest(0, [1, 2], pj.SamplingParams(prompt_logprobs=99)))
    assert engine.num_free_slots == SIZES["max_batch_size"]
    with pj.LLM(model, **SIZES) as llm:
        check_score_errors(llm, model.config.vocab_size)


def check_score_errors(llm: pj.LLM, vocab: int) -> None:
    for contexts, continuations, message in [([[1], [2]], [[3], [4], [5]], "2 contexts for 3"),
                                             ("text", [3], "both be strings"),
                                             ([1, 2], [[]], "at least one token"),
                                             ([[]], [[1]], "at least one token"),
                                             (None, [1], "contexts must be")]:
        with pytest.raises(RequestError, match=message):
            llm.score(contexts, continuations)
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.score([1], [vocab])


def test_warmup_covers_the_scored_prefill_when_asked(model):
    # one slot of 16 positions: 8 signatures (prefill, its scored variant, 2 samplers, 3 decodes... of one shape)
    options = dict(max_batch_size=1, max_seq_len=16, prefill_chunk=16, min_kv_bucket=16, compile_cache_dir="off")
    engine = pj.Engine(model, **options)
    plain, scored = signatures(engine.rules), signatures(engine.rules, prompt_logprobs=True)
    prefill = [c for c in plain if c.step == "prefill"]
    want = [c._replace(step="prefill_scored", scored=n) for c in prefill for n in sorted({1, c.rows})]  # scored_rows
    assert [c for c in scored if c.step == "prefill_scored"] == want
    assert set(scored) - set(plain) == set(want)
    engine.warmup(progress=False, prompt_logprobs=True)
    compiled = engine.compiled_count()
    prompts = random_prompts(7, (5, 12, 15), model.config.vocab_size)
    for prompt in prompts:
        req = run(engine, [prompt], pj.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2))[0]
        assert len(req.prompt_logprobs) == len(prompt)
    assert engine.compiled_count() == compiled


def test_prompt_logprobs_on_a_tp2_mesh(hf_checkpoint, model):
    """Vocab-parallel lm_head: the per-row scorer's log_softmax and top-k reduce across both devices."""
    sharded = pj.load_model(hf_checkpoint("qwen3_gqa4_headdim"), tp=2)
    prompt = random_prompts(8, (21,), model.config.vocab_size)[0]
    req = run(pj.Engine(sharded, **SIZES), [prompt], pj.SamplingParams(max_tokens=1, prompt_logprobs=3))[0]
    check_prompt_logprobs(req.prompt_logprobs, prompt, reference(model, prompt), 3)
