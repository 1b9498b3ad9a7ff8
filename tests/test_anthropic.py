"""POST /v1/messages and /v1/messages/count_tokens driven by the official `anthropic` client over real HTTP, on a
random-weight Qwen3-shaped checkpoint with the official Qwen3 tokenizer and chat template (tools, tool calls and tool
results rendered as real Qwen3 models read them).

References are independent of the Anthropic route: the same conversation in OpenAI's shape through the official
`openai` client's /v1/chat/completions (greedy, so the texts must be equal), transformers' apply_chat_template for
prompt lengths and the prefill prompt, `jsonschema` for every forced tool input, and the non-streamed message for
the streamed one. This client release no longer types temperature, so greedy requests pass it in extra_body.
"""
import json
import urllib.error
import urllib.request

import anthropic
import jsonschema
import pytest

import pocketjax as pj
from conftest import oracle, served

pytestmark = pytest.mark.leg1_only  # HTTP / host-side: the same under any JAX (.ci/run's leg 2 runs the engine's tests)

transformers = oracle("transformers")

NAME = "qwen3"
GREEDY = {"temperature": 0}
THINK_OFF = {"chat_template_kwargs": {"enable_thinking": False}}  # the chat endpoint's spelling of the default here
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                      "b": {"type": "integer", "minimum": -99, "maximum": 99}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city"],
           "properties": {"city": {"type": "string", "maxLength": 12}}}
TOOLS = [{"name": "add", "description": "a + b", "input_schema": ADD},
         {"name": "get_weather", "description": "Weather of a city", "input_schema": WEATHER}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                  "parameters": t["input_schema"]}} for t in TOOLS]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is 2 + 3?"}]
BUDGET = 64


@pytest.fixture(scope="module")
def llm(qwen_checkpoint):
    with pj.LLM(str(qwen_checkpoint("qwen3")), max_batch_size=2, max_seq_len=512) as llm:
        yield llm


@pytest.fixture(scope="module")
def server(llm):
    """(server, openai client, anthropic client) with an API key: every request below also proves x-api-key auth."""
    with served(llm, api_key="sk-test", model_name=NAME) as (server, openai_client):
        yield server, openai_client, anthropic.Anthropic(base_url=server.url, api_key="sk-test", max_retries=0,
                                                         timeout=120)


@pytest.fixture(scope="module")
def client(server):
    return server[2]


@pytest.fixture(scope="module")
def chat(server):
    return server[1].chat.completions


@pytest.fixture(scope="module")
def hf(qwen_checkpoint):
    return transformers.AutoTokenizer.from_pretrained(str(qwen_checkpoint("qwen3")))


def create(client, **kw):
    return client.messages.create(**{"model": NAME, "max_tokens": BUDGET, "extra_body": GREEDY, **kw})


def text(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def shape(message) -> tuple:
    """A message less its ids (fresh per request) and the stream's parsed_output."""
    blocks = [block.model_dump(exclude={"id", "parsed_output"}) for block in message.content]
    return blocks, message.stop_reason, message.stop_sequence, message.usage.model_dump(), message.model


def test_text_system_and_turns_equal_chat_completions(client, chat, hf):
    """system as text blocks, turns as strings and blocks: the chat endpoint's answer to the same conversation, its
    usage, and the prompt length transformers renders; count_tokens is that length too."""
    system = [{"type": "text", "text": "You answer"}, {"type": "text", "text": "in code.", "cache_control":
                                                                            {"type": "ephemeral"}}]
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
             {"role": "user", "content": [{"type": "text", "text": "print"}, {"type": "text", "text": "a list"}]}]
    as_openai = [{"role": "system", "content": "You answer\nin code."}, {"role": "user", "content": "hi"},
                 {"role": "assistant", "content": "hello"}, {"role": "user", "content": "print\na list"}]
    for max_tokens in (BUDGET, 5):
        out = client.messages.create(model=NAME, max_tokens=max_tokens, system=system, messages=turns,
                                     extra_body=GREEDY, metadata={"user_id": "u1"}, service_tier="auto")
        ref = chat.create(model=NAME, messages=as_openai, max_tokens=max_tokens, temperature=0,
                          extra_body=THINK_OFF).choices[0]
        assert out.type == "message" and out.role == "assistant" and out.id.startswith("msg_") and out.model == NAME
        assert text(out) == ref.message.content and [b.type for b in out.content] == ["text"] * bool(text(out))
        assert out.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[ref.finish_reason]
        assert out.stop_sequence is None
    prompt = hf.apply_chat_template(as_openai, add_generation_prompt=True, return_dict=False, enable_thinking=False)
    assert out.usage.input_tokens == len(prompt)
    assert out.usage.output_tokens == chat.create(model=NAME, messages=as_openai, max_tokens=5, temperature=0,
                                                  extra_body=THINK_OFF).usage.completion_tokens
    assert client.messages.count_tokens(model=NAME, system=system, messages=turns).input_tokens == len(prompt)


