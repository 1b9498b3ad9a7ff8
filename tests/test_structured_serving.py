"""Structured outputs and tool calls end to end: a random-weight Qwen3-shaped checkpoint with the official Qwen3
tokenizer (151,936-row vocabulary, its chat template with tools) served over HTTP and driven by the official
`openai` client. References: `jsonschema` for every constrained answer, pydantic through `chat.completions.parse`,
the non-streamed answer for the streamed one, and transformers' apply_chat_template for the tool conversation's
prompt (the same prompt ids must give the same greedy answer through `LLM.generate`)."""
import json
import re
import threading

import jsonschema
import openai
import pydantic
import pytest

import pocketjax as pj
from conftest import oracle, served

pytestmark = pytest.mark.leg1_only  # HTTP / host-side: the same under any JAX (.ci/run's leg 2 runs the engine's tests)

transformers = oracle("transformers")

NAME = "qwen3"
PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "role", "tags", "address"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "role": {"enum": ["admin", "user", "guest"]},
                         "score": {"type": "number", "minimum": -1, "maximum": 1},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
                         "address": {"type": "object", "additionalProperties": False, "required": ["city"],
                                     "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "zip": {"type": "string", "pattern": "^[0-9]{4}$"}}}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}}}
ADD = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
       "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                      "b": {"type": "integer", "minimum": -99, "maximum": 99}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "Weather in Zürich, and 2 + 3?"}]
BUDGET = 96  # tokens per answer: every schema above fits well within it


@pytest.fixture(scope="module")
def llm(qwen_checkpoint):
    with pj.LLM(str(qwen_checkpoint("qwen3")), max_batch_size=2, max_seq_len=512) as llm:
        yield llm


@pytest.fixture(scope="module")
def client(llm):
    with served(llm, model_name=NAME) as (_, client):
        yield client


def chat(client, stream: bool = False, **kw):
    """A chat completion's (content, tool calls as (name, arguments) pairs, finish_reason), streamed or not; a
    streamed one is accumulated as OpenAI's clients do (content concatenated, arguments appended per index)."""
    kw = {"model": NAME, "messages": ASK, "max_tokens": BUDGET, "temperature": 0, **kw}
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        calls = [(c.function.name, c.function.arguments, c.id) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason
    content, calls, reason = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index not in calls and call.function.name and call.type == "function"
                calls[call.index] = [call.function.name, call.function.arguments or "", call.id]
            else:
                calls[call.index][1] += call.function.arguments
        reason = chunk.choices[0].finish_reason or reason
    if kw.get("tools") and kw.get("tool_choice") != "none":
        assert "<tool_call>" not in content  # a call's markup never reaches the content
    return content or None, [tuple(calls[i]) for i in sorted(calls)], reason


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_format(client, stream):
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    content, calls, reason = chat(client, stream, response_format=response_format)
    jsonschema.validate(json.loads(content), PERSON)
    assert reason == "stop" and calls == []
    if stream:
        assert content == chat(client, response_format=response_format)[0]  # greedy: the same answer either way
    else:  # sampled: two seeds in one batch, each valid
        out = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=BUDGET, temperature=1.0, seed=7,
                                             n=2, response_format=response_format)
        answers = [json.loads(c.message.content) for c in out.choices]
        for answer in answers:
            jsonschema.validate(answer, PERSON)
        assert answers[0] != answers[1]


def test_json_object_response_format(client):
    """Any object: random weights may write one long string (cut by max_tokens), so two seeds are sampled and every
    answer that ended must be an object (and one must have ended)."""
    out = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=BUDGET, temperature=1.0, seed=0, n=2,
                                         response_format={"type": "json_object"})
    ended = [c.message.content for c in out.choices if c.finish_reason == "stop"]
    assert ended and all(isinstance(json.loads(text), dict) for text in ended)
    assert all(c.message.content.startswith("{") for c in out.choices)
    streamed = chat(client, True, response_format={"type": "json_object"}, max_tokens=24)
    assert streamed == chat(client, response_format={"type": "json_object"}, max_tokens=24)


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    population: int = pydantic.Field(ge=0, le=10**7)
    capital: bool


