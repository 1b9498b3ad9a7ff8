"""GET /metrics: what an operator watches, in Prometheus's text format (prometheus-client), under vLLM's names.

vLLM's metric names and labels (`model_name`, `engine`) are used wherever pocketjax has the same quantity, so
vLLM's published Grafana dashboards and alerts work unchanged:

  vllm:num_requests_running / vllm:num_requests_waiting      gauges, read from the scheduler at scrape time
  vllm:kv_cache_usage_perc                                   slots in use / slots (a slot reserves a whole KV row)
  vllm:prompt_tokens_total / vllm:generation_tokens_total    counters
  vllm:prefix_cache_queries_total / vllm:prefix_cache_hits_total   prompt tokens looked up / found cached
  vllm:request_success_total{finished_reason}                stop | length | abort (cancelled) | error
  vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds, vllm:e2e_request_latency_seconds,
  vllm:request_queue_time_seconds (queued to admitted into a slot), vllm:request_prefill_time_seconds (admitted to
  first token), vllm:request_decode_time_seconds (first token to last), vllm:request_prompt_tokens,
  vllm:request_generation_tokens, vllm:request_max_num_generation_tokens (the most tokens any of one prompt's n
  choices generated)                                         histograms
  pocketjax:slots_used / pocketjax:slots_total               gauges
  vllm:spec_decode_num_drafts_total, _num_draft_tokens_total, _num_accepted_tokens_total   speculative decoding
  http_requests_total{method, handler, status}               every HTTP answer by route (as the client called it,
                                                             e.g. /v1/responses) and exact status code; methods
                                                             outside HTTP's own are one "other" label

Times are taken where the server's handles receive tokens (the scheduler thread's delivery), from the moment a
request is queued: what a client sees, less the HTTP hop. Inter-token latency is one sample per delivery of a
request (as vLLM samples once per engine iteration). Each app has its own registry, so several servers in one
process (tests) never share counts.
"""
from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from ..handle import RequestHandle
    from ..llm import LLM

# vLLM's bucket edges, so its dashboards' quantile panels read the same resolution
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", None: "error"}  # ours -> vLLM's
# the http_requests_total method labels: a client sending made-up methods must not grow the label set
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "CONNECT", "TRACE"})


