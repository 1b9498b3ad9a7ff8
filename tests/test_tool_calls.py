"""Tool calls: the Hermes <tool_call> parser (whole and streamed), the checked tools, the enforcing grammar and the
messages templates read. References: answers built from known calls and content, llguidance matching the text the
official Qwen3 template writes for a past call, and transformers' rendering (tests/test_tokenizer.py)."""
import json
import random
import re
import sys

import numpy as np
import pytest

from pocketjax.serve.http.api_error import APIError
from pocketjax.serve.http.tool_call_parser import END, START, Arguments, ToolCall, ToolCallParser, parse_tool_calls
from pocketjax.serve.http.tool_calls import (MAX_PARALLEL_CALLS, close_schema, legacy_tool_request, template_messages,
                                             tool_request)

pytestmark = pytest.mark.leg1_only  # HTTP / host-side: the same under any JAX (.ci/run's leg 2 runs the engine's tests)

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Météo", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"], "additionalProperties": False}}}]


def block(name: str, arguments: dict) -> str:
    """A call as Qwen's chat template writes it (tojson: json.dumps without ensure_ascii)."""
    return f'{START}\n{{"name": "{name}", "arguments": {json.dumps(arguments, ensure_ascii=False)}}}\n{END}'


CALLS = [("get_weather", {"city": "Zürich"}), ("add", {"a": 1, "b": -2}),
         ("get_weather", {"city": "a \"quoted\" {brace} </tool_call>? \\ 😀", "unit": "c"})]


def parse(text: str, parser: ToolCallParser | None = None) -> tuple[str | None, list[ToolCall]]:
    return parse_tool_calls(parser or ToolCallParser(), text)


def streamed(text: str, cuts: list[int], max_calls: int | None = None) -> tuple[str, list, list]:
    """What a stream of `text`, cut at `cuts`, sends: its content, its calls as OpenAI's clients accumulate them
    ((id, name, arguments) per index, arguments appended piece by piece), and every event in order."""
    parser, events = ToolCallParser(max_calls), []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        events += parser.feed(text[a:b])
    events += parser.finish()
    calls: dict[int, list] = {}
    for event in events:
        if isinstance(event, ToolCall):
            assert event.index not in calls  # the head comes once, before its arguments
            calls[event.index] = [event.id, event.name, ""]
        elif isinstance(event, Arguments):
            calls[event.index][2] += event.text
    return "".join(e for e in events if isinstance(e, str)), [tuple(calls[i]) for i in sorted(calls)], events


def whole(calls) -> list[tuple]:
    return [(c.id, c.name, c.arguments) for c in calls]


@pytest.mark.parametrize("before, between, after", [("", "\n", ""), ("Let me check.\n", "\n\n", "\nDone."),
                                                     ("<tool_c", " and ", "<tool_call")])
def test_content_is_the_text_before_the_first_call(before, between, after):
    """vLLM's hermes parser: content is what comes before the first <tool_call>; text between and after is dropped."""
    text = before + between.join(block(n, a) for n, a in CALLS) + after
    content, calls = parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    assert [c.index for c in calls] == [0, 1, 2] and len({c.id for c in calls}) == 3
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) and c.complete for c in calls)
    assert content == (before if before.strip() else None)
    assert calls[0].arguments == '{"city": "Zürich"}'  # the model's own JSON text, non-ASCII kept
    assert calls[2].arguments == json.dumps(CALLS[2][1], ensure_ascii=False)  # </tool_call> inside a string


def test_streamed_answer_equals_the_whole_answer_at_any_cut():
    """Every cut point, then random cuts: the same content and calls (ids aside), the head of each call before its
    arguments, and a call's arguments in as many pieces as the text was cut inside them (incremental)."""
    rng = random.Random(0)
    text = "Sure <tool_call" + block(*CALLS[0]) + " mid " + block(*CALLS[2]) + "\n<tool_call>\nnot json\n</tool_call>!"
    whole_content, whole_calls = parse(text)
    assert whole_content == "Sure <tool_call" and [c.name for c in whole_calls] == ["get_weather"] * 2
    inside = text.index('{"city": "a')  # the second call's arguments start here
    for trial in range(300):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, 12)))
        if trial < len(text) - 1:
            cuts = [trial + 1]
        content, calls, events = streamed(text, cuts)
        assert content == whole_content
        assert [c[1:] for c in calls] == [c[1:] for c in whole(whole_calls)]
        assert not any(isinstance(e, str) and "<tool_call>" in e for e in events)  # markup is never content
        if cuts == [inside + 5]:  # a cut inside the arguments: two pieces
            assert [e.text for e in events if isinstance(e, Arguments) and e.index == 1] == [
                whole_calls[1].arguments[:5], whole_calls[1].arguments[5:]]


