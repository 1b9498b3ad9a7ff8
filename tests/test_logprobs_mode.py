"""EngineConfig.logprobs_mode (vLLM's four names): every mode's reported logprobs and top logprobs against an
independent NumPy computation from the model's logits (pj.logits on the same tokens).

raw_*: the model's logits as they are, before masks, logit_bias, penalties, temperature and filtering (pj.logits is
the engine's logits bit for bit on the CPU default, so raw_logits match exactly). processed_*: the distribution the
token was drawn from, rebuilt here in NumPy (mask, bias, penalties, temperature, top_k / top_p / min_p; greedy rows
at temperature 1, unfiltered). One engine per mode, one batch of four kinds of rows.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import pocketjax as pj
from pocketjax.errors import ConfigError
from pocketjax.serve.llm import DEFAULT_MODEL
from pocketjax.serve.tokenizer import Tokenizer

OPTIONS = dict(max_batch_size=4, max_seq_len=64, prefill_chunk=32)
PROMPT = "def fibonacci(n):\n"
N = 8  # tokens per request
TOP = 5


def requests(vocab: int, allowed: list[int]) -> list[pj.SamplingParams]:
    """A greedy row with penalties (and filters it ignores), a sampled row with every filter and penalty, a sampled row with allowed ids and
    logit_bias, and a greedy row with logit_bias (masked and biased rows beside plain ones)."""
    common = dict(max_tokens=N, logprobs=TOP, ignore_eos=True)
    return [
        pj.SamplingParams(temperature=0.0, top_p=0.5, min_p=0.2, repetition_penalty=1.3, frequency_penalty=0.4,
                          **common),  # greedy: no filter, whatever top_p / min_p say
        pj.SamplingParams(temperature=0.8, top_k=30, top_p=0.95, min_p=0.1, seed=3, repetition_penalty=1.2,
                          presence_penalty=0.5, frequency_penalty=0.3, **common),
        pj.SamplingParams(temperature=1.3, top_p=0.95, min_p=0.05, seed=7, allowed_token_ids=allowed,
                          logit_bias={allowed[0]: 2.5, allowed[1]: -1.0, vocab - 1: 5.0}, **common),
        pj.SamplingParams(temperature=0.0, logit_bias={allowed[2]: 3.0}, **common),
    ]


def log_softmax(x: np.ndarray) -> np.ndarray:
    finite = x[np.isfinite(x)]
    return x - (finite.max() + np.log(np.exp(finite - finite.max()).sum()))


def kept(s: np.ndarray, p: pj.SamplingParams) -> np.ndarray:
    """top_k, then top_p over the top-k survivors' renormalized mass, then min_p, by a full sort (HF/vLLM)."""
    order = np.argsort(-s, kind="stable")
    keep = np.isfinite(s)
    if 0 < p.top_k < s.size:
        keep[order[p.top_k:]] = False
    w = np.where(keep, np.exp(s - s.max()), 0.0)
    sorted_w = w[order] / w.sum()
    keep[order[np.cumsum(sorted_w) - sorted_w >= p.top_p]] = False  # drop once the mass above reaches top_p
    return keep & (np.exp(s - s.max()) >= p.min_p)


def processed(raw: np.ndarray, p: pj.SamplingParams, prompt: list[int], before: list[int]) -> np.ndarray:
    """The values a row at this step was drawn from: allowed mask, logit_bias, penalties (repetition over prompt
    and output, presence/frequency over output), then temperature and filters for sampled rows."""
    x = raw.astype(np.float64)
    if p.allowed_token_ids is not None:
        x = np.where(np.isin(np.arange(x.size), p.allowed_token_ids), x, -np.inf)
    for t, b in p.logit_bias:
        x[t] += b
    counts = np.bincount(np.asarray(before, int), minlength=x.size)
    seen = np.isin(np.arange(x.size), prompt) | (counts > 0)
    x = np.where(seen, np.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty), x)
    x = x - p.presence_penalty * (counts > 0) - p.frequency_penalty * counts
    if p.greedy:
        return x
    s = x / p.temperature
    return np.where(kept(s, p), s, -np.inf)


@pytest.fixture(scope="module")
def model():
    return pj.load_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def tokenizer(model):
    return Tokenizer.from_folder(model.path)


