"""What an operator runs and watches: `serve` warms up before it listens, GET /v1/models/{id} with the official
client, usage's cached_tokens against the prefix cache's rule and /metrics, vLLM's queue/prefill/decode and
max-generation histograms, route and method labels from closed sets, HEAD /metrics, the HTTP stack and event loop
in use (httptools and uvloop when installed), a half-closed client still answered, and the connection bound derived
from the file-descriptor limit (a subprocess server under `ulimit -n 256` still answers /health past it)."""
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from uvicorn.protocols.http.h11_impl import H11Protocol

import pocketjax as pj
from pocketjax.errors import RequestError
from pocketjax.serve import cli
from pocketjax.serve.http import server as server_module
from pocketjax.serve.http.http_guard import (HTTP_PROTOCOL, MAX_DEFAULT_CONNECTIONS, ConnectionRules, ServerLimits,
                                        default_max_connections)
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


@pytest.fixture(scope="module")
def served(llm):
    with BackgroundServer(create_app(llm)) as server:
        yield server


@pytest.fixture(scope="module")
def h11_served(llm):
    """The same app on uvicorn's h11 protocol (what serves when httptools is not installed)."""
    with BackgroundServer(create_app(llm), http=ServerLimits().uvicorn_options(H11Protocol)["http"]) as server:
        yield server


@pytest.fixture(params=["default", "h11"])
def stack(request, served, h11_served):
    return served if request.param == "default" else h11_served


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics as {(name, sorted labels without model_name/engine): value}."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in ("model_name", "engine")))
            out[sample.name, labels] = sample.value
    return out


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def raw(server, data: bytes, half_close: bool = False, wait: float = 60.0) -> bytes:
    """Send `data` on a fresh connection (then shutdown(SHUT_WR) with `half_close`); all the server answers until it
    closes the connection."""
    out = b""
    with socket.create_connection((server.host, server.port), timeout=wait) as sock:
        sock.sendall(data)
        if half_close:
            sock.shutdown(socket.SHUT_WR)
        while chunk := sock.recv(65536):
            out += chunk
    return out


def post_bytes(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            f"\r\n").encode() + data


# ---- warm-up and the CLI ----------------------------------------------------------------------------------------------
class FakeLLM:
    """What cmd_serve touches of an LLM, recording the keywords it was made with."""

    made: list[dict] = []

    def __init__(self, *args, **kwargs):
        FakeLLM.made.append(kwargs)
        self.model, self.scheduler = None, type("S", (), {"group": None})()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


@pytest.mark.parametrize("argv, warmup", [(["serve"], True), (["serve", "--no-warmup"], False),
                                          (["serve", "--warmup"], True), (["generate", "x"], False),
                                          (["generate", "x", "--warmup"], True)])
def test_serve_warms_up_by_default(monkeypatch, argv, warmup):
    """`pocketjax serve` warms up unless --no-warmup, beside the listening server (issue 67: the LLM is built
    without it and `serve` runs it while /health says "warming"); generate and chat only with --warmup, in the
    LLM. The connection bound defaults to the fd limit's."""
    seen = {}
    monkeypatch.setattr("pocketjax.serve.llm.LLM", FakeLLM)
    monkeypatch.setattr(server_module, "serve", lambda llm, host, port, **kw: seen.update(kw))
    monkeypatch.setattr(cli, "cmd_generate", lambda args: cli.make_llm(args) and 0)
    FakeLLM.made.clear()
    assert cli.main(argv) == 0
    serving = argv[0] == "serve"
    assert FakeLLM.made[0]["warmup"] is (warmup and not serving)
    assert seen.get("warmup", False) is (warmup and serving)
    if serving:
        assert seen["limits"].max_connections is None
        assert seen["limits"].connections() == default_max_connections()


# ---- models, usage ----------------------------------------------------------------------------------------------------
def test_models_retrieve(client):
    """client.models.retrieve(name) returns the card /v1/models lists; another name is a 404 NotFoundError."""
    card = client.models.retrieve(NAME)
    assert card.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve("gpt-4o")
    assert caught.value.body["code"] == "model_not_found" and caught.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("org/" + NAME)  # a name with a slash reaches the route (and is not this model)


