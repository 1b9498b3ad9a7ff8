"""The OpenAI-compatible server, driven by the official `openai` client over real HTTP on 127.0.0.1.

References are independent of the HTTP layer: the same request run alone through `LLM.generate` / `LLM.chat`, and
log-probabilities recomputed from `pj.logits` (a causal forward without the cache or the sampler).
"""
import dataclasses
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import jax
import numpy as np
import openai
import pytest

import pocketjax as pj
from pocketjax.serve.llm import DEFAULT_MODEL
from pocketjax.serve.http.server import BackgroundServer, create_app

pytestmark = [pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors").exists(), reason="no embedded model"),
              pytest.mark.leg1_only]  # HTTP / host-side: the same under any JAX
SLOTS, CONTEXT = 4, 128  # test_llm's engine shape, so a shared session reuses its compiled steps
NAME = "pocket-coder"


@pytest.fixture(scope="module")
def llm():
    with pj.LLM(max_batch_size=SLOTS, max_seq_len=CONTEXT, prefill_chunk=32) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(create_app(llm)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def post(url: str, data: bytes, headers: dict | None = None) -> tuple[int, bytes]:
    """A raw POST (for what the openai client cannot send: malformed JSON, reading the SSE bytes)."""
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def greedy(n: int = 8, **kw) -> pj.SamplingParams:
    return pj.SamplingParams(max_tokens=n, temperature=0.0, **kw)


def reference_logprobs(llm, tokens: list[int]) -> np.ndarray:
    """log_softmax of a plain causal forward over `tokens`: row t scores token t + 1."""
    return np.asarray(jax.nn.log_softmax(pj.logits(llm.model, [tokens])[0], axis=-1))


def test_models_health_and_completion_forms(llm, server, client):
    assert [m.id for m in client.models.list().data] == [NAME]
    status, body = post(server.url + "/health", None)  # GET: no body
    assert status == 200 and json.loads(body)["status"] == "ok"
    prompts = ["def add(a, b):", "import os"]
    alone = [llm.generate(p, greedy())[0] for p in prompts]
    out = client.completions.create(model=NAME, prompt=prompts[0], max_tokens=8, temperature=0)
    assert out.choices[0].text == alone[0].text and out.choices[0].finish_reason == alone[0].finish_reason
    prompt_len = len(llm.tokenizer.encode(prompts[0]))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_len, len(alone[0].token_ids))
    word = alone[0].text[2:4]  # a stop string inside the greedy text: the text ends before its first occurrence
    stop = client.completions.create(model=NAME, prompt=prompts[0], max_tokens=8, temperature=0, stop=[word])
    assert stop.choices[0].text == alone[0].text[:alone[0].text.index(word)]
    assert stop.choices[0].finish_reason == "stop"
    # a list of strings, token ids, and a list of token-id lists give the same texts
    ids = [llm.tokenizer.encode(p) for p in prompts]
    for form in (prompts, ids[0], ids):
        out = client.completions.create(model=NAME, prompt=form, max_tokens=8, temperature=0)
        expected = alone if isinstance(form[0], (str, list)) else alone[:1]
        assert [c.text for c in out.choices] == [a.text for a in expected]
        assert [c.index for c in out.choices] == list(range(len(expected)))


def test_n_choices_use_derived_seeds(llm, client):
    sampling = pj.SamplingParams(max_tokens=10, temperature=1.0, top_k=20, seed=7)
    alone = [llm.generate("class Stack:", dataclasses.replace(sampling, seed=7 + i))[0].text
             for i in range(3)]
    out = client.completions.create(model=NAME, prompt="class Stack:", max_tokens=10, temperature=1.0, seed=7, n=3,
                                    extra_body={"top_k": 20})
    assert [c.text for c in out.choices] == alone
    assert len(set(alone)) > 1  # the seeds really differ
    streamed = ["", "", ""]  # the choices' chunks interleave; each carries its index
    for chunk in client.completions.create(model=NAME, prompt="class Stack:", max_tokens=10, temperature=1.0, seed=7,
                                           n=3, stream=True, extra_body={"top_k": 20}):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert streamed == alone