def test_blocks_that_are_not_calls_are_dropped():
    """A block that is not a call is neither a call nor content (vLLM's streamed parser drops it too; its
    non-streamed parser would return the whole answer, markup included, as content)."""
    bad = [f"{START}\nnot json\n{END}", f'{START}{{"name": 3, "arguments": {{}}}}{END}',
           f'{START}{{"name": "f", "arguments": "[1]"}}{END}', f'{START}{{"name": "f", "args": {{}}}}{END}',
           f"{START}[1, 2]{END}", f"{START}{START}"]
    for text in bad:
        assert parse("x " + text) == ("x ", [])
        assert parse(text + block(*CALLS[1]))[0] is None
        assert [c.name for c in parse(text + block(*CALLS[1]))[1]] == ["add"]
    _, calls = parse(f'{START}{{"arguments": {{"a": 1}}, "name": "f", "id": 7}}{END}')  # other layouts
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]
    _, calls = parse(f'{START}{{"name": "f", "arguments": {{"a": 1}}, "id": 7}}{END}')
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]
    assert parse("  \n") == ("  \n", []) and parse("\n" + block(*CALLS[1]))[0] is None


def test_an_answer_cut_inside_a_block():
    """max_tokens inside a call's arguments: the whole answer has no call whose JSON never closed, its text as the
    model wrote it is content (after the content before the first call, and whatever the cut); a stream has sent
    the call's pieces before the cut is known and keeps them; cut before its name is complete, there is no call."""
    full = block(*CALLS[1])
    content, calls = parse(full[:-len(END)])  # the JSON was complete: a whole call
    assert content is None and [(c.name, c.arguments, c.complete) for c in calls] == [("add", '{"a": 1, "b": -2}',
                                                                                    True)]
    cut = full[:full.index('"b"') + 2]
    for at in range(len(cut) + 1):  # any streaming cut: the parser's text of the block is what the model wrote
        assert parse(cut) == parse(cut, ToolCallParser(calls_only=True)) == (cut, [])
        parser = ToolCallParser()
        events = parser.feed(cut[:at]) + parser.feed(cut[at:]) + parser.finish()
        assert [(c.arguments, c.complete, c.written) for c in parser.calls] == [('{"a": 1, "b', False, cut)]
    content, calls, _ = streamed(cut, [20, 45])
    assert content == "" and [c[1:] for c in calls] == [("add", '{"a": 1, "b')]
    content, calls = parse("Hi " + block(*CALLS[0]) + "\n " + cut)
    assert content == "Hi " + cut and [(c.name, c.complete) for c in calls] == [("get_weather", True)]
    unclosed = full[:full.index(', "b"')] + "\n"  # the end tag where the arguments were still open
    content, calls = parse(unclosed + END + "\n" + full)
    assert content == unclosed and [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1, "b": -2}')]
    assert parse("Hi " + full[:len(START) + 12]) == ("Hi ", [])
    assert parse("Hi <tool") == ("Hi <tool", [])  # "auto": a tag cut short is text, as vLLM leaves it
    assert parse("<tool", ToolCallParser(calls_only=True)) == (None, [])  # a forced call cut short is no content


def test_max_calls_drops_the_blocks_after_it():
    text = "\n".join(block(*call) for call in CALLS)
    assert [c.name for c in parse(text, ToolCallParser(max_calls=1))[1]] == ["get_weather"]
    assert [c[1] for c in streamed(text, [30, 100], max_calls=2)[1]] == ["get_weather", "add"]