def test_stop_sequences(client):
    whole = text(create(client, messages=ASK))
    word = whole[3:5]
    out = create(client, messages=ASK, stop_sequences=["\u2603never", word])
    assert text(out) == whole[:whole.index(word)]
    assert (out.stop_reason, out.stop_sequence) == ("stop_sequence", word)


@pytest.mark.parametrize("tools", [None, TOOLS])
def test_stream_accumulates_to_the_message(client, tools):
    """client.messages.stream: its text_stream joins to the message's text and get_final_message() is the
    non-streamed message (greedy); with tools forced, the tool_use block arrives by input_json_delta."""
    kw = {"messages": ASK, "max_tokens": BUDGET, "extra_body": GREEDY}
    if tools:
        kw |= {"tools": tools, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    whole = client.messages.create(model=NAME, **kw)
    with client.messages.stream(model=NAME, **kw) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert shape(final) == shape(whole)
    assert events[0] == "message_start" and events[-1] == "message_stop" and events[-2] == "message_delta"
    if tools:
        assert "input_json" in events and whole.stop_reason == "tool_use"
    else:
        with client.messages.stream(model=NAME, **kw) as stream:
            assert "".join(stream.text_stream) == text(whole)


def test_message_delta_usage_is_cumulative_with_input_tokens(client):
    """message_delta carries the whole usage, input_tokens and the cache counts included (Anthropic's counts are
    cumulative: langchain-anthropic reads input_tokens from it), equal to the message's."""
    kw = {"model": NAME, "messages": ASK, "max_tokens": 6, "extra_body": GREEDY}
    whole = client.messages.create(**kw)
    counted = client.messages.count_tokens(model=NAME, messages=ASK).input_tokens
    with client.messages.stream(**kw) as stream:
        deltas = [event.usage for event in stream if event.type == "message_delta"]
    counts = ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens", "output_tokens")
    assert len(deltas) == 1 and [getattr(deltas[0], k) for k in counts] == [getattr(whole.usage, k) for k in counts]
    assert [getattr(deltas[0], k) for k in counts] == [counted, 0, 0, whole.usage.output_tokens]


def test_every_answer_names_itself_in_a_request_id_header(client):
    """A message, a stream and an error each carry a fresh request-id header (req_...), as Anthropic's answers do."""
    kw = {"model": NAME, "messages": ASK, "max_tokens": 2, "extra_body": GREEDY}
    ids = [client.messages.with_raw_response.create(**kw).headers["request-id"]]
    with client.messages.stream(**kw) as stream:
        ids.append(stream.response.headers["request-id"])
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(**kw | {"model": "claude-x"})
    ids.append(raised.value.request_id)
    assert all(i.startswith("req_") for i in ids) and len(set(ids)) == 3, ids


def test_thinking_is_off_unless_asked(client, hf):
    """Qwen3's template thinks unless enable_thinking is false; Anthropic's default is no thinking, so the prompt is
    the one transformers renders with enable_thinking=False (its empty <think> block closed)."""
    off = hf.apply_chat_template(ASK, add_generation_prompt=True, return_dict=False, enable_thinking=False)
    assert off != hf.apply_chat_template(ASK, add_generation_prompt=True, return_dict=False)
    for thinking in ({}, {"thinking": {"type": "disabled"}}):
        assert client.messages.count_tokens(model=NAME, messages=ASK, **thinking).input_tokens == len(off)
        assert create(client, messages=ASK, max_tokens=2, **thinking).usage.input_tokens == len(off)


def test_stop_sequences_never_cut_a_forced_call(client):
    """A forced answer is calls only: stop_sequences (the newline after <tool_call>, a brace inside the input) do not
    cut it into no call or broken JSON; the grammar ends it after its call."""
    out = create(client, messages=ASK, tools=TOOLS, tool_choice={"type": "tool", "name": "add"},
                 stop_sequences=["\n", "{", "\""])
    uses = [b for b in out.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "add" and out.stop_reason == "tool_use", out
    jsonschema.validate(uses[0].input, ADD)


@pytest.mark.parametrize("choice, names", [({"type": "any", "disable_parallel_tool_use": True}, {"add", "get_weather"}),
                                           ({"type": "tool", "name": "get_weather"}, {"get_weather"})])
def test_forced_tool_use_validates_and_equals_chat(client, chat, choice, names):
    """tool_choice any / tool: one tool_use block whose input follows its input_schema, stop_reason tool_use, and the
    very call the chat endpoint makes for the same request in OpenAI's shape."""
    out = create(client, messages=ASK, tools=TOOLS, tool_choice=choice)
    uses = [b for b in out.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name in names and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, SCHEMAS[uses[0].name])
    assert out.stop_reason == "tool_use" and text(out) == ""
    openai_choice = "required" if choice["type"] == "any" else {"type": "function", "function": {"name": choice[
        "name"]}}
    ref = chat.create(model=NAME, messages=ASK, max_tokens=BUDGET, temperature=0, tools=OPENAI_TOOLS,
                      tool_choice=openai_choice, parallel_tool_calls=False,
                      extra_body=THINK_OFF).choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in ref] == [(uses[0].name, uses[0].input)]


def test_tool_result_turn_equals_chat_completions(client, chat, hf):
    """user -> assistant tool_use -> user tool_result: the answer and prompt length of the same conversation in
    OpenAI's shape; transformers renders that prompt to the length count_tokens reports."""
    first = create(client, messages=ASK, tools=TOOLS, tool_choice={"type": "tool", "name": "add",
                                                                   "disable_parallel_tool_use": True})
    use = first.content[-1]
    turns = ASK + [{"role": "assistant", "content": [block.model_dump(exclude_none=True) for block in first.content]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                 "content": [{"type": "text", "text": "5"}]},
                                                {"type": "text", "text": "Thanks."}]}]
    as_openai = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": "add", "arguments": json.dumps(use.input)}}]},
                       {"role": "tool", "tool_call_id": use.id, "content": "5"}, {"role": "user", "content": "Thanks."}]
    out = create(client, messages=turns, tools=TOOLS, max_tokens=12)
    ref = chat.create(model=NAME, messages=as_openai, tools=OPENAI_TOOLS, max_tokens=12, temperature=0,
                      extra_body=THINK_OFF)
    assert [b.type for b in out.content] == ["text"] and text(out) == ref.choices[0].message.content
    assert out.usage.input_tokens == ref.usage.prompt_tokens
    as_transformers = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": use.input}}]}] + as_openai[2:]
    ids = hf.apply_chat_template(as_transformers, tools=OPENAI_TOOLS, add_generation_prompt=True, return_dict=False,
                                 enable_thinking=False)
    assert "<tool_response>\n5\n</tool_response>" in hf.decode(ids)
    assert client.messages.count_tokens(model=NAME, messages=turns, tools=TOOLS).input_tokens == len(ids)


