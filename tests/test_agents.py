"""Tool calling as agents and their libraries drive it, against the embedded model served over HTTP: the official
`openai` client (each grammar rule, streamed against non-streamed, the client's own stream accumulation), the
OpenAI Agents SDK's agent loop over chat completions and over the Responses API, and instructor's TOOLS mode.

References: jsonschema for every call's arguments (the tool's schema, closed), the non-streamed answer for the
streamed one, the same request with more tokens for one cut short, and the libraries' own parsing (the Agents SDK
runs the tool with the parsed arguments; instructor validates its pydantic model). The embedded model is small and
weak: it writes Python, never a call of its own, so every call here is forced (tool_choice) or put in its mouth by a
grammar (vLLM's structured_outputs extra); the agent's last turn ends at a stop string ("\\n\\n") rather than at
max_tokens, which the Responses model would report as an incomplete response."""
import json
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

import pocketjax as pj
from conftest import served
from pocketjax.serve.llm import DEFAULT_MODEL
from pocketjax.serve.http.tool_calls import MAX_PARALLEL_CALLS

pytestmark = [pytest.mark.skipif(not (DEFAULT_MODEL / "model.safetensors").exists(), reason="no embedded model"),
              pytest.mark.leg1_only]  # HTTP / host-side: the same under any JAX