def test_a_requests_prompts_and_choices_are_admitted_as_one_batch(llm, client, monkeypatch):
    """A request's n choices (or list of prompts) reach the queue together (`LLM.submit_many`): however slowly each is
    validated, the loop's first prefill holds all of them (submitted one at a time, the running loop prefilled the
    first alone while the next was being validated)."""
    sched, sizes = llm.scheduler, []
    prepared, prefill = sched._prepared, llm.engine.prefill_dispatch

    def slow_prepared(*args):
        time.sleep(0.2)  # the loop, already running, would admit what was queued so far
        return prepared(*args)

    def recorded_prefill(requests, **kwargs):
        sizes.append(len(requests))
        return prefill(requests, **kwargs)

    monkeypatch.setattr(sched, "_prepared", slow_prepared)
    monkeypatch.setattr(llm.engine, "prefill_dispatch", recorded_prefill)
    out = client.completions.create(model=NAME, prompt="class Stack:", max_tokens=4, temperature=1.0, seed=3, n=3)
    assert len(out.choices) == 3 and sizes[0] == 3, sizes
    sizes.clear()
    out = client.completions.create(model=NAME, prompt=["import os", "def f(x):"], max_tokens=4, temperature=0)
    assert len(out.choices) == 2 and sizes[0] == 2, sizes


