"""GET /metrics scraped while requests run and after: gauges, token counters, histograms, HTTP statuses, all
checked against what the test sent and what the server answered (usage), parsed with prometheus-client's own
text parser."""
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
from pocketjax.serve.server import BackgroundServer, create_app

pytestmark = pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors").exists(), reason="no embedded model")
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
    waiting; afterwards the counters equal the usage the server reported."""
    sched = llm.scheduler
    step = sched.step

    def slow_step():
        time.sleep(0.03)
        return step()

    with BackgroundServer(create_app(llm)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        prompts = [f"def f{i}(x):" for i in range(6)]
        usages, errors = [], []

        def run(prompt):
            try:
                stream = client.completions.create(model=NAME, prompt=prompt, max_tokens=40, temperature=0,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True})
                usages.append([c for c in stream if c.usage is not None][-1].usage)
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
        assert not errors and len(usages) == 6
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
    assert done[("vllm:prompt_tokens_total", ())] == sum(u.prompt_tokens for u in usages)
    assert done[("vllm:generation_tokens_total", ())] == sum(u.completion_tokens for u in usages) == 6 * 40
    assert done[("vllm:prefix_cache_queries_total", ())] == sum(u.prompt_tokens for u in usages)
    assert 0 <= done[("vllm:prefix_cache_hits_total", ())] < done[("vllm:prefix_cache_queries_total", ())]
    assert done[("vllm:request_success_total", (("finished_reason", "length"),))] == 6
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
        assert done[(name + "_count", ())] == 6, name
    assert done[("vllm:request_generation_tokens_sum", ())] == 6 * 40
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


def test_prefix_cache_hits_are_the_engines(llm):
    """The same prompt twice in a row: the second finds its prefix cached, and the counter adds exactly what the
    engine reported for it (the handle's cached_prefix_len)."""
    handles, submit = [], llm.scheduler.submit

    def recorded(*args, **kwargs):
        handles.append(submit(*args, **kwargs))
        return handles[-1]

    llm.scheduler.submit = recorded
    try:
        with BackgroundServer(create_app(llm)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            prompt = "import numpy as np\nimport jax\n\ndef main():"
            for _ in range(2):
                client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
            done = scrape(server.url)
    finally:
        del llm.scheduler.submit
    assert handles[1].cached_prefix_len > 0
    assert done[("vllm:prefix_cache_hits_total", ())] == sum(h.cached_prefix_len for h in handles)


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