def served(engine: pj.Engine, prompt: list[int], params: list[pj.SamplingParams]) -> list[pj.Completion]:
    """Every request submitted before the first step, then run to the end: the same batch shapes every time."""
    scheduler = pj.Scheduler(engine)
    handles = [scheduler.submit(prompt, p) for p in params]
    while scheduler.has_work():
        scheduler.step()
    return [h.result() for h in handles]


@pytest.fixture(scope="module", params=["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"])
def run(request, model, tokenizer):
    """(mode, params, completions, prompt tokens) of one engine in that mode."""
    mode = request.param
    engine = pj.Engine(model, tokenizer=tokenizer, logprobs_mode=mode, **OPTIONS)
    assert engine.config.logprobs_mode == mode
    prompt = tokenizer.encode(PROMPT)
    allowed = sorted({t for w in (" a", " b", " c", " return", "\n") for t in tokenizer.encode(w)})
    params = requests(model.config.vocab_size, allowed)
    out = served(engine, prompt, params)
    # Other values of every field (seeds, temperatures, filters, biases, allowed ids, penalties) are data: the
    # second batch compiles nothing the first did not (both find the prompt cached, unlike the first).
    counts = []
    for seed in (11, 12):
        other = [dataclasses.replace(p, seed=seed, temperature=p.temperature * 0.5 * (seed - 10),
                                     top_p=min(1.0, p.top_p + 0.02 * (seed - 10)), repetition_penalty=1.1,
                                     logit_bias={t: -b for t, b in p.logit_bias},
                                     allowed_token_ids=p.allowed_token_ids and p.allowed_token_ids[seed - 11:])
                 for p in params]
        served(engine, prompt, other)
        counts.append(engine.compiled_count())
    assert counts[0] == counts[1], "a request's values compiled a program"
    return mode, params, out, prompt


def test_each_mode_matches_numpy_from_the_logits(run, model):
    mode, params, out, prompt = run
    for p, c in zip(params, out):
        assert len(c.token_ids) == N and len(c.logprobs) == N
        raw = np.asarray(pj.logits(model, np.array([prompt + c.token_ids], np.int32)))[0, len(prompt) - 1:-1]
        for step, (token, (value, top)) in enumerate(zip(c.token_ids, c.logprobs)):
            if mode.startswith("raw"):
                expected = raw[step].astype(np.float64)
            else:
                expected = processed(raw[step], p, prompt, c.token_ids[:step])
            if mode.endswith("logprobs"):
                expected = log_softmax(expected)
            assert np.isfinite(value), (p, step)  # the drawn token is always in the processed distribution
            if mode == "raw_logits":  # pj.logits is the engine's forward bit for bit (CPU default)
                assert value == raw[step, token] and all(v == raw[step, t] for t, v in top.items())
            np.testing.assert_allclose(value, expected[token], atol=1e-5, err_msg=f"{mode} {p} step {step}")
            best = [int(t) for t in np.argsort(-expected, kind="stable")[:TOP] if np.isfinite(expected[t])]
            assert set(top) == set(best), (mode, p, step)  # -inf entries (filtered out) are not reported
            np.testing.assert_allclose([top[t] for t in best], expected[best], atol=1e-5)


def test_raw_mode_of_a_masked_row_reports_the_unmasked_distribution(run, model):
    """With a raw mode the allowed-ids and logit_bias row reports what an unmasked row would for its own token:
    tokens outside its allowed set can be among its top logprobs. Processed modes never report them."""
    mode, params, out, prompt = run
    p, c = params[2], out[2]
    assert set(c.token_ids) <= set(p.allowed_token_ids)
    outside = {t for _, top in c.logprobs for t in top} - set(p.allowed_token_ids)
    assert bool(outside) == mode.startswith("raw")


def test_a_bad_mode_is_a_config_error_naming_the_field(monkeypatch):
    with pytest.raises(ConfigError, match="logprobs_mode"):
        pj.EngineConfig.of(logprobs_mode="processed")
    monkeypatch.setenv("POCKETJAX_LOGPROBS_MODE", "logits")
    with pytest.raises(ConfigError, match="POCKETJAX_LOGPROBS_MODE"):
        pj.EngineConfig.of()
    monkeypatch.setenv("POCKETJAX_LOGPROBS_MODE", "processed_logprobs")
    assert pj.EngineConfig.of().logprobs_mode == "processed_logprobs"
    assert pj.EngineConfig.of(logprobs_mode="raw_logits").logprobs_mode == "raw_logits"  # an argument wins
