"""The HTTP server against a hostile client: request templates, template kwargs, the key before the body, body and
header limits, half-open connections, malformed-but-valid-JSON requests, and a request failing inside a shared
engine call while another is served. Every refusal is a 4xx with OpenAI's error object; the other clients keep
being served (the event loop answers /health while a hostile render runs)."""
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

import pocketjax as pj
from pocketjax.errors import ConfigError
from pocketjax.serve import cli
from pocketjax.serve.http.http_guard import ServerLimits
from pocketjax.serve.llm import DEFAULT_MODEL
from pocketjax.serve.http.server import BackgroundServer, create_app
from pocketjax.serve.template_sandbox import RenderLimits

pytestmark = [pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors").exists(), reason="no embedded model"),
              pytest.mark.leg1_only]  # HTTP / host-side: the same under any JAX
SLOTS, CONTEXT = 4, 128  # test_server's engine shape: the compiled steps are shared
KEY = "secret-key"
LIMITS = ServerLimits(max_body_bytes=1 << 20, body_timeout_s=1.0, header_timeout_s=1.0, max_prompt_chars=4000,
                      max_choices=16)
MESSAGES = [{"role": "user", "content": "def add(a, b):"}]


@pytest.fixture(scope="module")
def llm():
    with pj.LLM(max_batch_size=SLOTS, max_seq_len=CONTEXT, prefill_chunk=32) as llm:
        yield llm


@pytest.fixture(scope="module")
def guarded(llm):
    """A server with a key and small limits."""
    with BackgroundServer(create_app(llm, api_key=KEY, limits=LIMITS), limits=LIMITS) as server:
        yield server


@pytest.fixture(scope="module")
def trusting(llm):
    """A server that renders request templates."""
    with BackgroundServer(create_app(llm, trust_request_chat_template=True)) as server:
        yield server


def post(url: str, body: dict | bytes, key: str | None = KEY) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def chat(server, key: str | None = KEY, **fields) -> tuple[int, dict]:
    return post(server.url + "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "temperature": 0,
                                                     **fields}, key)


def raw(server, data: bytes, wait: float = 5.0) -> bytes:
    """Send raw bytes on a fresh connection; everything the server answers until it closes (or `wait` passes)."""
    out = b""
    with socket.create_connection((server.host, server.port), timeout=wait) as sock:
        try:
            sock.sendall(data)
            while chunk := sock.recv(65536):
                out += chunk
        except socket.timeout:
            pass
        except (ConnectionResetError, BrokenPipeError):  # the server answered and closed while we still sent
            out += b"<reset>"
        return out


def health_latency(server, stop: threading.Event, worst: list) -> None:
    while not stop.is_set():
        start = time.perf_counter()
        with urllib.request.urlopen(server.url + "/health", timeout=30) as response:
            assert response.status == 200
        worst.append(time.perf_counter() - start)
        time.sleep(0.02)


