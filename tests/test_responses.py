"""POST /v1/responses through the official openai client's `client.responses.create`, streamed and not; the
reference is the same conversation through `LLM.chat` (the chat template, run alone, greedy)."""
import json
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest

import pocketjax as pj
from pocketjax.serve.llm import DEFAULT_MODEL
from pocketjax.serve.http.server import BackgroundServer, create_app

pytestmark = [pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors").exists(), reason="no embedded model"),
              pytest.mark.leg1_only]  # HTTP / host-side: the same under any JAX
SLOTS, CONTEXT = 4, 128  # test_server's engine shape: a shared session reuses its compiled steps
NAME = "pocket-coder"
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
ADD_TOOL = {"type": "function", "name": "add", "description": "a + b", "parameters": ADD}


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
    ({"tools": [{"type": "web_search"}]}, "tools"),  # built-in tools: only function tools run here
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nope"}}]}, "tools"),
    ({"tools": [ADD_TOOL], "tool_choice": {"type": "function", "name": "mul"}}, "tool_choice"),
    ({"tools": [ADD_TOOL], "tool_choice": "required", "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text"),  # no name
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}}, "text"),
    ({"text": {"verbosity": "low"}}, "text"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "add"}]}, "input"),  # no arguments
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"max_output_tokens": CONTEXT}, "max_output_tokens"),
    ({"input": "x" * 100_000}, "input"),  # over --max-prompt-chars: refused before the template renders it
    ({"structured_outputs": {"regex": "a+"}}, "structured_outputs"),  # the other endpoints' constraint fields
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"max_tokens": 3}, "max_tokens"),  # chat's name: max_output_tokens here (it was ignored: 242 tokens came)
    ({"frobnicate_logits": True}, "frobnicate_logits"),  # any field this body does not declare
    ({"max_tool_calls": 1}, "max_tool_calls"),
    ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
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


def items(response) -> list[tuple]:
    """A response's output items, ids left out (each answer draws new ones)."""
    return [(item.type, item.status, item.name, item.arguments) if item.type == "function_call"
            else (item.type, item.status, item.content[0].text) for item in response.output]


def test_function_tools_make_function_call_items(llm, client):
    """A named tool_choice: exactly one function_call item (no message: no text came before the call) whose
    arguments follow the schema, closed (no key but a and b); streamed through the SDK's stream helper, the same
    items; then the agent's next turn sends the call and its output back and gets text, the reply to the same
    conversation run alone through the chat template."""
    kw = dict(model=NAME, input="add 2 and 3", tools=[ADD_TOOL], tool_choice={"type": "function", "name": "add"},
              max_output_tokens=60, temperature=0)
    out = client.responses.create(**kw)
    assert out.status == "completed" and [item.type for item in out.output] == ["function_call"]
    call = out.output[0]
    assert call.name == "add" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), {**ADD, "additionalProperties": False})
    assert out.tools[0].name == "add" and out.tool_choice.name == "add"
    with client.responses.stream(**kw) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert items(final) == items(out)
    assert kinds[2:4] == ["response.output_item.added", "response.function_call_arguments.delta"]
    assert kinds[-4:] == ["response.function_call_arguments.delta", "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert kinds.count("response.function_call_arguments.delta") > 1  # the arguments arrive as they are written
    turn = [{"role": "user", "content": "add 2 and 3"}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "5"}]
    answer = client.responses.create(model=NAME, input=turn, tools=[ADD_TOOL], tool_choice="none",
                                     max_output_tokens=8, temperature=0)
    alone = llm.chat([{"role": "user", "content": "add 2 and 3"}, {"role": "assistant", "content": ""},
                      {"role": "tool", "content": "5"}], pj.SamplingParams(max_tokens=8, temperature=0))
    assert [item.type for item in answer.output] == ["message"] and answer.output_text == alone.text


def test_input_items_become_the_chat_conversation():
    """An agent's second request, as the Agents SDK sends it (its text, its call, the call's output), is the chat
    conversation an OpenAI chat client would send, in the form the templates read (arguments as an object)."""
    from pocketjax.serve.http.responses import ResponsesRequest

    body = ResponsesRequest.model_validate({"instructions": "be brief", "input": [
        {"role": "user", "content": "add 2 and 3"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Adding."}]},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": '{"a": 0, "b": 0}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "0"}]}]})
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "add", "arguments": arguments}}
             for i, arguments in ((1, {"a": 2, "b": 3}), (2, {"a": 0, "b": 0}))]
    assert body.chat() == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add 2 and 3"},
                           {"role": "assistant", "content": "Adding.", "tool_calls": calls},
                           {"role": "tool", "tool_call_id": "call_1", "content": "5"},
                           {"role": "tool", "tool_call_id": "call_2", "content": "0"}]


FORCED = dict(model=NAME, input="add 2 and 3", tools=[ADD_TOOL], tool_choice={"type": "function", "name": "add"},
              max_output_tokens=60, temperature=0)


def test_a_forced_tool_takes_a_text_format_stops_and_harmless_fields(client):
    """openai-agents sends an Agent's output type (text.format) on every turn, its forced one included, and a stop
    string can sit inside a call: a forced tool_choice answers with the same function_call item whatever format,
    stop strings and harmless fields (user, metadata, store, caching hints) come with it."""
    plain = items(client.responses.create(**FORCED))
    assert [item[0] for item in plain] == ["function_call"]
    done = {"type": "object", "properties": {"status": {"enum": ["done"]}}, "required": ["status"]}
    for text in ({"format": {"type": "json_schema", "name": "done", "schema": done, "strict": True}},
                 {"format": {"type": "json_object"}}):
        assert items(client.responses.create(**FORCED, text=text)) == plain
    assert items(client.responses.create(**FORCED, extra_body={"stop": ["\n", '"']})) == plain
    out = client.responses.create(**FORCED, user="u1", metadata={"k": "v"}, store=False,
                                  extra_body={"service_tier": "auto", "prompt_cache_key": "p"})
    assert items(out) == plain and out.metadata == {"k": "v"} and out.user == "u1"


def test_a_call_cut_short_is_a_message_and_replays(client):
    """Cut inside its arguments by max_output_tokens, the response holds no function_call whose JSON never closed:
    its text is a message item (status incomplete); a stream has sent the call's pieces and keeps them. The cut
    call sent back as an input item (as openai-agents replays it) is answered, never refused."""
    whole = items(client.responses.create(**FORCED))[0][3]
    out = client.responses.create(**{**FORCED, "max_output_tokens": 20})
    head = '<tool_call>\n{"name": "add", "arguments": '
    assert out.status == "incomplete" and [item.type for item in out.output] == ["message"]
    assert out.output[0].status == "incomplete" and out.output_text.startswith(head)
    cut = out.output_text[len(head):]
    assert whole.startswith(cut) and cut != whole
    last = list(client.responses.create(**{**FORCED, "max_output_tokens": 20}, stream=True))[-1].response
    assert items(last) == [("function_call", "incomplete", "add", cut)]
    turn = [{"role": "user", "content": "add 2 and 3"},
            {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": cut},
            {"type": "function_call_output", "call_id": "call_1", "output": "5"}]
    answer = client.responses.create(model=NAME, input=turn, tools=[ADD_TOOL], max_output_tokens=2, temperature=0)
    assert answer.status in ("completed", "incomplete")