@pytest.mark.parametrize("tools, choice, message", [
    ([], None, "non-empty list"),
    (["f"], None, "tools[0] must be"),
    ([{"type": "retrieval"}], None, "tools[0] must be"),
    ([{"type": "function", "function": {"description": "no name"}}], None, "function.name"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "function.name"),
    ([{"type": "function", "function": {"name": "f"}}] * 2, None, "given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "parameters must be"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}], None, "compiles"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}], None, "compiles"),
    ([{"type": "function", "function": {"name": "f", "params": {}}}], None, "unknown field"),
    ([{"type": "function", "function": {"name": "f"}, "extra": 1}], None, "unknown field"),
])
def test_malformed_tools_are_400_naming_tools(tools, choice, message):
    with pytest.raises(APIError, match=re.escape(message)) as raised:
        tool_request(tools, choice, None)
    assert raised.value.status == 400 and raised.value.param == "tools"


def test_tools_without_llguidance_are_400_saying_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)  # `import llguidance` raises ImportError
    with pytest.raises(APIError, match=r"pip install 'llguidance") as raised:
        tool_request(TOOLS, "auto", None)
    assert raised.value.status == 400 and raised.value.param == "tools"


@pytest.mark.parametrize("choice, message", [
    ("sometimes", "tool_choice must be"),
    ({"type": "function", "function": {"name": "nope"}}, "not one of the tools"),
    ({"type": "function"}, "tool_choice must be"),
    ({"function": {"name": "add"}}, "tool_choice must be"),
])
def test_malformed_tool_choice_is_400_naming_it(choice, message):
    with pytest.raises(APIError, match=message) as raised:
        tool_request(TOOLS, choice, None)
    assert raised.value.param == "tool_choice"
    with pytest.raises(APIError, match="needs tools"):
        tool_request(None, "required", None)


def test_tool_choices():
    assert tool_request(None, None, None) is None and tool_request(None, "none", None) is None
    auto = tool_request(TOOLS, None, None)
    assert (auto.choice, auto.enforced, auto.parsed, auto.parallel, auto.max_calls) == ("auto", False, True, True,
                                                                                       None)
    assert auto.tools == TOOLS and auto.parameters["get_weather"] == WEATHER
    none = tool_request(TOOLS, "none", None)
    assert (none.enforced, none.parsed) == (False, False) and none.tools == TOOLS  # still rendered, as vLLM does
    named = tool_request(TOOLS, {"type": "function", "function": {"name": "add"}}, None)
    assert (named.choice, named.enforced, named.parallel, named.max_calls) == ("add", True, True, 1)
    assert tool_request(TOOLS, "required", None).max_calls == MAX_PARALLEL_CALLS
    assert tool_request(TOOLS, "required", False).max_calls == tool_request(TOOLS, "auto", False).max_calls == 1


def test_schemas_are_closed_unless_they_allow_more():
    """Objects that list properties get additionalProperties: false at any depth (vLLM's default backend refuses
    unlisted keys); a schema's own additionalProperties, free-form objects and allOf branches are left as given."""
    schema = {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "number"}}},
        "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"}}}},
        "extra": {"type": "object", "properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
        "free": {"type": "object"},
        "either": {"anyOf": [{"type": "object", "properties": {"b": {}}}, {"type": "null"}]},
        "both": {"allOf": [{"type": "object", "properties": {"c": {}}}]}},
        "$defs": {"D": {"type": "object", "properties": {"d": {}}}}}
    closed = close_schema(schema)
    props = closed["properties"]
    assert closed["additionalProperties"] is False and props["point"]["additionalProperties"] is False
    assert props["tags"]["items"]["additionalProperties"] is False
    assert props["either"]["anyOf"][0]["additionalProperties"] is False
    assert closed["$defs"]["D"]["additionalProperties"] is False
    assert props["extra"]["additionalProperties"] == {"type": "integer"} and props["free"] == {"type": "object"}
    assert props["both"] == schema["properties"]["both"] and "additionalProperties" not in schema  # input untouched
    named = tool_request([{"type": "function", "function": {"name": "f", "parameters": schema}}], "required", None)
    assert named.parameters["f"] == closed


@pytest.mark.parametrize("functions, call, message, param", [
    ([], None, "non-empty list", "functions"),
    ([{"name": "f", "params": {}}], None, "unknown field", "functions"),
    ([{"name": "f"}], {"name": "g"}, "function_call must be", "function_call"),
    ([{"name": "f"}], "required", "function_call must be", "function_call"),
])
def test_malformed_legacy_functions_are_400_naming_them(functions, call, message, param):
    with pytest.raises(APIError, match=message) as raised:
        legacy_tool_request(functions, call)
    assert raised.value.param == param


