"""/tokenize, /detokenize and /tokenizer_info over real HTTP, in vLLM's shapes and with the requests
lm-evaluation-harness sends (its auto probe and RemoteTokenizer); transformers' tokenizer of the same checkpoint is
the reference. No model is loaded: the routes need only the tokenizer and the context length."""
import json
import types
import urllib.error
import urllib.request

import pytest
from fastapi import FastAPI

from pocketjax.serve.http.context import ServeContext
from pocketjax.serve.http.http_guard import ServerLimits
from pocketjax.serve.http.metrics import RequestMetrics
from pocketjax.serve.http.replies import install_error_handlers
from pocketjax.serve.http.server import BackgroundServer
from pocketjax.serve.http.tokenization import tokenization_router
from pocketjax.serve.llm import DEFAULT_MODEL
from pocketjax.serve.tokenizer import Tokenizer

pytestmark = [pytest.mark.skipif(not (DEFAULT_MODEL / "tokenizer.json").exists(), reason="no embedded model"),
              pytest.mark.leg1_only]  # HTTP / host-side: the same under any JAX
CONTEXT = 128


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")  # the reference: the torch-free CI leg skips

    return transformers.AutoTokenizer.from_pretrained(str(DEFAULT_MODEL))


@pytest.fixture(scope="module")
def server():
    llm = types.SimpleNamespace(tokenizer=Tokenizer.from_folder(DEFAULT_MODEL),
                                engine=types.SimpleNamespace(max_seq_len=CONTEXT))
    app = FastAPI()
    install_error_handlers(app)
    ctx = ServeContext(llm, "pocket-coder", ServerLimits(), RequestMetrics(llm, "pocket-coder"), created=0)
    app.include_router(tokenization_router(ctx))
    with BackgroundServer(app) as server:
        yield server


def call(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_tokenize_matches_transformers(server, hf):
    text = "def f(x):\n    return x  # ü <|im_end|>"
    for special in (True, False):
        status, out = call(server.url + "/tokenize", {"model": "pocket-coder", "prompt": text,
                                                      "add_special_tokens": special, "return_token_strs": True})
        assert status == 200
        assert out["tokens"] == hf(text, add_special_tokens=special)["input_ids"]
        assert out["count"] == len(out["tokens"]) and out["max_model_len"] == CONTEXT
        assert out["token_strs"] == hf.convert_ids_to_tokens(out["tokens"])
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    for generation in (True, False):
        status, out = call(server.url + "/tokenize", {"messages": messages, "add_generation_prompt": generation})
        want = hf.apply_chat_template(messages, add_generation_prompt=generation, tokenize=True)
        assert status == 200 and out["tokens"] == list(getattr(want, "input_ids", want)) and out["token_strs"] is None
    status, out = call(server.url + "/detokenize", {"tokens": hf(text)["input_ids"]})
    assert status == 200 and out["prompt"] == hf.decode(hf(text)["input_ids"]) == text


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ 7 * 7 }}"}, "chat_template"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"chat_template": "{{ 7 }}"}},
     "chat_template_kwargs"),
    ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs"),
    ("/detokenize", {"tokens": [5, 1 << 20]}, "tokens"),
    ("/detokenize", {"tokens": "5"}, "tokens"),
])
def test_bad_requests_are_400(server, path, body, param):
    status, out = call(server.url + path, body)
    assert status == 400 and out["error"]["param"] == param, out
    assert call(server.url + "/tokenize", {"prompt": "x", "model": "gpt-4"})[0] == 404


def test_tokenizer_info_has_what_lm_eval_reads(server, hf):
    status, info = call(server.url + "/tokenizer_info")
    assert status == 200
    assert (info["eos_token"], info["pad_token"], info["bos_token"]) == (hf.eos_token, hf.pad_token, hf.bos_token)
    assert info["chat_template"] == hf.chat_template and info["tokenizer_class"]
    assert info["added_tokens_decoder"]["4095"] == "<|im_end|>"


def test_lm_eval_remote_tokenizer_uses_the_server(server, hf):
    """lm-eval's own client, when installed: its auto probe accepts the server, and RemoteTokenizer agrees with
    transformers (ids, eos id, decode, chat template)."""
    utils = pytest.importorskip("lm_eval.utils")
    base = server.url + "/v1/completions"  # what a user passes as base_url; lm-eval strips the path
    assert utils.check_remote_tokenizer_support(base)
    remote = utils.RemoteTokenizer(base)
    text = "for i in range(3):\n    print(i)"
    assert remote.encode(text) == hf(text, add_special_tokens=False)["input_ids"]
    assert remote.eos_token_id == hf.eos_token_id
    assert remote.decode(remote.encode(text)) == text
    # the template's source is the checkpoint's; lm-eval renders it with its own jinja settings (no trim_blocks),
    # which for this template adds one trailing newline that transformers' rendering has not (lm-eval's, not ours)
    assert remote.tokenizer_info["chat_template"] == hf.chat_template
