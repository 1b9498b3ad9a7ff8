"""POST /v1/responses through the official openai client's `client.responses.create`, streamed and not; the
reference is the same conversation through `LLM.chat` (the chat template, run alone, greedy)."""
import json
import urllib.error
import urllib.request

import openai
import pytest

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


@pytest.fixture(scope="module")
def server(llm):
    with BackgroundServer(create_app(llm)) as server:
        yield server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_string_input_matches_chat(llm, client):
    out = client.responses.create(model=NAME, input="write a function that adds two numbers",
                                  max_output_tokens=12, temperature=0)
    alone = llm.chat([{"role": "user", "content": "write a function that adds two numbers"}],
                     pj.SamplingParams(max_tokens=12, temperature=0))
    assert out.object == "response" and out.id.startswith("resp_") and out.output_text == alone.text
    assert out.output[0].type == "message" and out.output[0].role == "assistant"
    assert out.status == ("incomplete" if alone.finish_reason == "length" else "completed")
    if out.status == "incomplete":
        assert out.incomplete_details.reason == "max_output_tokens"
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "write a function that adds two "
                                                 "numbers"}], add_generation_prompt=True)
    assert out.usage.input_tokens == len(llm.tokenizer.encode(prompt))
    assert out.usage.output_tokens == len(alone.token_ids)
    assert out.usage.total_tokens == out.usage.input_tokens + out.usage.output_tokens


def test_messages_and_instructions_streamed(llm, client):
    """A message list with instructions (a system message in front), streamed: the Responses event types in
    order, deltas that add up to the text run alone, sequence numbers 0, 1, 2, ..."""
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": [{"type": "input_text", "text": "print a list"}]}]
    alone = llm.chat([{"role": "system", "content": "answer in code"}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}, {"role": "user", "content": "print a list"}],
                     pj.SamplingParams(max_tokens=10, temperature=0))
    events = list(client.responses.create(model=NAME, input=conversation, instructions="answer in code",
                                          max_output_tokens=10, temperature=0, stream=True))
    final = "response.incomplete" if alone.finish_reason == "length" else "response.completed"

    def in_order(events) -> bool:  # how many deltas depends on how tokens arrive; their place does not
        deltas = sum(e.type == "response.output_text.delta" for e in events)
        return [e.type for e in events] == [
            "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
            *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
            "response.output_item.done", final]

    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert in_order(events)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in deltas) == alone.text == events[-4].text
    assert events[-1].response.output_text == alone.text
    assert events[-1].response.usage.output_tokens == len(alone.token_ids)
    # the SDK's stream helper rebuilds the response from the events (it checks that each delta follows its item
    # and part); its get_final_response() wants response.completed, which an incomplete response never sends
    with client.responses.stream(model=NAME, input=conversation, instructions="answer in code",
                                 max_output_tokens=10, temperature=0) as stream:
        helped = list(stream)
    assert in_order(helped)
    assert helped[-1].response.output_text == alone.text


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text"),  # no name
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text"),
    ({"text": {"verbosity": "low"}}, "text"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"max_output_tokens": CONTEXT}, "max_output_tokens"),
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),  # the other endpoints' constraint fields
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_unsupported_fields_are_400_naming_them(server, client, extra, param):
    body = {"model": NAME, "input": "x", **extra}
    request = urllib.request.Request(server.url + "/v1/responses", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=60)
    error = json.loads(info.value.read())["error"]
    assert info.value.code == 400 and error["param"] == param, error
    assert client.responses.create(model=NAME, input="y", max_output_tokens=2).usage.output_tokens <= 2