def test_legacy_functions_map_to_tools_and_answer_in_the_legacy_form():
    """OpenAI's deprecated functions / function_call: the same tools and grammar, one call at most, the answer's
    call as message.function_call and finish_reason "function_call" (as OpenAI answered them)."""
    functions = [tool["function"] for tool in TOOLS]
    legacy = legacy_tool_request(functions, {"name": "add"})
    assert (legacy.tools, legacy.choice, legacy.max_calls, legacy.legacy) == (TOOLS, "add", 1, True)
    assert legacy.grammar(True) == tool_request(TOOLS, {"type": "function", "function": {"name": "add"}},
                                                False).grammar(True)
    message, calls = legacy_tool_request(functions, "auto").answer("Hm " + block(*CALLS[1]) + block(*CALLS[0]))
    assert message == {"role": "assistant", "content": "Hm ", "function_call": {"name": "add",
                                                                              "arguments": '{"a": 1, "b": -2}'}}
    assert calls == 1 and legacy.finish_reason("stop", calls) == "function_call"
    parser = legacy.parser()
    deltas = [legacy.delta(e) for e in parser.feed(block(*CALLS[1])[:40]) + parser.feed(block(*CALLS[1])[40:])]
    assert deltas == [{"function_call": {"name": "add", "arguments": ""}},
                      {"function_call": {"arguments": '{"a": 1, "b": -2}'}}]
    assert legacy_tool_request(functions, None).choice == "auto"
    modern = tool_request(TOOLS, "required", None)
    assert modern.finish_reason("stop", 2) == "tool_calls" and modern.finish_reason("length", 2) == "length"
    history = template_messages([{"role": "assistant", "content": None, "function_call": {
        "name": "add", "arguments": '{"a": 1}'}}, {"role": "function", "name": "add", "content": "3"}])
    assert history[0]["tool_calls"] == [{"id": "call_add", "type": "function",
                                         "function": {"name": "add", "arguments": {"a": 1}}}]
    assert history[1] == {"role": "tool", "tool_call_id": "call_add", "name": "add", "content": "3"}


@pytest.fixture(scope="module")
def qwen3(qwen_checkpoint):
    """(pocketjax's Tokenizer, llguidance's tokenizer) of the official Qwen3 tokenizer."""
    from llguidance import LLTokenizer

    from pocketjax.serve.tokenizer import Tokenizer

    tok = Tokenizer.from_folder(qwen_checkpoint("qwen3"))
    return tok, LLTokenizer(tok.backend.to_str(), n_vocab=151936, eos_token=tok.eos_token_id)


def accepts(ll, grammar: str, ids: list[int]) -> bool:
    from llguidance import LLMatcher

    matcher = LLMatcher(ll, LLMatcher.grammar_from_lark(grammar), log_level=0)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_grammar_allows_what_the_template_writes_and_nothing_else(qwen3):
    tok, ll = qwen3
    calls = [{"type": "function", "function": {"name": n, "arguments": json.dumps(a)}} for n, a in CALLS[:2]]
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=TOOLS)
    rendered = tok.apply_chat_template(template_messages([{"role": "user", "content": "hi"},
                                                          {"role": "assistant", "content": None, "tool_calls": calls}]),
                                       tools=TOOLS, add_generation_prompt=False)
    # the answer as the template shows it (Qwen3's shows the last one after an empty thought)
    answer = rendered[len(prompt):].removesuffix("<|im_end|>\n").removeprefix("<think>\n\n</think>\n\n")
    assert answer == block(*CALLS[0]) + "\n" + block(*CALLS[1])
    ids = tok.encode(answer)
    assert START not in tok.decode([i for i in ids if i != tok.token_id(START)])  # the tag is one token
    required = tool_request(TOOLS, "required", None).grammar(special_tags=True)
    assert accepts(ll, required, ids)
    assert parse(tok.decode(ids))[1][1].arguments == '{"a": 1, "b": -2}'
    single = tool_request(TOOLS, "required", False).grammar(special_tags=True)
    assert not accepts(ll, single, ids) and accepts(ll, single, tok.encode(block(*CALLS[0])))
    named = tool_request(TOOLS, {"type": "function", "function": {"name": "add"}}, None).grammar(special_tags=True)
    assert not accepts(ll, named, tok.encode(block(*CALLS[0]))) and accepts(ll, named, tok.encode(block(*CALLS[1])))
    for wrong in [("get_weather", {"town": "Paris"}), ("get_weather", {"city": "x", "unit": "k"}),
                  ("add", {"a": 1.5, "b": 2}), ("mul", {"a": 1, "b": 2})]:
        assert not accepts(ll, required, tok.encode(block(*wrong)))
    spelled = tool_request(TOOLS, "required", None).grammar(special_tags=False)  # for vocabularies without the tags
    text = block(*CALLS[1])
    spelled_out = tok.encode("<") + tok.encode(text[1:-len(END)]) + tok.encode("<") + tok.encode(END[1:])
    assert tok.decode(spelled_out) == text and tok.token_id(START) not in spelled_out
    assert accepts(ll, spelled, spelled_out) and not accepts(ll, spelled, tok.encode(text))


