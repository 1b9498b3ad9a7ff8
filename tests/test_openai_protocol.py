"""openai_protocol over real HTTP: status codes a client can act on (400 vs 429 + Retry-After), max_tokens 0 with
echo (prompt scoring), and top logprobs whose names never collide (bytes: spelling, return_tokens_as_token_ids).

References are independent of the server: a plain causal forward (`pj.logits`) for log-probabilities, and
transformers' GPT-2 byte table for the bytes of byte-level tokens.
"""
import functools
import json
import threading
import urllib.error
import urllib.request

import jax
import numpy as np
import openai
import pytest
from typing import Any

import pocketjax as pj
from pocketjax.serve.llm import DEFAULT_MODEL
from pocketjax.serve.http.server import BackgroundServer, create_app

pytestmark = [pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors").exists(), reason="no embedded model"),
              pytest.mark.leg1_only]  # HTTP / host-side: the same under any JAX
SLOTS, CONTEXT = 4, 128  # test_server's engine shape: a shared session reuses its compiled steps
NAME = "pocket-coder"
MULTIBYTE = "# 你好，世界 😀 ñ"  # at two positions of this prompt, two of the top-5 tokens both decode to "\ufffd"


@pytest.fixture(scope="module")
def llm():
    with pj.LLM(max_batch_size=SLOTS, max_seq_len=CONTEXT, prefill_chunk=32) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(create_app(llm, max_waiting=3)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(url: str, body: dict) -> tuple[int, dict, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read()), response.headers
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers


def reference_logprobs(llm, tokens: list[int]) -> np.ndarray:
    return np.asarray(jax.nn.log_softmax(pj.logits(llm.model, [tokens])[0], axis=-1))


@functools.cache
def HF_TOKENIZER():  # noqa: N802 - a memoized constant
    transformers = pytest.importorskip("transformers")  # the reference: the torch-free CI leg skips

    return transformers.AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))


def token_bytes(token_id: int) -> bytes:
    """transformers' own byte-level table: the bytes a GPT-2-style piece stands for."""
    bytes_to_unicode = pytest.importorskip("transformers.convert_slow_tokenizer").bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(byte_of[c] for c in HF_TOKENIZER().convert_ids_to_tokens(token_id))


def test_more_choices_than_the_queue_is_400_and_a_full_queue_is_429_with_retry_after(llm, server, client):
    status, body, _ = post(server.url + "/v1/completions", {"model": NAME, "prompt": "x", "n": 4})
    assert status == 400 and body["error"]["param"] == "n" and "--max-waiting 3" in body["error"]["message"]
    status, body, _ = post(server.url + "/v1/completions", {"model": NAME, "prompt": ["a", "b"], "n": 2})
    assert status == 400 and body["error"]["param"] == "prompt"
    status, body, _ = post(server.url + "/v1/chat/completions",
                           {"model": NAME, "messages": [{"role": "user", "content": "x"}], "n": 4})
    assert status == 400 and body["error"]["code"] == "exceeds_max_waiting"
    with pytest.raises(openai.BadRequestError):  # the official client does not retry it
        client.completions.create(model=NAME, prompt="x", n=4, max_tokens=1)
    # three fit an idle queue
    assert len(client.completions.create(model=NAME, prompt="x", n=3, max_tokens=1).choices) == 3
    # a queue that others filled (the loop held before its next step, so they stay queued): 429 + Retry-After
    sched, release = llm.scheduler, threading.Event()
    step = sched.step
    sched.step = lambda: release.wait(60) and step()
    blockers = [sched.submit([5, 6], pj.SamplingParams(max_tokens=1)) for _ in range(3)]
    try:
        status, body, headers = post(server.url + "/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 1})
        assert status == 429 and body["error"]["code"] == "queue_full" and headers.get("Retry-After") == "1"
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=NAME, prompt="x", max_tokens=1)
        assert len(sched.waiting) == 3  # the refused request left nothing behind
    finally:
        release.set()
        del sched.step
        for handle in blockers:
            handle.result(timeout=60)
    assert client.completions.create(model=NAME, prompt="x", max_tokens=1).usage.completion_tokens == 1