def token_buckets(max_len: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `max_len` (vLLM's request-size buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_len:
                return out
            out.append(float(m * scale))
        scale *= 10


def prompt_groups(handles: list[RequestHandle]) -> list[list[RequestHandle]]:
    """A request's handles by prompt: consecutive handles with the same prompt ids are one prompt's n choices (as
    the servers submit them)."""
    groups: list[list[RequestHandle]] = []
    for handle in handles:
        if groups and list(groups[-1][0].request.prompt_tokens) == list(handle.request.prompt_tokens):
            groups[-1].append(handle)
        else:
            groups.append([handle])
    return groups


@dataclass
class Timing:
    """One request's clock: when it was queued, when its first and latest tokens arrived, how many."""

    queued: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0
    choices: Choices | None = None


@dataclass
class Choices:
    """The n choices of one prompt (vLLM's parent request): how many are still running, the most tokens one made."""

    left: int
    most: int = 0


class RequestMetrics:
    """The counters and histograms of one server, fed by its request handles (`watch` after each submit)."""

    def __init__(self, llm: LLM, model_name: str):
        self.registry = CollectorRegistry()
        self.llm = llm
        names, values = ["model_name", "engine"], [model_name, "0"]
        self._labels = dict(zip(names, values))

        def counter(name: str, doc: str, extra: Iterable[str] = ()) -> Counter:
            return Counter(name, doc, [*names, *extra], registry=self.registry)

        def histogram(name: str, doc: str, buckets: Iterable[float]) -> Any:
            return Histogram(name, doc, names, buckets=tuple(buckets), registry=self.registry).labels(*values)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens prefilled.").labels(*values)
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.").labels(*values)
        self.cache_queries = counter("vllm:prefix_cache_queries",
                                     "Prompt tokens looked up in the prefix cache.").labels(*values)
        self.cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.").labels(*values)
        self.success = counter("vllm:request_success", "Requests ended, by finish reason.", ["finished_reason"])
        for reason in REASONS.values():  # every series exists from the start, at 0
            self.success.labels(*values, reason)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Queued to first token.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Between a request's token deliveries.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Queued to ended.", LATENCY_BUCKETS)
        self.queue_time = histogram("vllm:request_queue_time_seconds", "Queued to admitted into a slot.",
                                    LATENCY_BUCKETS)
        self.prefill_time = histogram("vllm:request_prefill_time_seconds", "Admitted to first token.",
                                      LATENCY_BUCKETS)
        self.decode_time = histogram("vllm:request_decode_time_seconds", "First token to last.", LATENCY_BUCKETS)
        sizes = token_buckets(llm.engine.max_seq_len)
        self.request_prompt = histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", sizes)
        self.request_generation = histogram("vllm:request_generation_tokens", "Generated tokens per request.", sizes)
        self.max_generation = histogram("vllm:request_max_num_generation_tokens",
                                        "Most tokens generated by one of a prompt's n choices.", sizes)
        self.http = Counter("http_requests_total", "HTTP answers by route and status.", ["method", "handler", "status"],
                            registry=self.registry)
        self.registry.register(SchedulerGauges(llm, names, values))
        self._lock = threading.Lock()
        self._live: dict[RequestHandle, Timing] = {}

    def watch(self, handle: RequestHandle, choices: Choices | None = None) -> None:
        """Follow a just-submitted request (the handle reports what already happened, then each delivery);
        `choices`: the group of one prompt's n choices it belongs to (None: a group of its own)."""
        with self._lock:
            self._live[handle] = Timing(handle.queued_at, choices=choices or Choices(1))
        handle.observe(self)

    def watch_all(self, handles: list[RequestHandle]) -> None:
        """Follow a request's handles, one `Choices` group per prompt (`prompt_groups`)."""
        for group in prompt_groups(handles):
            choices = Choices(len(group))
            for handle in group:
                self.watch(handle, choices)

    def delivered(self, handle: RequestHandle, count: int) -> None:
        now = time.perf_counter()
        with self._lock:
            timing = self._live.get(handle)
            if timing is None:
                return
            previous, timing.last, timing.tokens = timing.last, now, timing.tokens + count
            if previous is None:
                timing.first = now
        if previous is None:  # the prompt was prefilled: its tokens and what the prefix cache held of them
            prompt = len(handle.request.prompt_tokens)
            self.prompt_tokens.inc(prompt)
            self.cache_queries.inc(prompt)
            self.cache_hits.inc(handle.cached_prefix_len)
            self.ttft.observe(now - timing.queued)
        else:
            self.itl.observe(now - previous)
        self.generation_tokens.inc(count)

    def ended(self, handle: RequestHandle, reason: str | None) -> None:
        now = time.perf_counter()
        with self._lock:
            timing = self._live.pop(handle, None)
        if timing is None:
            return
        self.success.labels(**self._labels, finished_reason=REASONS.get(reason, "error")).inc()
        self.e2e.observe(now - timing.queued)
        self.request_generation.observe(timing.tokens)
        admitted = handle.admitted_at
        if admitted is not None:
            self.queue_time.observe(max(admitted - timing.queued, 0.0))
        if timing.first is not None:
            self.request_prompt.observe(len(handle.request.prompt_tokens))
            self.prefill_time.observe(max(timing.first - (timing.queued if admitted is None else admitted), 0.0))
            self.decode_time.observe(timing.last - timing.first)
        group = timing.choices
        with self._lock:
            group.left, group.most = group.left - 1, max(group.most, timing.tokens)
            last = group.left == 0
        if last:
            self.max_generation.observe(group.most)

    def scrape(self) -> bytes:
        return generate_latest(self.registry)


class SchedulerGauges:
    """Gauges read at scrape time: running and waiting requests, slots in use (a custom collector, so nothing is
    updated per step)."""

    def __init__(self, llm: LLM, names: list[str], values: list[str]):
        self.llm, self.names, self.values = llm, names, values

    def collect(self) -> Iterable[Metric]:
        sched, engine = self.llm.scheduler, self.llm.engine
        used, total = engine.num_slots - engine.num_free_slots, engine.num_slots
        for name, doc, value in (
                ("vllm:num_requests_running", "Requests holding a slot.", len(sched.running)),
                ("vllm:num_requests_waiting", "Requests queued for a slot.", len(sched.waiting)),
                ("vllm:kv_cache_usage_perc", "Fraction of the KV cache's slots in use.", used / total),
                ("pocketjax:slots_used", "Engine slots in use.", used),
                ("pocketjax:slots_total", "Engine slots.", total)):
            gauge = GaugeMetricFamily(name, doc, labels=self.names)
            gauge.add_metric(self.values, value)
            yield gauge
        spec = engine.speculator
        if spec is not None:  # speculative decoding, under vLLM's names (counters over the engine's life)
            for name, doc, value in (
                    ("vllm:spec_decode_num_drafts", "Drafts verified.", sum(spec.histogram.values())),
                    ("vllm:spec_decode_num_draft_tokens", "Draft tokens verified.", spec.total_proposed),
                    ("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", spec.total_accepted)):
                counter = CounterMetricFamily(name, doc, labels=self.names)
                counter.add_metric(self.values, value)
                yield counter


def metrics_router(metrics: RequestMetrics) -> APIRouter:
    router = APIRouter()

    prometheus = {200: {"description": "Prometheus' text format (vLLM's series)",
                        "content": {CONTENT_TYPE_LATEST: {"schema": {"type": "string"}}}}}

    @router.get("/metrics", response_class=Response, responses=prometheus)
    async def scrape() -> Response:
        return Response(metrics.scrape(), media_type=CONTENT_TYPE_LATEST)

    @router.head("/metrics", response_class=Response, responses=prometheus)
    async def probe() -> Response:
        """200 and no body (a probe that asks whether the endpoint is up, without the cost of a scrape)."""
        return Response(media_type=CONTENT_TYPE_LATEST)

    return router


def route_label(scope: dict) -> str:
    """The matched route's path template as the client called it ("/v1/responses", "/v1/models/{model}"); "other"
    when nothing matched, so probes of random URLs cannot grow the label set. FastAPI leaves the route object in the
    scope, but an included router's route carries its path without the router's prefix; the prefix is what the
    path holds before the part the route matched."""
    route = scope.get("route")
    template, pattern = getattr(route, "path", None), getattr(route, "path_regex", None)
    if not template or pattern is None:
        return "other"
    path = scope.get("path", "")
    match = re.search(pattern.pattern.removeprefix("^"), path)
    return path[:match.start()] + template if match else template


def method_label(scope: dict) -> str:
    method = scope.get("method", "")
    return method if method in METHODS else "other"


class HTTPCounter:
    """ASGI middleware counting every answer by method, route and status (`method_label`, `route_label`: both from
    closed sets). Plain ASGI: it passes `receive` through untouched, so a streaming response still hears its client
    disconnect."""

    def __init__(self, app: Any, metrics: RequestMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500

        async def sending(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            self.metrics.http.labels(method_label(scope), route_label(scope), str(status)).inc()