def test_a_last_assistant_turn_is_continued(llm, client, hf):
    """Prefill: the answer continues the last assistant turn, as LLM.generate continues transformers' rendering."""
    turns = ASK + [{"role": "assistant", "content": "The answer is"}]
    ids = hf.apply_chat_template(turns, continue_final_message=True, return_dict=False)
    alone = llm.generate([ids], pj.SamplingParams(max_tokens=8, temperature=0))[0]
    out = create(client, messages=turns, max_tokens=8)
    assert text(out) == alone.text and out.usage.input_tokens == len(ids)


def test_output_config_json_schema(client):
    out = create(client, messages=ASK, output_config={"format": {"type": "json_schema", "schema": WEATHER}})
    jsonschema.validate(json.loads(text(out)), WEATHER)


def test_api_key_headers(server):
    """x-api-key (what Anthropic's API takes, and what earlier releases of its client send for api_key) and
    Authorization: Bearer (this release sends api_key and auth_token so) both pass; none or a wrong key is 401."""
    url = server[0].url
    for auth in ({"default_headers": {"x-api-key": "sk-test"}}, {"api_key": "sk-test"}, {"auth_token": "sk-test"}):
        c = anthropic.Anthropic(base_url=url, max_retries=0, **auth)
        assert c.messages.count_tokens(model=NAME, messages=ASK).input_tokens > 0
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(model=NAME, max_tokens=4,
                                                                                          messages=ASK)
    body = json.dumps({"model": NAME, "max_tokens": 4, "messages": ASK}).encode()
    with pytest.raises(urllib.error.HTTPError) as raised:  # no key at all (the client refuses to send that)
        urllib.request.urlopen(urllib.request.Request(url + "/v1/messages", data=body), timeout=60)
    assert raised.value.code == 401  # answered by the guard before any route, in this API's error shape
    error = json.loads(raised.value.read())
    assert error["type"] == "error" and error["error"]["type"] == "authentication_error", error
    assert "API key" in error["error"]["message"]