NAME = "pocket-coder"
SLOTS, CONTEXT = 4, 128  # test_server's engine shape: a shared session reuses its compiled steps
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
CLOSED_ADD = {**ADD, "additionalProperties": False}  # what the grammar enforces: the schema closed
TOOLS = [{"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}},
         {"type": "function", "function": {"name": "ping", "parameters": {"type": "object", "properties": {}}}}]
ASK = [{"role": "user", "content": "add 2 and 3"}]
ADD_CHOICE = {"type": "function", "function": {"name": "add"}}


@pytest.fixture(scope="module")
def server_client():
    with pj.LLM(max_batch_size=SLOTS, max_seq_len=CONTEXT, prefill_chunk=32) as llm, served(llm) as (server, client):
        yield server, client


@pytest.fixture(scope="module")
def client(server_client):
    return server_client[1]


def chat(client, stream: bool = False, **kw) -> tuple[str | None, list[tuple[str, str]], str]:
    """(content, calls as (name, arguments), finish_reason) of a greedy chat completion; streamed, accumulated as
    OpenAI's clients do (content concatenated, each call's arguments appended by index), checking that a call's
    first delta carries its id, type and name and that no markup is ever content."""
    kw = {"model": NAME, "messages": ASK, "max_tokens": 80, "temperature": 0, "tools": TOOLS, **kw}
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, pieces, reason = "", {}, {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for call in choice.delta.tool_calls or []:
                if call.index not in calls:
                    assert call.id.startswith("call_") and call.type == "function" and call.function.name
                    calls[call.index], pieces[call.index] = [call.function.name, ""], 0
                calls[call.index][1] += call.function.arguments or ""
                pieces[call.index] += bool(call.function.arguments)
    assert "<tool_call>" not in content
    chat.pieces = [pieces[i] for i in sorted(pieces)]  # argument fragments per call, for the caller to check
    return content or None, [tuple(calls[i]) for i in sorted(calls)], reason


@pytest.mark.parametrize("parallel", [None, True, False])
def test_named_choice_is_exactly_one_call(client, parallel):
    """Whatever parallel_tool_calls says, a named tool_choice is one call to that tool, its arguments valid for the
    closed schema, then the end (finish_reason "tool_calls", no content); the stream sends the name first and the
    arguments in several fragments that add up to the non-streamed arguments, and the openai client's own stream
    helper accumulates the same call."""
    kw = {"tool_choice": ADD_CHOICE} | ({} if parallel is None else {"parallel_tool_calls": parallel})
    content, calls, reason = chat(client, **kw)
    assert content is None and reason == "tool_calls" and [name for name, _ in calls] == ["add"]
    jsonschema.validate(json.loads(calls[0][1]), CLOSED_ADD)
    assert chat(client, stream=True, **kw) == (content, calls, reason) and chat.pieces[0] > 1
    with client.chat.completions.stream(model=NAME, messages=ASK, max_tokens=80, temperature=0, tools=TOOLS,
                                        **kw) as stream:
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == calls


def test_required_choice(client):
    """"required": one call without parallel calls, then the end; with them, calls one after the other (the weak
    model repeats one until max_tokens here: that MAX_PARALLEL_CALLS bounds them and the answer then ends is
    test_tool_calls' grammar test, as 8 calls do not fit this context), streamed as they are not."""
    content, calls, reason = chat(client, tool_choice="required", parallel_tool_calls=False)
    assert content is None and len(calls) == 1 and reason == "tool_calls"
    ping = {"tools": TOOLS[1:], "tool_choice": "required", "max_tokens": 100}
    content, calls, reason = chat(client, **ping)
    assert content is None and 1 < len(calls) <= MAX_PARALLEL_CALLS and calls[0] == ("ping", "{}")
    assert chat(client, stream=True, **ping) == (content, calls, reason)


def test_a_forced_call_cut_by_max_tokens_is_text_and_replays(client):
    """Cut inside its arguments, the answer returns no call whose JSON never closed: its text as the model wrote it
    is the content, finish_reason "length"; a stream has sent the call's pieces before the cut and keeps them (a
    prefix of the whole call's arguments). Both answers come back as history (openai-agents sends the call with its
    unclosed arguments) and are answered, never refused. Cut before its name is complete: no call, no content."""
    _, [(_, whole)], _ = chat(client, tool_choice=ADD_CHOICE)
    content, calls, reason = chat(client, tool_choice=ADD_CHOICE, max_tokens=20)
    head = '<tool_call>\n{"name": "add", "arguments": '
    assert calls == [] and reason == "length" and content.startswith(head)
    cut = content[len(head):]
    assert whole.startswith(cut) and cut != whole
    assert chat(client, True, tool_choice=ADD_CHOICE, max_tokens=20) == (None, [("add", cut)], "length")
    for stream in (False, True):
        assert chat(client, stream, tool_choice=ADD_CHOICE, max_tokens=3) == (None, [], "length")
    replayed = {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": cut}}]}
    for turn in ([replayed, {"role": "tool", "tool_call_id": "call_1", "content": "5"}],
                 [{"role": "assistant", "content": content}]):
        history = ASK + turn + [{"role": "user", "content": "and?"}]
        assert chat(client, messages=history, tool_choice="none", max_tokens=2)[2] in ("stop", "length")


@pytest.mark.parametrize("stop", [["\n"], ['"', "}"], [", "]])
def test_stop_strings_never_cut_a_forced_call(client, stop):
    """A stop string the forced call holds ("\\n" before its JSON, a quote or a brace inside it) never cuts it: the
    answer is the call made without stops, streamed or not (it used to be no call, or broken JSON); "required"
    alike."""
    for choice in (ADD_CHOICE, "required"):
        whole = chat(client, tool_choice=choice, parallel_tool_calls=False)
        assert whole[2] == "tool_calls" and len(whole[1]) == 1
        assert choice != ADD_CHOICE or any(s in whole[1][0][1] or s == "\n" for s in stop)  # the call holds a stop
        for stream in (False, True):
            assert chat(client, stream, tool_choice=choice, parallel_tool_calls=False, stop=stop) == whole


def test_a_forced_tool_takes_an_output_format(client):
    """openai-agents sends an Agent's output type on every turn: a forced tool_choice with response_format is
    accepted and answered with the forced call (the format is for the text turns after it), streamed or not; the
    format still applies without the forced choice. vLLM's structured_outputs, a constraint for this very answer,
    stays a 400 naming it."""
    schema = {"type": "object", "properties": {"status": {"enum": ["done"]}}, "required": ["status"]}
    formats = [{"type": "json_schema", "json_schema": {"name": "done", "schema": schema, "strict": True}},
               {"type": "json_object"}]
    whole = chat(client, tool_choice=ADD_CHOICE)
    for response_format in formats:
        for stream in (False, True):
            assert chat(client, stream, tool_choice=ADD_CHOICE, response_format=response_format) == whole
    content, calls, _ = chat(client, tool_choice="auto", response_format=formats[0], max_tokens=20)
    assert json.loads(content) == {"status": "done"} and calls == []
    with pytest.raises(openai.BadRequestError) as raised:
        chat(client, tool_choice="required", extra_body={"structured_outputs": {"json": schema}})
    assert raised.value.body["param"] == "structured_outputs"


@pytest.mark.parametrize("arguments, calls", [('{"a": 1, "b": 2}', [("add", '{"a": 1, "b": 2}')]),
                                              ("oops", [])])
def test_auto_content_is_the_text_before_the_first_call(client, arguments, calls):
    """"auto": a grammar (vLLM's structured_outputs extra) puts text, a block and more text in the model's mouth:
    the content is the text before the block, as vLLM's hermes parser gives it; a block that does not parse is
    dropped, never content."""
    grammar = 'start: "Hi " "<tool_call>" ' + json.dumps('\n{"name": "add", "arguments": ' + arguments + '}\n') + \
        ' "</tool_call>" " bye"'
    for stream in (False, True):
        got = chat(client, stream, extra_body={"structured_outputs": {"grammar": grammar}})
        assert got == ("Hi ", calls, "tool_calls" if calls else "stop")


def test_legacy_functions_answer_with_function_call(client):
    """The deprecated functions / function_call fields: mapped to tools, answered in their own form
    (message.function_call, finish_reason "function_call"), streamed as delta.function_call pieces."""
    kw = dict(model=NAME, messages=ASK, max_tokens=80, temperature=0, functions=[TOOLS[0]["function"]],
              function_call={"name": "add"})
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    assert choice.message.content is None and choice.message.function_call.name == "add"
    jsonschema.validate(json.loads(choice.message.function_call.arguments), CLOSED_ADD)
    name, arguments, reason = "", "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        name += (delta.function_call.name or "") if delta.function_call else ""
        arguments += (delta.function_call.arguments or "") if delta.function_call else ""
        reason = chunk.choices[0].finish_reason or reason
    assert (name, arguments, reason) == ("add", choice.message.function_call.arguments, "function_call")
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(**kw, tools=TOOLS)
    assert raised.value.body["param"] == "tools"


class Done(pydantic.BaseModel):
    status: Literal["done"]


@pytest.mark.parametrize("output_type", [None, Done])
@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_agents_sdk_runs_a_tool_to_its_final_output(server_client, api, output_type):
    """The OpenAI Agents SDK's agent loop with a function tool, tool choice forced: the first turn calls `add`
    (the SDK parses the arguments and runs it), the SDK sends the result back and, its tool choice reset to auto
    after the call, the model's text is the final output. Over chat completions and over the Responses API (the
    SDK's default model)."""
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)  # no internet: nothing to export traces to
    seen = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        seen.append((a, b))
        return a + b

    server, _ = server_client
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = (OpenAIChatCompletionsModel if api == "chat_completions" else OpenAIResponsesModel)(NAME, client)
    # the stop string ends the free text turn (a forced call is never cut by it); with an output type, sent on both
    # turns with the forced tool, its schema ends the text turn
    agent = Agent(name="calculator", instructions="Add numbers with the add tool.", tools=[add], model=model,
                  output_type=output_type, model_settings=ModelSettings(
                      tool_choice="add", temperature=0, max_tokens=40, extra_body={"stop": ["\n\n"]}))
    result = Runner.run_sync(agent, "add 2 and 3", max_turns=3)
    assert len(seen) == 1 and all(isinstance(x, int) for x in seen[0])
    assert [type(item) for item in result.new_items] == [ToolCallItem, ToolCallOutputItem, MessageOutputItem]
    assert result.new_items[1].output == sum(seen[0])
    if output_type is None:
        assert isinstance(result.final_output, str) and "<tool_call>" not in result.final_output
    else:
        assert result.final_output == Done(status="done")
    assert len(result.raw_responses) == 2


class Sum(pydantic.BaseModel):
    a: int = pydantic.Field(ge=0, le=9)
    b: int
    label: str = pydantic.Field(max_length=5)


def test_instructor_tools_mode_returns_a_valid_object(client):
    """instructor's TOOLS mode (a named tool_choice; its schema says nothing of other keys): the call parses into
    the pydantic model at the first try (no retries)."""
    import instructor

    patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    value, raw = patched.chat.completions.create_with_completion(
        model=NAME, response_model=Sum, messages=ASK, max_tokens=80, temperature=0, max_retries=0)
    assert isinstance(value, Sum) and raw.choices[0].finish_reason == "tool_calls"
    assert value.model_dump() == json.loads(raw.choices[0].message.tool_calls[0].function.arguments)