def matcher_after(ll, grammar: str, ids: list[int]):
    from llguidance import LLMatcher

    matcher = LLMatcher(ll, LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert matcher.try_consume_tokens(ids) == len(ids)
    return matcher


def allowed(matcher) -> list[int]:
    """The tokens `matcher` allows next."""
    return np.flatnonzero(np.frombuffer(matcher.compute_logit_bias(), dtype=np.uint8)).tolist()


def test_grammar_ends_the_answer_after_the_last_call(qwen3):
    """A named choice: exactly one call whatever parallel_tool_calls says, then only the end of the answer; no
    whitespace before the first call or after the last; "required" with parallel calls: MAX_PARALLEL_CALLS at
    most."""
    tok, ll = qwen3
    one, add = tok.encode(block(*CALLS[0])), tok.encode(block(*CALLS[1]))
    for parallel in (None, True, False):
        named = tool_request(TOOLS, {"type": "function", "function": {"name": "add"}}, parallel).grammar(True)
        after = matcher_after(ll, named, add)
        assert after.is_accepting() and not accepts(ll, named, add + tok.encode("\n") + add)
        assert allowed(after) == [tok.eos_token_id]  # the answer ends
    required = tool_request(TOOLS, "required", None).grammar(True)
    for ws in (" ", "\n", "\n\n"):
        assert not accepts(ll, required, tok.encode(ws) + one) and not accepts(ll, required, one + tok.encode(ws))
    calls = one
    for n in range(2, MAX_PARALLEL_CALLS + 2):
        calls = calls + tok.encode("\n") + add
        assert accepts(ll, required, calls) == (n <= MAX_PARALLEL_CALLS), n
    last = matcher_after(ll, required, tok.encode("\n".join([block(*CALLS[0])] * MAX_PARALLEL_CALLS)))
    assert allowed(last) == [tok.eos_token_id]


def test_grammar_closes_open_schemas(qwen3):
    """A parameters schema that does not forbid other keys is closed (the key a weak model adds forever is refused);
    one that allows them keeps allowing them."""
    tok, ll = qwen3
    open_add = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    extra = tok.encode(block("f", {"a": 1, "zz": 2}))
    for schema, allowed in [(open_add, False), ({**open_add, "additionalProperties": True}, True),
                            ({**open_add, "additionalProperties": {"type": "integer"}}, True)]:
        tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
        grammar = tool_request(tools, "required", None).grammar(True)
        assert accepts(ll, grammar, tok.encode(block("f", {"a": 1}))) and accepts(ll, grammar, extra) == allowed


def test_template_messages_turn_openai_calls_into_template_form():
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, "é"]}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    out = template_messages(messages)
    assert out[1]["content"] == "" and out[1]["tool_calls"][0]["function"]["arguments"] == {"x": [1, "é"]}
    assert out[0] is messages[0] and out[2] is messages[2] and messages[1]["content"] is None  # input untouched
    for arguments in ('{"a": 1, "b', "[1]", "oops"):  # a call cut short, replayed: the string it is
        replayed = [{**messages[1], "tool_calls": [{"type": "function", "function": {"name": "f",
                                                                                     "arguments": arguments}}]}]
        assert template_messages(replayed)[0]["tool_calls"][0]["function"]["arguments"] == arguments
    bad = [{**messages[1], "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": [1]}}]}]
    with pytest.raises(APIError, match="must be a string") as raised:
        template_messages(bad)
    assert raised.value.param == "messages"


