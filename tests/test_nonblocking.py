"""Preparing one request never stalls the others: a constraint that takes long to compile (llguidance at Qwen's
vocabulary: ~2 s for a large schema) is compiled on the server's host pool, outside the scheduler's lock, while
every other stream keeps receiving tokens and /health keeps answering.

The slow compile is made deterministic: it blocks on an event the test releases only after another client's
stream has received more tokens, so a server that compiled on its event loop or under the scheduler lock would
deliver none (and the test would fail at its read timeout), whatever the machine's speed."""
from __future__ import annotations

import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

import pocketjax as pj
from conftest import served

SLOW_REGEX = "[a-z]{3}"  # the constraint whose compile is held


@pytest.fixture(scope="module")
def llm():
    with pj.LLM(max_batch_size=4, max_seq_len=256, prefill_chunk=32) as llm:
        yield llm


@pytest.mark.parametrize("endpoint", ["chat", "responses"])
def test_a_slow_constraint_compile_stalls_no_other_stream(llm, monkeypatch, endpoint):
    constrainer = llm.engine.constrainer
    compile_now = constrainer.compile
    entered, release = threading.Event(), threading.Event()

    def slow_compile(structured):
        if SLOW_REGEX in structured.grammar_text() and not release.is_set():
            entered.set()
            assert release.wait(120), "the test never released the compile"
        return compile_now(structured)

    monkeypatch.setattr(constrainer, "compile", slow_compile)
    with served(llm) as (server, client), ThreadPoolExecutor(1) as pool:
        client = client.with_options(timeout=30)
        stream = iter(client.chat.completions.create(
            model="pocket-coder", messages=[{"role": "user", "content": "count"}], max_tokens=64,
            temperature=0, stream=True, extra_body={"ignore_eos": True}))
        next(stream)  # the role chunk: the request runs
        if endpoint == "chat":
            slow = pool.submit(client.chat.completions.create, model="pocket-coder",
                               messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                               extra_body={"structured_outputs": {"regex": SLOW_REGEX}})
        else:
            slow = pool.submit(client.responses.create, model="pocket-coder", input="hi", max_output_tokens=4,
                               text={"format": {"type": "json_schema", "name": "x", "strict": True, "schema": {
                                   "type": "object", "properties": {"w": {"type": "string", "pattern": SLOW_REGEX}},
                                   "required": ["w"], "additionalProperties": False}}})
        try:
            assert entered.wait(60), "the constrained request never reached its compile"
            received = [next(stream) for _ in range(8)]  # while the compile is held
            with urllib.request.urlopen(server.url + "/health", timeout=10) as answer:
                assert answer.status == 200
            held = not slow.done()
        finally:
            release.set()
        assert held and len(received) == 8
        assert slow.result(timeout=60) is not None  # and the held request is served once its compile ends
        rest = list(stream)
        assert rest[-1].choices[0].finish_reason == "length"