# ---- chat templates ---------------------------------------------------------------------------------------------------
def test_request_templates_are_off_and_kwargs_only_set_variables(guarded):
    status, body = chat(guarded, chat_template_kwargs={"chat_template": "{{ 'x' }}"})
    assert status == 400 and body["error"]["code"] == "chat_template_not_allowed"
    for key in ("messages", "add_generation_prompt", "tools", "continue_final_message", "_hidden", "a-b"):
        status, body = chat(guarded, chat_template_kwargs={key: []})
        assert status == 400 and repr(key) in body["error"]["message"], key
        assert body["error"]["param"] == "chat_template_kwargs"
    status, body = chat(guarded, chat_template_kwargs={"enable_thinking": False})
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_trusted_request_template_renders_like_the_library(llm, trusting):
    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    status, body = chat(trusting, key=None, chat_template_kwargs={"chat_template": template})
    expected = llm.generate("<user>def add(a, b):", pj.SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert status == 200 and body["choices"][0]["message"]["content"] == expected.text
    status, body = chat(trusting, key=None, chat_template_kwargs={"chat_template": "{% if %}"})
    assert status == 400 and "does not parse" in body["error"]["message"]


@pytest.mark.parametrize("template", ["{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                      "{% endfor %}", "{{ 'x' * 300000000 }}", "{{ 1 // 0 }}"])
def test_a_hostile_request_template_stalls_no_one(llm, trusting, template):
    limits = llm.tokenizer.render_limits
    llm.tokenizer.render_limits = RenderLimits(seconds=1.0)
    stop, worst = threading.Event(), []
    poller = threading.Thread(target=health_latency, args=(trusting, stop, worst))
    poller.start()
    try:
        start = time.perf_counter()
        status, body = chat(trusting, key=None, chat_template_kwargs={"chat_template": template})
        elapsed = time.perf_counter() - start
    finally:
        stop.set()
        poller.join()
        llm.tokenizer.render_limits = limits
    assert status == 400 and "chat template" in body["error"]["message"]
    assert elapsed < 10
    assert worst and max(worst) < 1.0  # the loop answered /health while the template ran


# ---- the HTTP edge ------------------------------------------------------------------------------------------------------
def test_the_key_is_checked_before_the_body(guarded):
    status, body = post(guarded.url + "/v1/chat/completions", b"{not json", key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _ = post(guarded.url + "/v1/chat/completions", b"{not json")
    assert status == 400
    # a 39 MB body announced without a key: refused from the headers, the body is never read
    start = time.perf_counter()
    answer = raw(guarded, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: 40000000\r\n\r\n{")
    assert answer.startswith(b"HTTP/1.1 401") and time.perf_counter() - start < 5
    status, _ = post(guarded.url + "/health", b"", key=None)
    assert status in (200, 405)  # /health stays open without the key


@pytest.mark.parametrize("first, second", [(b"Authorization: Bearer wrong", b"Authorization: Bearer KEY"),
                                           (b"Authorization: Bearer KEY", b"authorization: Bearer wrong"),
                                           (b"x-api-key: KEY", b"X-Api-Key: KEY")])
def test_a_key_header_given_twice_is_400(guarded, first, second):
    """Authorization (and x-api-key) hold one key: two of them are a malformed request whichever order, the right
    key in either or both, never "any one matches"; one of each header is two fields, checked as before."""
    body = json.dumps({"messages": MESSAGES, "max_tokens": 1}).encode()

    def send(*headers: bytes) -> bytes:
        head = b"".join(h.replace(b"KEY", KEY.encode()) + b"\r\n" for h in headers)
        return raw(guarded, b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                   + head + b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    answer = send(first, second)
    assert answer.startswith(b"HTTP/1.1 400") and b"more than once" in answer
    one_each = urllib.request.Request(guarded.url + "/v1/chat/completions", data=body, headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}", "x-api-key": "wrong"})
    with urllib.request.urlopen(one_each, timeout=120) as response:
        assert response.status == 200


def test_bodies_past_the_limit_are_413(guarded):
    answer = raw(guarded, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                 + b"\r\nContent-Length: 2000000\r\n\r\n{")  # answered from the header, before the body
    assert answer.startswith(b"HTTP/1.1 413") and b"body_too_large" in answer
    chunked = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
               + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * 65536
    for _ in range(20):  # 1.3 MB in chunks, no Content-Length
        chunked += f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    answer = raw(guarded, chunked + b"0\r\n\r\n")  # a 413, or a reset mid-body when it lands before we read it
    assert answer.startswith(b"HTTP/1.1 413") or answer == b"<reset>", answer[:200]
    assert post(guarded.url + "/health", b"", key=None)[0] in (200, 405)  # and the server still serves


def test_incomplete_requests_time_out(guarded):
    start = time.perf_counter()
    assert raw(guarded, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", wait=10) == b""  # headers never end
    assert time.perf_counter() - start < LIMITS.header_timeout_s + 3
    answer = raw(guarded, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + KEY.encode()
                 + b"\r\nContent-Length: 100\r\n\r\n{\"prompt\":", wait=10)
    assert answer.startswith(b"HTTP/1.1 408")


def test_half_open_connections_are_closed_and_health_still_answers(guarded):
    socks = [socket.create_connection((guarded.host, guarded.port), timeout=10) for _ in range(64)]
    try:
        for sock in socks:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finished
        time.sleep(LIMITS.header_timeout_s + 1.5)
        assert all(sock.recv(1) == b"" for sock in socks)  # the server closed every one
    finally:
        for sock in socks:
            sock.close()
    with urllib.request.urlopen(guarded.url + "/health", timeout=10) as response:
        assert response.status == 200


def test_an_empty_api_key_is_a_startup_error(llm):
    with pytest.raises(ConfigError, match="api_key"):
        create_app(llm, api_key="")
    start = time.perf_counter()
    assert cli.main(["serve", "--api-key", ""]) == 2
    assert time.perf_counter() - start < 5  # refused before any model loads


# ---- requests that parse but must not reach the engine -----------------------------------------------------------------
def nested(depth: int):
    value = "x"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("fields, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "hi", "extra": nested(900)}]}, "messages"),
    ({"chat_template_kwargs": {"deep": nested(200)}}, "chat_template_kwargs"),
    ({"messages": [{"role": "user", "content": "y" * 5000}]}, "messages"),
    ({"n": 64, "max_tokens": 1}, "n"),
    ({"stop": ["s%d" % i for i in range(100)]}, None),
    ({"top_k": 2**31}, None),
    ({"temperature": 1e39}, None),
    ({"seed": 2**64}, None),
])
def test_malformed_chat_requests_are_400(guarded, fields, param):
    status, body = chat(guarded, **fields)
    assert status == 400, body
    assert param is None or body["error"]["param"] == param


def test_odd_requests_get_typed_answers(guarded):
    status, body = chat(guarded, model="\ud800")  # a lone surrogate in the model name
    assert status == 404 and body["error"]["code"] == "model_not_found"
    status, body = post(guarded.url + "/v1/completions", {"prompt": "z" * 5000, "max_tokens": 1})
    assert status == 400 and body["error"]["code"] == "prompt_too_long"
    for param, fields in (("prompt", {"prompt": "z" * 5000}),  # /tokenize holds the same prompt-size limit
                          ("messages", {"messages": [{"role": "user", "content": "y" * 5000}]})):
        status, body = post(guarded.url + "/tokenize", fields)
        assert status == 400 and body["error"]["code"] == "prompt_too_long" and body["error"]["param"] == param
    status, body = post(guarded.url + "/tokenize", {"prompt": "z" * 100})
    assert status == 200 and body["count"] > 0
    status, body = post(guarded.url + "/v1/completions", {"prompt": ["a"] * 100, "n": 2, "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "n"


# ---- a request failing inside a shared engine call -----------------------------------------------------------------------
def test_a_failing_stream_ends_properly_and_its_batch_mate_is_served(llm, guarded, monkeypatch):
    """An exception no validation foresaw (here injected into the engine's packing for one seed) fails only its own
    request: its stream ends with an error event and [DONE], a concurrent request returns what it returns alone."""
    import pocketjax.engine.plan as engine_module  # where the engine packs its steps' sampling arrays

    real = engine_module.pack_sampling

    def pack(params, seeds, pad_to=None):
        if any(p.seed == 4242 for p in params):
            raise OverflowError("injected: this request's values do not pack")
        return real(params, seeds, pad_to)

    expected = llm.generate("import os", pj.SamplingParams(max_tokens=8, temperature=0.0))[0].text
    monkeypatch.setattr(engine_module, "pack_sampling", pack)
    client = openai.OpenAI(base_url=guarded.url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    results = {}

    def good():
        results["good"] = client.completions.create(model=None or "pocket-coder", prompt="import os", max_tokens=8,
                                                    temperature=0).choices[0].text

    thread = threading.Thread(target=good)
    thread.start()
    request = urllib.request.Request(guarded.url + "/v1/completions", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}, data=json.dumps(
        {"prompt": "def f():", "max_tokens": 8, "seed": 4242, "temperature": 1.0, "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=120) as response:
        events = [line for line in response.read().decode().split("\n\n") if line]
    thread.join(120)
    assert events[-1] == "data: [DONE]"
    assert "error" in json.loads(events[-2].removeprefix("data: "))
    assert results["good"] == expected