def test_streaming_completion_and_chat(llm, server, client):
    full = client.completions.create(model=NAME, prompt="def fib(n):", max_tokens=12, temperature=0, logprobs=1)
    chunks = list(client.completions.create(model=NAME, prompt="def fib(n):", max_tokens=12, temperature=0,
                                            logprobs=1, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((lp.token_logprobs for lp in streamed), []) == full.choices[0].logprobs.token_logprobs
    assert sum((lp.text_offset for lp in streamed), []) == full.choices[0].logprobs.text_offset
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # the wire format: SSE events, the last one [DONE]
    status, raw = post(server.url + "/v1/completions", json.dumps(
        {"prompt": "def fib(n):", "max_tokens": 4, "temperature": 0, "stream": True}).encode())
    events = [line for line in raw.decode().split("\n\n") if line]
    assert status == 200 and all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"

    messages = [{"role": "user", "content": "Write a function that adds two numbers"}]
    alone = llm.chat(messages, greedy(12))
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    assert reply.choices[0].message.content == alone.text and reply.choices[0].message.role == "assistant"
    stream = list(client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0,
                                                 stream=True))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == alone.text
    assert stream[-1].choices[0].finish_reason == alone.finish_reason


def test_chat_logprobs_match_a_plain_forward(llm, client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Sort a list"}]}]
    reply = client.chat.completions.create(model=NAME, messages=messages, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=3)
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Sort a list"}], add_generation_prompt=True))
    alone = llm.generate(prompt, greedy(6))[0]
    content = reply.choices[0].logprobs.content
    assert [c.token for c in content] == [llm.tokenizer.decode([t], skip_special_tokens=False)
                                          for t in alone.token_ids]
    ref = reference_logprobs(llm, prompt + alone.token_ids)
    for k, (item, token) in enumerate(zip(content, alone.token_ids)):
        row = ref[len(prompt) - 1 + k]
        np.testing.assert_allclose(item.logprob, row[token], atol=2e-4)
        np.testing.assert_allclose([t.logprob for t in item.top_logprobs], np.sort(row)[::-1][:3], atol=2e-4)
        assert item.top_logprobs[0].token == item.token  # greedy: the chosen token is the most likely


def test_concurrent_clients_match_requests_run_alone(llm, client):
    """16 clients at once (4 slots: the rest queue) each get what the same request gets alone."""
    rng = np.random.default_rng(0)
    jobs = []
    for i in range(16):
        prompt = [int(t) for t in rng.integers(0, 4000, int(rng.integers(3, 14)))]
        kw = dict(max_tokens=int(rng.integers(4, 16)), temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
        jobs.append((prompt, kw))
    alone = [llm.generate(prompt, pj.SamplingParams(**kw))[0] for prompt, kw in jobs]

    def ask(job):
        prompt, kw = job
        out = client.completions.create(model=NAME, prompt=prompt, max_tokens=kw["max_tokens"],
                                        temperature=kw["temperature"], seed=kw["seed"], logprobs=0,
                                        extra_body={"ignore_eos": True})
        return out.choices[0]

    with ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(ask, jobs))
    for out, ref in zip(outs, alone):
        assert out.text == ref.text and len(out.logprobs.tokens) == len(ref.token_ids)
        # Batched and alone run different product shapes (batch and length buckets), so float32 logits of
        # magnitude ~20 differ by a few ulps: 1.1e-5 measured once on a fresh clone. Tokens must match exactly.
        np.testing.assert_allclose(out.logprobs.token_logprobs, [lp for lp, _ in ref.logprobs], atol=1e-4)
    assert llm.engine.num_free_slots == SLOTS


def wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_dropped_clients_free_their_slots(llm, server, client):
    """A client that leaves mid-stream (or before a non-streamed answer) cancels its request: its slot comes back
    long before max_tokens would have been reached. Each engine step is slowed to 20 ms so that takes seconds."""
    sched = llm.scheduler
    step, submit_many, handles = sched.step, sched.submit_many, []

    def slow_step():
        time.sleep(0.02)
        return step()

    def recorded_submit_many(*args, **kwargs):
        queued = submit_many(*args, **kwargs)
        handles.extend(queued)
        return queued

    sched.step, sched.submit_many = slow_step, recorded_submit_many
    try:
        for stream in (True, False):
            body = {"model": NAME, "prompt": "def main():", "max_tokens": 100, "temperature": 0, "ignore_eos": True}
            if stream:
                response = client.completions.create(**{k: v for k, v in body.items() if k != "ignore_eos"},
                                                     stream=True, extra_body={"ignore_eos": True})
                next(iter(response))  # the request is running: its first token arrived
                response.close()
            else:
                request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps(body).encode(),
                                                 headers={"Content-Type": "application/json"})
                with pytest.raises(OSError):  # the client gives up waiting (a socket timeout) and hangs up
                    urllib.request.urlopen(request, timeout=1.0)
            completion = handles[-1].result(timeout=30)
            assert completion.finish_reason == "cancelled" and len(completion.token_ids) < 100
            assert wait_until(lambda: llm.engine.num_free_slots == SLOTS)
    finally:
        del sched.step, sched.submit_many
    assert len(handles) == 2
    assert client.completions.create(model=NAME, prompt="x = ", max_tokens=2).choices[0].finish_reason == "length"


@pytest.mark.parametrize("body, param", [
    ({"prompt": "x", "temperature": "hot"}, "temperature"),  # wrong type: never coerced
    ({"prompt": "x", "top_p": 1.5}, None),  # out of range: SamplingParams.validate names it
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "logprobs": 50}, None),
    ({"prompt": {"text": "x"}}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [5, 4096]}, None),  # a token id outside the vocabulary
    ({"prompt": list(range(1, CONTEXT + 2))}, "prompt"),  # longer than the context
    ({"prompt": "x", "max_tokens": CONTEXT}, "max_tokens"),  # prompt + max_tokens past the context
    ({"prompt": "x", "logit_bias": {"5": 1000}}, None),  # out of OpenAI's [-100, 100]: SamplingParams names it
    ({"prompt": "x", "frobnicate": 1}, "frobnicate"),  # a field no endpoint knows: refused by name
    ({"messages": []}, "messages"),
    ({"messages": [{"content": "no role"}]}, "messages"),  # typed messages: the role names the message's type
])
def test_bad_input_gets_400_and_the_server_keeps_serving(server, client, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    status, raw = post(server.url + path, json.dumps({"model": NAME, **body}).encode())
    error = json.loads(raw)["error"]
    assert status == 400, error
    assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param
    assert client.completions.create(model=NAME, prompt="y = ", max_tokens=2).choices[0].text is not None


def test_malformed_json_unknown_model_full_queue(llm, server, client):
    status, raw = post(server.url + "/v1/completions", b'{"prompt": "x", "max_tokens": ')
    assert status == 400 and "JSON" in json.loads(raw)["error"]["message"]
    with pytest.raises(openai.NotFoundError) as info:  # 404 model_not_found, as OpenAI answers
        client.completions.create(model="gpt-4", prompt="x")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:  # the official client's view of a 400
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], top_p=0)
    assert "top_p" in info.value.message
    limit, llm.scheduler.max_waiting = llm.scheduler.max_waiting, 1  # a queue of one
    try:
        with pytest.raises(openai.BadRequestError) as info:  # 2 choices can never fit: 400, not a 429 to retry
            client.completions.create(model=NAME, prompt="x", n=2)
        assert info.value.code == "exceeds_max_waiting"  # a full queue's 429: tests/test_openai_protocol.py
    finally:
        llm.scheduler.max_waiting = limit
    assert not llm.scheduler.waiting and llm.engine.num_free_slots == SLOTS
    assert client.completions.create(model=NAME, prompt="x", max_tokens=2).usage.completion_tokens == 2