def test_parse_with_a_pydantic_model(client):
    out = client.chat.completions.parse(model=NAME, messages=ASK, max_tokens=BUDGET, temperature=0,
                                        response_format=City)
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed == City.model_validate_json(out.choices[0].message.content)


def test_responses_text_format(client):
    """/v1/responses spells response_format as text.format: the openai client's responses.parse reads it back."""
    out = client.responses.parse(model=NAME, input=ASK[0]["content"], max_output_tokens=BUDGET, temperature=0,
                                 text_format=City)
    assert isinstance(out.output_parsed, City) and out.text.format.type == "json_schema"
    assert out.output_parsed == City.model_validate_json(out.output_text)
    schema = {**City.model_json_schema(), "additionalProperties": False}  # what parse sends: strict
    text = "".join(e.delta for e in client.responses.create(
        model=NAME, input=ASK[0]["content"], max_output_tokens=BUDGET, temperature=0, stream=True,
        text={"format": {"type": "json_schema", "name": "City", "schema": schema}}) if e.type.endswith(".delta"))
    assert text == out.output_text


def check_calls(calls, names):
    for name, arguments, call_id in calls:
        assert name in names and re.fullmatch(r"call_[0-9a-f]{24}", call_id)
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_is_enforced(client, stream):
    content, calls, reason = chat(client, stream, tools=TOOLS, tool_choice="required")
    assert content is None and reason == "tool_calls" and calls
    check_calls(calls, SCHEMAS)
    if stream:
        assert [c[:2] for c in calls] == [c[:2] for c in chat(client, tools=TOOLS, tool_choice="required")[1]]
    single = chat(client, stream, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    assert len(single[1]) == 1 and single[2] == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_is_enforced(client, stream):
    for name in SCHEMAS:
        choice = {"type": "function", "function": {"name": name}}
        content, calls, reason = chat(client, stream, tools=TOOLS, tool_choice=choice)
        assert content is None and reason == "tool_calls" and {c[0] for c in calls} == {name}
        check_calls(calls, [name])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_what_the_model_writes(client, stream):
    """Random weights write no call of their own: a grammar (vLLM's structured_outputs extra) makes the answer text
    around one call, and "auto" must find it; the content is the text before it (vLLM's hermes parser)."""
    grammar = ('start: "Checking." <tool_call> "\\n{\\"name\\": \\"add\\", \\"arguments\\": " args "}\\n" '
               '</tool_call> " Done."\nargs: %json ' + json.dumps({**ADD, "x-guidance": {"whitespace_flexible": False}}))
    content, calls, reason = chat(client, stream, tools=TOOLS, extra_body={"structured_outputs": {"grammar": grammar}})
    assert content == "Checking." and [c[0] for c in calls] == ["add"] and reason == "tool_calls"
    check_calls(calls, ["add"])
    text = chat(client, stream, tools=TOOLS, tool_choice="none", extra_body={"structured_outputs": {"grammar": grammar}})
    assert text[1] == [] and "<tool_call>" in text[0] and text[2] == "stop"  # "none" parses nothing


def test_three_turn_tool_conversation(llm, client, qwen_checkpoint):
    """user -> assistant tool call -> tool result -> the answer: the prompt is transformers' rendering of the
    conversation (the template reads arguments as an object), so the served greedy answer is LLM.generate's."""
    first = client.chat.completions.create(model=NAME, messages=ASK, max_tokens=BUDGET, temperature=0, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           parallel_tool_calls=False)
    call = first.choices[0].message.tool_calls[0]
    conversation = ASK + [first.choices[0].message.model_dump(exclude_none=True),  # content None: left out
                          {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 12}'}]
    hf = transformers.AutoTokenizer.from_pretrained(str(qwen_checkpoint("qwen3")))
    as_transformers = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": json.loads(call.function.arguments)}}]},
        conversation[-1]]
    ids = hf.apply_chat_template(as_transformers, tools=TOOLS, add_generation_prompt=True, return_dict=False)
    assert "<tool_response>\n{\"temperature\": 12}\n</tool_response>" in hf.decode(ids)
    alone = llm.generate([ids], pj.SamplingParams(max_tokens=12, temperature=0))[0]
    for choice in ("none", "auto"):
        out = client.chat.completions.create(model=NAME, messages=conversation, tools=TOOLS, tool_choice=choice,
                                             max_tokens=12, temperature=0)
        assert out.usage.prompt_tokens == len(ids)
        content, calls = out.choices[0].message.content, out.choices[0].message.tool_calls
        if choice == "none" or "<tool_call>" not in alone.text:
            assert content == (alone.text or None) and not calls


def test_completions_take_the_same_constraints(client):
    out = client.completions.create(model=NAME, prompt="The code is", max_tokens=12, temperature=1.0, seed=3, n=2,
                                    extra_body={"structured_outputs": {"regex": "[A-Z]{2}-[0-9]{3}"}})
    assert all(re.fullmatch("[A-Z]{2}-[0-9]{3}", c.text) and c.finish_reason == "stop" for c in out.choices)
    out = client.completions.create(model=NAME, prompt="Pick:", max_tokens=12, temperature=1.0, seed=1, n=2,
                                    extra_body={"structured_outputs": {"choice": ["rouge", "vert", "bleu ciel"]}})
    assert all(c.text in ("rouge", "vert", "bleu ciel") for c in out.choices)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=NAME, prompt="{", max_tokens=BUDGET, temperature=0, stream=True,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}}))
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("kw, param", [
    ({"extra_body": {"structured_outputs": {"regex": "(unclosed"}}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": PERSON}}}, "response_format"),
    ({"extra_body": {"guided_json": PERSON}}, "guided_json"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "extra_body": {"structured_outputs": {"json_object": True}}},
     "structured_outputs"),  # a forced tool takes response_format (for later turns), not a second constraint
    ({"extra_body": {"tools": "get_weather"}}, "tools"),
])
def test_bad_constraints_and_tools_are_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=NAME, messages=ASK, max_tokens=4, **kw)
    assert raised.value.status_code == 400 and raised.value.body["param"] == param
    assert chat(client, max_tokens=2)[2] == "length"  # and the server goes on serving