def test_a_replayed_call_cut_short_renders_as_written(qwen3):
    """A client sends back our own answer cut inside a call's arguments: Qwen3's template writes the arguments as
    the text they are, so the prompt holds the call exactly as the model wrote it."""
    tok, _ = qwen3
    cut = '{"a": 1, "b'
    messages = template_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                  "tool_calls": [{"id": "c", "type": "function", "function": {"name": "add",
                                                                                              "arguments": cut}}]},
                                  {"role": "tool", "tool_call_id": "c", "content": "?"}])
    rendered = tok.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True)
    assert f'{START}\n{{"name": "add", "arguments": {cut}}}\n{END}' in rendered


def test_tool_choice_none_never_samples_the_call_tag(qwen3):
    """tool_choice "none" still renders the tools, so the model may begin a call that nothing parses: its sampling
    bans <tool_call> (Qwen's tokenizer: that one token, cleared in the mask at every step) beside the request's own
    bad words; "auto" and a request constraining its own answer (its grammar's word) ban nothing."""
    from pocketjax.engine.processors import limits_of
    from pocketjax.serve.http.openai_protocol import ChatCompletionRequest

    tok, _ = qwen3

    def sampling(**fields):
        body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}],
                                                     "tools": TOOLS, **fields})
        structured, _ = body.constraint()
        return body.sampling(8, structured=structured, tools=body.tool_request())

    none = sampling(tool_choice="none", bad_words=["zz"])
    assert none.bad_words == ("zz", START)
    limits = limits_of(none, 151936, [tok.eos_token_id], tok)
    allowed = np.unpackbits(limits.static.view(np.uint8), bitorder="little")
    assert allowed[tok.token_id(START)] == 0 and allowed[tok.token_id(END)] == 1 and allowed.sum() < 151936
    assert sampling(tool_choice="auto").bad_words == ()
    assert sampling(tool_choice="none", structured_outputs={"regex": "<tool_call>"}).bad_words == ()


def test_forced_calls_take_no_stops():
    """A grammar-forced answer is calls: no stop string or stop token id is looked for in it (one inside a call cut
    it into no call or broken JSON); "auto" and "none" keep the request's stops."""
    from pocketjax.serve.http.openai_protocol import ChatCompletionRequest
    from pocketjax.serve.http.tool_calls import answer_stops

    for choice, kept in [("required", False), ({"type": "function", "function": {"name": "add"}}, False),
                         ("auto", True), ("none", True)]:
        body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS,
                                                     "tool_choice": choice, "stop": "\n", "stop_token_ids": [13]})
        sp = body.sampling(8, tools=body.tool_request())
        assert (sp.stop, sp.stop_token_ids) == (((("\n",), (13,)) if kept else ((), ()))), choice
    assert answer_stops(None, "\n") == ("\n",) and answer_stops(None, None) == ()


def test_every_enforced_schema_is_closed_as_tool_schemas_are():
    """One rule for every JSON schema the server enforces: response_format, text.format and structured_outputs.json
    (an object or its text) are closed as a tool's parameters are (an object listing its properties allows no
    others); a schema that allows others keeps its word."""
    from pocketjax.serve.http.constraints import ResponseFormat, StructuredOutputs, TextFormat

    person = {"type": "object", "properties": {"name": {"type": "string"},
                                               "home": {"type": "object", "properties": {"city": {"type": "string"}}}}}
    closed = close_schema(person)
    assert closed["additionalProperties"] is False and closed["properties"]["home"]["additionalProperties"] is False
    made = [ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "p", "schema": person}}),
            TextFormat.model_validate({"type": "json_schema", "name": "p", "schema": person}),
            StructuredOutputs.model_validate({"json": person}),
            StructuredOutputs.model_validate({"json": json.dumps(person)})]
    for form in made:
        assert json.loads(form.structured().json_schema) == closed, form
    open_schema = {**person, "additionalProperties": True}
    assert json.loads(StructuredOutputs.model_validate({"json": open_schema}).structured().json_schema)[
        "additionalProperties"] is True