@pytest.mark.parametrize("kw, named", [
    ({"extra_body": {"frequency_penalty": 0.5}}, "frequency_penalty"),  # unknown and output-changing
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"extra_body": {"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}}, "mcp_servers"),
    ({"container": "cntr_1"}, "container"),
    ({"output_config": {"effort": "high"}}, "output_config.effort"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "mul"}}, "tool_choice"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": "nope"}}}}]},
     "tools[0].input_schema"),
    ({"max_tokens": 100_000}, "max_tokens"),
    ({"extra_body": {"temperature": 1.5}}, "temperature"),
    ({"messages": ASK + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_none", "content": "5"}]}]}, "toolu_none"),
])
def test_refusals_are_400_naming_the_field(client, kw, named):
    kw = {"model": NAME, "max_tokens": 4, "messages": ASK} | kw
    with pytest.raises(anthropic.BadRequestError) as raised:
        client.messages.create(**kw)
    body = raised.value.body
    assert set(body) == {"type", "error"} and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error" and named in body["error"]["message"]


def test_unknown_model_is_404_in_anthropic_shape(client):
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model="claude-x", max_tokens=4, messages=ASK)
    assert raised.value.body["error"]["type"] == "not_found_error" and "claude-x" in raised.value.body["error"][
        "message"]


@pytest.mark.parametrize("calls", [
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 2,, "b"}}\n</tool_call>',  # a call, then one not JSON
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": [}}\n</tool_call>',  # only one not JSON
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 2',  # cut short by max_tokens
])
def test_a_malformed_call_under_auto_is_text_in_the_message_and_the_stream(calls):
    """tool_choice auto leaves the model free: a call whose input is not a JSON object becomes a text block (the call
    as written), never a 500 nor a delta Anthropic's client cannot parse. The stream, fed in small pieces and
    accumulated by the official client's own accumulator, gives exactly the non-streamed message's blocks."""
    from anthropic.lib.streaming._messages import accumulate_event

    from pocketjax.serve.http.anthropic_messages import Blocks, message
    from pocketjax.serve.http.tool_call_parser import ToolCallParser

    answer = "Sure." + calls
    whole = Blocks(ToolCallParser())
    whole.feed(answer)
    whole.finish()
    streamed = Blocks(ToolCallParser())
    events = [event for i in range(0, len(answer), 3) for event in streamed.feed(answer[i:i + 3])]
    events += streamed.finish()
    snapshot, bufs = None, {}
    for event in [{"type": "message_start", "message": message("msg_1", NAME, [], None, None, 1, 0)}, *events]:
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    strip = [{k: v for k, v in b.items() if k != "id"} for b in whole.content]
    assert [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"} for b in snapshot.content] == strip
    uses = [b["input"] for b in strip if b["type"] == "tool_use"]
    assert whole.calls == len(uses) and uses == [{"a": 2, "b": 3}, {}][:len(uses)]
    assert strip[0]["type"] == "text" and strip[0]["text"].startswith("Sure.")
    if calls.endswith("</tool_call>"):  # the last call is not JSON: text, as the model wrote it to its input's end
        last = calls[calls.rindex("<tool_call>"):]
        assert strip[-1]["type"] == "text" and last.startswith(strip[-1]["text"].removeprefix("Sure."))
        assert '"arguments": {' in strip[-1]["text"]
    else:
        assert strip[0]["text"] == "Sure."