def test_cached_tokens_are_what_the_prefix_cache_reused(served, client):
    """A long chat prompt sent twice: the first finds nothing cached, the second every token but its last (the
    engine's rule: a prompt's last token always runs, test_metrics), and each equals what /metrics counted as
    prefix-cache hits for it. Completions (one prompt, n=2) report the prompt's reuse once."""
    messages = [{"role": "user", "content": "def fibonacci(n): return the n-th Fibonacci number, iteratively " * 2}]
    cached, hits = [], []
    for _ in range(2):
        before = scrape(served.url)
        out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, temperature=0)
        hits.append(delta(before, scrape(served.url), "vllm:prefix_cache_hits_total"))
        cached.append(out.usage.prompt_tokens_details.cached_tokens)
    assert out.usage.prompt_tokens > 30
    assert cached == [0, out.usage.prompt_tokens - 1] and hits == cached
    prompt = list(range(4000, 4030))
    client.completions.create(model=NAME, prompt=prompt, max_tokens=1, temperature=0)
    again = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0, n=2)
    assert again.usage.prompt_tokens == len(prompt)
    assert again.usage.prompt_tokens_details.cached_tokens == len(prompt) - 1
    stream = client.chat.completions.create(model=NAME, messages=messages, max_tokens=2, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    assert list(stream)[-1].usage.prompt_tokens_details.cached_tokens == out.usage.prompt_tokens - 1


# ---- /metrics ---------------------------------------------------------------------------------------------------------
def test_phase_histograms_and_max_generation(served, client):
    """One completion with n=3 choices of different lengths is one vLLM request in
    request_max_num_generation_tokens (its sum is the longest choice, as the client counted tokens), three in the
    per-choice histograms; each choice's queue + prefill + decode time fits within its end-to-end latency."""
    before = scrape(served.url)
    out = client.completions.create(model=NAME, prompt="import", max_tokens=12, temperature=1.0, seed=3, n=3,
                                    logprobs=0)
    after = scrape(server_url := served.url)
    lengths = [len(c.logprobs.tokens) for c in out.choices]
    assert sum(lengths) == out.usage.completion_tokens
    assert delta(before, after, "vllm:request_max_num_generation_tokens_count") == 1
    assert delta(before, after, "vllm:request_max_num_generation_tokens_sum") == max(lengths)
    phases = 0.0
    for name in ("queue_time", "prefill_time", "decode_time"):
        assert delta(before, after, f"vllm:request_{name}_seconds_count") == 3, name
        assert delta(before, after, f"vllm:request_{name}_seconds_sum") >= 0
        phases += delta(before, after, f"vllm:request_{name}_seconds_sum")
    e2e = delta(before, after, "vllm:e2e_request_latency_seconds_sum")
    assert 0 < phases <= e2e
    assert scrape(server_url)[("vllm:request_queue_time_seconds_bucket", (("le", "7680.0"),))] >= 3


def test_labels_come_from_closed_sets(served, client):
    """Routes are labelled as the client called them (/v1/responses, /v1/models/{id}); unusual methods share one
    "other" label, however many a client invents; HEAD /metrics is 200 with no body."""
    client.models.retrieve(NAME)
    client.responses.create(model=NAME, input="def", max_output_tokens=2, temperature=0)
    for method in ("PROPFIND", "MKCOL", "COPY", "LOCK", "PURGE"):  # methods httptools parses (h11 takes any)
        assert raw(served, f"{method} /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    head = urllib.request.Request(served.url + "/metrics", method="HEAD")
    with urllib.request.urlopen(head, timeout=30) as response:
        assert response.status == 200 and response.read() == b""
    samples = scrape(served.url)
    handlers = {dict(k[1])["handler"] for k in samples if k[0] == "http_requests_total"}
    methods = {dict(k[1])["method"] for k in samples if k[0] == "http_requests_total"}
    assert {"/v1/responses", "/v1/models/{model:path}", "/metrics"} <= handlers
    assert "/responses" not in handlers and "/models/{model:path}" not in handlers
    assert methods <= {"GET", "POST", "HEAD", "other"} and "other" in methods
    assert samples[("http_requests_total", (("handler", "/metrics"), ("method", "HEAD"), ("status", "200")))] == 1


# ---- the HTTP stack ---------------------------------------------------------------------------------------------------
def test_httptools_and_uvloop_serve_when_installed(served):
    """The live connection's protocol is uvicorn's httptools one with ConnectionRules on top, on uvloop's loop."""
    httptools_impl = pytest.importorskip("uvicorn.protocols.http.httptools_impl")
    uvloop = pytest.importorskip("uvloop")
    assert HTTP_PROTOCOL is httptools_impl.HttpToolsProtocol
    with socket.create_connection((served.host, served.port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        connections = served.connections()
        assert connections  # this one at least
        for connection in connections:
            assert isinstance(connection, ConnectionRules) and isinstance(connection, HTTP_PROTOCOL)
            assert isinstance(connection.loop, uvloop.Loop)


def test_headers_past_the_limit_are_refused(stack):
    """100 KiB of headers that never end: 400 and the connection closed at the 64 KiB limit (h11 bounded them by
    itself; httptools holds whatever comes until the header deadline)."""
    sock = socket.create_connection((stack.host, stack.port), timeout=5)
    with sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        try:
            for i in range(100):
                sock.sendall(f"X-Pad-{i}: {'a' * 1000}\r\n".encode())
        except (ConnectionResetError, BrokenPipeError):
            pass
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except (ConnectionResetError, socket.timeout):
            pass
    assert answer.startswith(b"HTTP/1.1 400")  # h11 says "Invalid HTTP request", ConnectionRules "over the limit"


@pytest.mark.parametrize("stream", [False, True])
def test_a_half_closed_client_is_answered(stack, stream):
    """A whole request, then shutdown(SHUT_WR) (curl and some proxies do it): the answer still comes (after an
    interim 102, unless a stream's answer had already started), the same as the request gets on an open
    connection, and then the server closes."""
    body = {"model": NAME, "prompt": "def add(a, b):", "max_tokens": 6, "temperature": 0, "stream": stream}
    request = post_bytes("/v1/completions", body)
    closing = request.replace(b"Host: x", b"Host: x\r\nConnection: close", 1)  # the same on an open socket
    half, whole = raw(stack, request, half_close=True), raw(stack, closing)
    interim = b"HTTP/1.1 102 Processing\r\n\r\n"  # the probe that tells a half-close from a hang-up (RFC 9110 1xx)
    # a stream whose headers left before the server read the EOF probes with its own next chunk instead (a race
    # the client's timing decides: CI saw it once on a busy box)
    started = stream and half.startswith(b"HTTP/1.1 200")
    assert started or half.startswith(interim + b"HTTP/1.1 200")
    half = half if started else half[len(interim):]

    def text(answer: bytes) -> str:
        payload = answer.split(b"\r\n\r\n", 1)[1]
        if not stream:
            return json.loads(payload)["choices"][0]["text"]
        lines = [line for line in payload.split(b"\n") if line.startswith(b"data: {")]
        assert payload.rstrip().endswith(b"data: [DONE]") or b"data: [DONE]" in payload
        return "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines)

    assert text(half) == text(whole) != ""


# ---- connections and file descriptors ---------------------------------------------------------------------------------
def test_the_default_connection_bound_follows_the_fd_limit():
    assert default_max_connections(1024) == 768
    assert default_max_connections(256) == 128  # the headroom is at least FD_HEADROOM
    assert default_max_connections(100) == 1
    assert default_max_connections(1 << 20) == MAX_DEFAULT_CONNECTIONS
    assert ServerLimits(max_connections=7).connections() == 7


def test_slow_clients_past_the_bound_give_way(llm):
    """max_connections=8 and 20 connections that never finish their headers: the server holds at most 8, the
    longest-waiting closed first, and /health (a new connection) is answered at once."""
    limits = ServerLimits(max_connections=8, header_timeout_s=60)
    with BackgroundServer(create_app(llm, limits=limits), limits=limits) as server:
        socks = [socket.create_connection((server.host, server.port), timeout=10) for _ in range(20)]
        try:
            for sock in socks:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            with urllib.request.urlopen(server.url + "/health", timeout=10) as response:
                assert response.status == 200
            time.sleep(0.2)
            assert len(server.connections()) <= 8
            assert socks[0].recv(1) == b""  # the oldest was closed
        finally:
            for sock in socks:
                sock.close()


CHILD = textwrap.dedent("""
    import resource, sys, time
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    from fastapi import FastAPI
    from pocketjax.serve.http.server import BackgroundServer
    app = FastAPI()
    app.get("/health")(lambda: {"status": "ok"})
    with BackgroundServer(app) as server:
        print(server.port, flush=True)
        sys.stdin.read()
""")


def test_health_answers_past_the_fd_limit():
    """A server process whose file limit is 256, default limits: 300 clients that never send a byte would hold
    every descriptor (accept fails, /health hangs); with the bound derived from the limit (128) /health answers."""
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "JAX_PLATFORMS": "cpu"})
    socks = []
    try:
        port = int(child.stdout.readline())
        socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(300)]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=8) as response:
            assert response.status == 200
    finally:
        for sock in socks:
            sock.close()
        child.stdin.close()
        child.wait(timeout=30)


def test_bytes_are_not_token_ids(llm):
    """bytes are a Sequence of ints: LLM.generate and encode refuse them with a typed error instead of reading them
    as token ids."""
    for prompt in (b"def add", bytearray(b"def"), [b"def"], memoryview(b"x")):
        with pytest.raises(RequestError, match="decode bytes"):
            llm.generate(prompt, pj.SamplingParams(max_tokens=1))
    with pytest.raises(RequestError, match="decode bytes"):
        llm.encode(b"def")
