"""The published API (pocketjax/serve/http/openapi.py): /openapi.json is the checked-in docs/openapi.json, and a
fuzzer driven by it (schemathesis, every check but positive_data_acceptance) finds the server answering as the
document says, without and with --api-key.

What the fuzz proves: every status, content type and header the server answers with is declared (a 405 with its
Allow), every answer matches its schema, a request the document refuses is refused (negative_data_rejection:
the document is no looser than the server), a guarded route refuses a request without the key (ignored_auth), and
nothing is a 5xx. Bounded for CI (the whole file in about a minute on 2 cores: few examples per operation, a small
engine); benchmarks/fuzz_api.py runs the long version and reports how many requests reach generation.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

import pocketjax as pj
from pocketjax.serve.http.http_guard import ServerLimits
from pocketjax.serve.http.server import BackgroundServer, create_app
from pocketjax.serve.llm import DEFAULT_MODEL

pytestmark = [pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors").exists(), reason="no embedded model"),
              pytest.mark.leg1_only]  # HTTP / host-side: the same under any JAX
DOCUMENT = Path(__file__).resolve().parents[1] / "docs" / "openapi.json"
KEY = "sesame"
GENERATION = ("/v1/chat/completions", "/v1/messages")


@pytest.fixture(scope="module", autouse=True)
def xla_products():
    """XLA's products for this file: what is fuzzed is the HTTP layer, and building the native CPU kernels
    (`cpu_kernels`, read at each trace) costs ~35 s on 2 cores, once per test session, before the first LLM."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("POCKETJAX_CPU_KERNELS", "off")
        yield


def test_the_published_document_is_the_checked_in_one():
    """docs/openapi.json is what `pocketjax serve` publishes with its defaults: an API change is a visible diff
    (regenerate with `python -m pocketjax.serve.http.server > docs/openapi.json`)."""
    with pj.LLM(warmup=False) as llm:
        published = create_app(llm).openapi()
    assert published == json.loads(DOCUMENT.read_text()), \
        "the API changed: python -m pocketjax.serve.http.server > docs/openapi.json, and review the diff"


def test_the_document_declares_what_the_server_does():
    """The parts of the document a client relies on, named: no 422 anywhere, errors in each family's shape, streams
    declared, /metrics as Prometheus text, HEAD beside GET, and the key schemes only with a key."""
    document = json.loads(DOCUMENT.read_text())
    paths = document["paths"]
    for path, operations in paths.items():
        for method, operation in operations.items():
            assert "422" not in operation["responses"], (method, path)
    family = {path: ops["post"]["responses"]["400"]["content"]["application/json"]["schema"]["$ref"]
              for path, ops in paths.items() if "post" in ops}
    assert {family["/v1/messages"], family["/v1/messages/count_tokens"]} == {"#/components/schemas/AnthropicError"}
    assert family["/v1/chat/completions"] == family["/tokenize"] == "#/components/schemas/OpenAIError"
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"):
        responses = paths[path]["post"]["responses"]
        assert "text/event-stream" in responses["200"]["content"] and {"429", "503"} <= set(responses)
        assert "Retry-After" in responses["429"]["headers"]
    assert all(media.startswith("text/plain") for media in paths["/metrics"]["get"]["responses"]["200"]["content"])
    assert {path for path, ops in paths.items() if "get" in ops} == {path for path, ops in paths.items()
                                                                      if "head" in ops}
    assert "securitySchemes" not in document.get("components", {})
    chat = document["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["model"]["anyOf"][0] == {"type": "string", "enum": ["pocket-coder"]}


@pytest.fixture(scope="module")
def llm():
    # a small context: every answer is short, so the fuzz's generations stay within CI's minute
    with pj.LLM(max_batch_size=4, max_seq_len=64, prefill_chunk=32) as llm:
        yield llm


def http_answers(metrics) -> dict[tuple[str, str, str], int]:
    """(method, route, status) -> how many answers the server gave, from its own http_requests_total."""
    out = {}
    for metric in metrics.registry.collect():
        for sample in metric.samples:
            if sample.name == "http_requests_total":
                labels = sample.labels
                out[labels["method"], labels["handler"], labels["status"]] = int(sample.value)
    return out


@pytest.mark.skipif(importlib.util.find_spec("schemathesis") is None,
                    reason="schemathesis is a dev dependency (pip install -e .[dev])")
@pytest.mark.parametrize("api_key", [None, KEY], ids=["open", "api_key"])
def test_a_fuzzer_driven_by_the_document_finds_nothing(llm, tmp_path, api_key):
    """Open: the coverage phase's negative cases (each constraint of the document broken, one at a time, and the
    methods no route has) and random cases of both kinds; with the key, random cases, each also sent without the
    key and with a wrong one (ignored_auth). The coverage phase's positive cases (every edge value, each a
    generation) are the long run's: benchmarks/fuzz_api.py."""
    app = create_app(llm, api_key=api_key, limits=ServerLimits(max_choices=2))
    config = tmp_path / "schemathesis.toml"
    config.write_text('[phases.coverage.generation]\nmode = "negative"\n')
    phases, examples = ("coverage,fuzzing", 8) if api_key is None else ("fuzzing", 4)
    with BackgroundServer(app) as server:
        command = [sys.executable, "-m", "schemathesis.cli", "--config-file", str(config), "--no-color", "run",
                   f"{server.url}/openapi.json", "--checks", "all", "--exclude-checks", "positive_data_acceptance",
                   "--phases", phases, "--max-examples", str(examples), "--seed", "69", "--workers", "1",
                   "--generation-database", "none", "--report", "json",
                   "--report-json-path", str(tmp_path / "report.json"),
                   # a request that compiles a new program takes seconds on 2 busy cores: latency is not the document's
                   "--request-timeout", "120", "--max-response-time", "120"]
        if api_key is not None:
            command += ["--header", f"Authorization: Bearer {api_key}"]
        run = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    report = json.loads((tmp_path / "report.json").read_text())
    assert run.returncode == 0 and report["failures"] == [] and report["errors"] == [], run.stdout[-6000:]
    answers = http_answers(app.state.metrics)
    posts = sorted((route, status, n) for (method, route, status), n in answers.items() if method == "POST")
    print(f"\n{report['test_cases']['generated']} cases; POST answers (route, status, count): {posts}")
    assert not any(status.startswith("5") for _, _, status in answers)
    if api_key is not None:  # refused before routing (the route label is "other"): one at least per operation
        guarded = [ops for path, ops in app.openapi()["paths"].items() if path not in ("/health", "/metrics")]
        operations = sum(map(len, guarded))
        assert sum(n for (_, _, status), n in answers.items() if status == "401") >= operations
    for route in GENERATION:  # the document admits requests the server serves: some reached generation
        assert answers.get(("POST", route, "200"), 0) > 0, route
