"""GET /metrics scraped while requests run and after: gauges, token counters, histograms, HTTP statuses, all
checked against what the client observed (the token ids it sent, the tokens and finish reasons it received, the
HTTP statuses it got), parsed with prometheus-client's own text parser."""
import collections
import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import pocketjax as pj
from pocketjax.serve.llm import DEFAULT_MODEL
from pocketjax.serve.http.server import BackgroundServer, create_app

pytestmark = [pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors").exists(), reason="no embedded model"),
              pytest.mark.leg1_only]  # HTTP / host-side: the same under any JAX
SLOTS, CONTEXT = 4, 128  # test_server's engine shape: a shared session reuses its compiled steps
NAME = "pocket-coder"


@pytest.fixture(scope="module")
def llm():
    with pj.LLM(max_batch_size=SLOTS, max_seq_len=CONTEXT, prefill_chunk=32) as llm:
        yield llm


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels without model_name/engine): value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine")))
            if "model_name" in sample.labels:
                assert sample.labels["model_name"] == NAME
            out[sample.name, labels] = sample.value
    return out


def wait_until(condition, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_metrics_count_what_was_sent(llm):
    """Six streamed requests on four slots, each engine step slowed to 30 ms: the scrape sees four running and two
    waiting; afterwards the counters equal what the client sent (prompts of token ids, 4-14 long) and received
    (tokens counted by their streamed logprobs, each choice's finish reason)."""
    sched = llm.scheduler
    step = sched.step

    def slow_step():
        time.sleep(0.03)
        return step()

    with BackgroundServer(create_app(llm)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        prompts = [[100 + i] + list(range(200, 203 + 2 * i)) for i in range(6)]  # 4, 6, ..., 14 tokens
        usages, received, reasons, errors = [], [], [], []

        def run(prompt):
            try:
                stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0,
                                                   logprobs=1, stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True})
                chunks = list(stream)
                received.append(sum(len(c.choices[0].logprobs.token_logprobs) for c in chunks
                                    if c.choices and c.choices[0].logprobs))  # one entry per token
                reasons.extend(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
                usages.append(chunks[-1].usage)
            except Exception as error:  # noqa: BLE001 - reported below
                errors.append(error)

        sched.step = slow_step
        try:
            threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
            for t in threads:
                t.start()
            live = {}
            assert wait_until(lambda: live.update(scrape(server.url)) or
                              live[("vllm:num_requests_running", ())] == SLOTS and
                              live[("vllm:num_requests_waiting", ())] == 2)
            assert live[("pocketjax:slots_used", ())] == SLOTS and live[("vllm:kv_cache_usage_perc", ())] == 1.0
            for t in threads:
                t.join(120)
        finally:
            del sched.step
        assert not errors and len(received) == 6
        # one refused request, counted by status
        request = urllib.request.Request(server.url + "/v1/completions", data=json.dumps({"prompt": []}).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(request, timeout=30)
        with pytest.raises(urllib.error.HTTPError):  # a probe of a random path: one "other" series, not one per path
            urllib.request.urlopen(server.url + "/no/such/path/123", timeout=30)
        assert wait_until(lambda: llm.engine.num_free_slots == SLOTS)
        done = scrape(server.url)
    assert done[("vllm:num_requests_running", ())] == 0 and done[("vllm:num_requests_waiting", ())] == 0
    sent = sum(map(len, prompts))
    assert done[("vllm:prompt_tokens_total", ())] == sent == sum(u.prompt_tokens for u in usages)
    assert done[("vllm:generation_tokens_total", ())] == sum(received) == 6 * 40
    assert done[("vllm:prefix_cache_queries_total", ())] == sent
    assert 0 <= done[("vllm:prefix_cache_hits_total", ())] < sent
    observed = collections.Counter(reasons)  # the client's view, mapped to vLLM's labels as the docstring says
    assert observed == {"length": 6}
    for reason in ("stop", "length", "abort", "error"):
        assert done[("vllm:request_success_total", (("finished_reason", reason),))] == observed[reason], reason
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert done[(name + "_count", ())] == len(prompts), name
    assert done[("vllm:request_prompt_tokens_sum", ())] == sent
    assert done[("vllm:request_generation_tokens_sum", ())] == sum(received)
    assert 6 <= done[("vllm:inter_token_latency_seconds_count", ())] <= 6 * 39  # a sample per later delivery
    # slowed steps: every inter-token gap is at least one 30 ms step, so their mean is too
    assert done[("vllm:inter_token_latency_seconds_sum", ())] / done[("vllm:inter_token_latency_seconds_count", ())] \
        >= 0.03
    # the e2e histogram's cumulative buckets: all six below +Inf
    assert done[("vllm:e2e_request_latency_seconds_bucket", (("le", "+Inf"),))] == 6
    http = {labels: v for (name, labels), v in done.items() if name == "http_requests_total"}
    assert http[(("handler", "/v1/completions"), ("method", "POST"), ("status", "200"))] == 6
    assert http[(("handler", "/v1/completions"), ("method", "POST"), ("status", "400"))] == 1
    assert http[(("handler", "other"), ("method", "GET"), ("status", "404"))] == 1


def test_prefix_cache_hits_follow_the_prompts_sent(llm):
    """Three prompts of token ids, one after another: A (20 tokens), A again, then B (A's first 12 and 8 others). A
    freed slot keeps its tokens, and a prompt's last token always runs (it yields the first token's logits), so the
    cache holds none of the first A (no slot starts with its first token), 19 tokens of the second, 12 of B: each
    request adds exactly that to the hits and its length to the queries, scraped after each."""
    a = list(range(3000, 3020))  # the other prompts in this file start with tokens 100-105
    b = a[:12] + list(range(3100, 3108))
    with BackgroundServer(create_app(llm)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        before = scrape(server.url)
        hits, queries = [], []
        for prompt in (a, a, b):
            client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
            after = scrape(server.url)
            hits.append(after[("vllm:prefix_cache_hits_total", ())] - before[("vllm:prefix_cache_hits_total", ())])
            queries.append(after[("vllm:prefix_cache_queries_total", ())] -
                           before[("vllm:prefix_cache_queries_total", ())])
            before = after
    assert hits == [0, len(a) - 1, 12]
    assert queries == [len(a), len(a), len(b)]


def test_an_observer_attached_late_misses_nothing():
    """RequestHandle.observe replays what already happened (tokens pushed, the end) and then reports each push once;
    an end after the end is not reported twice."""
    from pocketjax.engine.request import BatchedRequest
    from pocketjax.serve.handle import RequestHandle

    seen = []

    class Recorder:
        def delivered(self, handle, count):
            seen.append(("delivered", count))

        def ended(self, handle, reason):
            seen.append(("ended", reason))

    handle = RequestHandle(BatchedRequest("r", [1, 2, 3], pj.SamplingParams(max_tokens=8)))
    handle.push([5, 6])
    handle.observe(Recorder())
    handle.push([7])
    handle.push([])
    handle.finish("length")
    handle.finish("length")
    assert seen == [("delivered", 2), ("delivered", 1), ("ended", "length")]
    late = RequestHandle(BatchedRequest("s", [1], pj.SamplingParams(max_tokens=8)))
    late.fail(RuntimeError("boom"))
    seen.clear()
    late.observe(Recorder())
    assert seen == [("ended", None)]