def test_max_tokens_zero_with_echo_scores_the_prompt(llm, server, client):
    prompt = "def square(x):"
    ids = llm.tokenizer.encode(prompt)
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=3)
    choice = out.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(ids), 0)
    ref = reference_logprobs(llm, ids)
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], [ref[t - 1, ids[t]] for t in range(1, len(ids))],
                               atol=2e-4)
    for t in range(1, len(ids)):
        assert max(choice.logprobs.top_logprobs[t].values()) == pytest.approx(ref[t - 1].max(), abs=2e-4)
    # without logprobs: the prompt alone, streamed or not; without echo: still a 400
    assert client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True).choices[0].text == prompt
    chunks = list(client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == prompt and chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=NAME, prompt=prompt, max_tokens=0)
    assert info.value.param == "max_tokens"


def test_top_logprobs_keep_every_token_apart(llm, client):
    """Tokens that are pieces of a UTF-8 character all decode to U+FFFD: keyed by text, one would overwrite
    another. Named by their bytes (or ids) every top-k token keeps its own entry, and the chosen token's name is its
    key (what a harness's greedy check compares)."""
    ids = llm.tokenizer.encode(MULTIBYTE)
    ref = reference_logprobs(llm, ids)
    k = 5
    decoded = [[HF_TOKENIZER().decode([int(i)]) for i in np.argsort(-ref[t - 1])[:k]] for t in range(1, len(ids))]
    assert any(len(set(texts)) < k for texts in decoded), "the prompt no longer shows a collision: pick another"
    for as_ids in (False, True):
        out = client.completions.create(model=NAME, prompt=MULTIBYTE, max_tokens=0, echo=True, logprobs=k,
                                        extra_body={"return_tokens_as_token_ids": as_ids})
        lp = out.choices[0].logprobs
        for t in range(1, len(ids)):
            top_ids = [int(i) for i in np.argsort(-ref[t - 1])[:k]]
            wanted = set(top_ids) | {ids[t]}
            entry = lp.top_logprobs[t]
            assert len(entry) == len(wanted)  # nothing overwritten
            assert entry[lp.tokens[t]] == pytest.approx(ref[t - 1, ids[t]], abs=2e-4)
            for name, value in entry.items():
                token = identify(name, as_ids)
                assert token in wanted and value == pytest.approx(ref[t - 1, token], abs=2e-4)
        if as_ids:
            assert lp.tokens == [f"token_id:{i}" for i in ids]


def identify(name: str, as_ids: bool) -> int:
    """The token id a logprob name stands for, found through transformers' tokenizer (not the server's)."""
    if name.startswith("token_id:"):
        return int(name.removeprefix("token_id:"))
    assert not as_ids
    if name.startswith("bytes:"):
        return vocab_bytes()[bytes(int(h, 16) for h in name.removeprefix("bytes:").split("\\x")[1:])]
    ids = HF_TOKENIZER().encode(name, add_special_tokens=False)
    assert len(ids) == 1, name
    return ids[0]


@functools.cache
def vocab_bytes() -> dict[bytes, int]:
    return {token_bytes(i): i for i in range(len(HF_TOKENIZER()))}


def test_chat_logprob_bytes_are_the_tokens_own(llm, client):
    """chat logprobs' `bytes`: each token's bytes (transformers' byte table), which concatenate to the text."""
    messages = [{"role": "user", "content": MULTIBYTE}]
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0, logprobs=True,
                                         top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    ids = llm.chat(messages, pj.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)).token_ids
    assert [bytes(c.bytes) for c in content] == [token_bytes(i) for i in ids]
    text = HF_TOKENIZER().decode(ids, skip_special_tokens=False)
    assert b"".join(bytes(c.bytes) for c in content).decode("utf-8", "replace") == text
    for c in content:
        assert len({t.token for t in c.top_logprobs}) == len(c.top_logprobs)