def test_slow_schemas_hold_up_no_other_request(llm, monkeypatch):
    """Constraints compile on the server's grammar pool, templates and tokens on its host pool: with every grammar
    thread held by a slow schema, a request without one is still rendered, submitted and answered; the slow ones
    are answered once their compiles end."""
    from concurrent.futures import ThreadPoolExecutor

    from pocketjax.serve.http.context import GRAMMAR_WORKERS

    release, entered = threading.Event(), threading.Semaphore(0)
    grammar_text = pj.Structured.grammar_text

    def slow(self):
        if self.json_schema is not None and "slow" in self.json_schema:
            entered.release()
            release.wait(120)
        return grammar_text(self)

    monkeypatch.setattr(pj.Structured, "grammar_text", slow)
    schemas = [{"type": "object", "additionalProperties": False, "required": [f"slow{i}"],
                "properties": {f"slow{i}": {"type": "integer", "minimum": 0, "maximum": 9}}}
               for i in range(GRAMMAR_WORKERS)]
    with served(llm, model_name=NAME) as (_, client), ThreadPoolExecutor(GRAMMAR_WORKERS) as threads:
        assert chat(client, max_tokens=2)[2] == "length"  # warm: the check below times a request, not a compile
        slow_answers = [threads.submit(chat, client, max_tokens=BUDGET, response_format={
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}) for schema in schemas]
        try:
            assert all(entered.acquire(timeout=120) for _ in schemas)  # every grammar thread is compiling
            quick = client.with_options(timeout=60)
            assert chat(quick, max_tokens=2)[2] == "length"
            assert not any(answer.done() for answer in slow_answers)
        finally:
            release.set()
        for schema, answer in zip(schemas, slow_answers):
            jsonschema.validate(json.loads(answer.result(timeout=300)[0]), schema)