def test_api_key(llm):
    with BackgroundServer(create_app(llm, api_key="sesame")) as server:
        for key, ok in (("wrong", False), ("sesame", True)):
            c = openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=60)
            if ok:
                assert c.models.list().data[0].id == NAME
            else:
                with pytest.raises(openai.AuthenticationError):
                    c.models.list()
        assert post(server.url + "/health", None)[0] == 200  # health needs no key


def test_cli_serve_flags(monkeypatch):
    from pocketjax.serve import cli
    from pocketjax.serve.http import server

    seen = {}
    monkeypatch.setattr(server, "serve", lambda llm, host, port, **kw: seen.update(
        host=host, port=port, slots=llm.engine.num_slots, **kw))
    monkeypatch.setenv("POCKETJAX_API_KEY", "from-env")
    assert cli.main(["serve", "--port", "9123", "--max-batch-size", "2", "--max-seq-len", "64", "--no-warmup"]) == 0
    assert seen["host"] == "127.0.0.1" and seen["port"] == 9123 and seen["slots"] == 2
    assert seen["api_key"] == "from-env" and seen["model_name"] == NAME


def test_echo_logprobs_match_a_plain_forward(llm, client):
    """echo=True + logprobs: every prompt token's logprob (the first has none) and the generated ones."""
    prompt = "def square(x):"
    ids = llm.tokenizer.encode(prompt)
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=2)
    choice = out.choices[0]
    generated = llm.generate(prompt, greedy(3))[0].token_ids
    tokens = ids + generated
    assert choice.text == prompt + llm.tokenizer.decode(generated)
    assert choice.logprobs.tokens == [llm.tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    ref = reference_logprobs(llm, tokens)
    expected = [ref[t - 1, tokens[t]] for t in range(1, len(tokens))]
    np.testing.assert_allclose(choice.logprobs.token_logprobs[1:], expected, atol=2e-4)
    for t in range(1, len(tokens)):
        top = choice.logprobs.top_logprobs[t]
        assert top[choice.logprobs.tokens[t]] == pytest.approx(expected[t - 1], abs=2e-4)
        assert max(top.values()) == pytest.approx(ref[t - 1].max(), abs=2e-4)  # the top-2 are listed


def test_bench_serve_client_counts_every_token(server):
    """benchmarks/bench_serve.py's HTTP client: chunks carry usage so far (continuous_usage_stats), so its traces
    hold one arrival time per generated token."""
    import asyncio

    from benchmarks.bench_serve import Item, http_stream

    items = [Item(0.0, [5, 6, 7], 5), Item(0.01, [9, 10], 3)]
    traces, failed = asyncio.run(http_stream(server.url, items))
    assert failed == 0 and [len(t.token_times) for t in traces] == [5, 3]
    assert all(t.token_times[0] >= t.submitted for t in traces)


def get(url: str) -> tuple[int, dict, bytes]:
    """A raw GET: status, headers, body (errors included)."""
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_a_warming_server_listens_reports_progress_and_refuses_generation(llm):
    """Issue 67: `serve` listens at once; until warm-up is done /health is 503 with its progress, the generation
    routes are 503 with Retry-After (in their API's error shape), the others answer; then /health is 200 and the
    routes serve."""
    from pocketjax.serve.http.readiness import RETRY_AFTER_S, Readiness

    release = threading.Event()

    def warm(progress):  # stands for engine.warmup: 1 of 3 shapes compiled, then waits to be released
        progress(1, 3)
        assert release.wait(60)
        progress(3, 3)

    readiness = Readiness()
    started = llm.started  # (the module's LLM may have served earlier tests)
    with BackgroundServer(create_app(llm, readiness=readiness)) as server:
        readiness.start(warm)
        assert wait_until(lambda: readiness.done == 1)
        status, _, body = get(server.url + "/health")
        assert status == 503 and json.loads(body)["status"] == "warming"
        assert json.loads(body)["progress"] == {"done": 1, "total": 3}
        for path, body_ in (("/v1/completions", {"model": NAME, "prompt": "x", "max_tokens": 2}),
                            ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "x"}]}),
                            ("/v1/responses", {"model": NAME, "input": "x"}),
                            ("/v1/messages", {"model": NAME, "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "x"}]})):
            request = urllib.request.Request(server.url + path, data=json.dumps(body_).encode(),
                                             headers={"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=60)
            error = json.loads(refused.value.read())
            assert refused.value.code == 503 and refused.value.headers["Retry-After"] == str(RETRY_AFTER_S), path
            assert "warming up" in (error["error"]["message"]), path
            assert (error.get("type") == "error") == (path == "/v1/messages"), path  # Anthropic's shape there
        assert get(server.url + "/v1/models")[0] == 200  # no engine step: served while warming
        assert post(server.url + "/tokenize", json.dumps({"model": NAME, "prompt": "def f"}).encode())[0] == 200
        assert llm.started is started  # nothing started the engine's loop beside the warm-up
        release.set()
        assert wait_until(lambda: get(server.url + "/health")[0] == 200)
        assert json.loads(get(server.url + "/health")[2])["status"] == "ok"
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        assert c.completions.create(model=NAME, prompt="def f(x):", max_tokens=2, temperature=0).choices[0].text


def test_a_failed_warmup_keeps_health_at_503(llm):
    from pocketjax.serve.http.readiness import Readiness

    def warm(progress):
        raise RuntimeError("out of memory compiling prefill")

    readiness = Readiness()
    with BackgroundServer(create_app(llm, readiness=readiness)) as server:
        readiness.start(warm).join(30)
        status, _, body = get(server.url + "/health")
        assert status == 503 and json.loads(body)["status"] == "failed" and "out of memory" in json.loads(body)["error"]
        assert post(server.url + "/v1/completions", json.dumps({"model": NAME, "prompt": "x"}).encode())[0] == 503


def test_cli_serve_warms_up_while_listening(monkeypatch):
    """The default `pocketjax serve` builds the LLM without warming it up and hands the warm-up to `serve`, which
    runs it beside the listening server (before issue 67 the LLM warmed up first and only then listened)."""
    from pocketjax.engine.engine import Engine
    from pocketjax.serve import cli
    from pocketjax.serve.http import server

    events = []
    monkeypatch.setattr(Engine, "warmup", lambda self, *a, **kw: events.append("warmup") or 0)
    monkeypatch.setattr(server, "serve", lambda llm, host, port, **kw: events.append(("serve", kw["warmup"])))
    assert cli.main(["serve", "--max-batch-size", "2", "--max-seq-len", "64"]) == 0
    assert events == [("serve", True)]
    events.clear()
    assert cli.main(["serve", "--no-warmup", "--max-batch-size", "2", "--max-seq-len", "64"]) == 0
    assert events == [("serve", False)]


def test_readiness_reports_the_engines_warmup_call_by_call(llm, monkeypatch):
    """Engine.warmup's progress_callback after each of its calls, as `serve`'s Readiness reads it (the step calls are
    recorded, not run: compiling every shape is tests/test_warmup.py's, and minutes on 2 busy cores)."""
    from pocketjax.engine.plan import signatures
    from pocketjax.serve.http.readiness import Readiness

    readiness, seen = Readiness(), []
    monkeypatch.setattr(llm.engine.device, "run", lambda step, *args: seen.append(("ran", step)))

    def warm(progress):
        def record(done, total):
            seen.append((done, total, readiness.status))
            progress(done, total)
        llm.engine.warmup(progress=False, progress_callback=record)

    readiness.start(warm).join(60)
    total = len(signatures(llm.engine.rules)) + 2  # the first forward and sampler calls run twice
    reports = [entry for entry in seen if entry[0] != "ran"]
    assert [(d, t) for d, t, _ in reports] == [(d, total) for d in range(1, total + 1)]
    assert [entry[0] for entry in seen] == ["ran", 1] + [x for d in range(2, total + 1) for x in ("ran", d)]
    assert {s for _, _, s in reports} == {"warming"} and readiness.ready and readiness.error is None
    assert readiness.health()["progress"] == {"done": total, "total": total}


def test_a_stopped_warmup_ends_after_its_current_shape():
    """`serve` interrupted while warming up stops the warm-up between shapes and waits for it, so the process exits
    cleanly (a process exiting while XLA compiles on another thread aborts in C++)."""
    from pocketjax.serve.http.readiness import Readiness

    readiness, compiled = Readiness(), []

    def warm(progress):  # stands for engine.warmup over 1,000 shapes of 10 ms each
        for done in range(1, 1001):
            time.sleep(0.01)
            compiled.append(done)
            progress(done, 1000)

    thread = readiness.start(warm)
    assert wait_until(lambda: readiness.done >= 3)
    readiness.stop(timeout=30)
    assert not thread.is_alive() and len(compiled) < 1000 and compiled[-1] == readiness.done
    assert readiness.status == "failed" and "shutting down" in readiness.health()["error"]
