"""Tool calls: the Hermes <tool_call> parser (whole and streamed), the checked tools, the enforcing grammar and the
messages templates read. References: answers built from known calls and content, llguidance matching the text the
official Qwen3 template writes for a past call, and transformers' rendering (tests/test_tokenizer.py)."""
import json
import random
import re

import pytest

from pocketjax.serve.api_error import APIError
from pocketjax.serve.tool_calls import (END, START, ToolCallParser, parse_tool_calls, template_messages,
                                        tool_request)

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


def streamed(text: str, cuts: list[int]) -> tuple[str, list, list]:
    """What a stream of `text`, cut at `cuts`, sends: its content pieces, calls, and every event in order."""
    parser, events = ToolCallParser(), []
    for a, b in zip([0, *cuts], [*cuts, len(text)]):
        events += parser.feed(text[a:b])
    events += parser.finish()
    pieces = [e for e in events if isinstance(e, str)]
    return "".join(pieces), [e for e in events if not isinstance(e, str)], pieces


@pytest.mark.parametrize("before, between, after", [("", "\n", ""), ("Let me check.\n", "\n\n", "\nDone."),
                                                     ("<tool_c", " and ", "<tool_call")])
def test_calls_and_the_text_around_them(before, between, after):
    text = before + between.join(block(n, a) for n, a in CALLS) + after
    content, calls = parse_tool_calls(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    assert [c.index for c in calls] == [0, 1, 2] and len({c.id for c in calls}) == 3
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in calls)
    visible = before + between * (len(CALLS) - 1) + after
    assert content == (visible if visible.strip() else None)
    assert calls[0].arguments == '{"city": "Zürich"}'  # the model's own JSON text, non-ASCII kept


def test_streamed_answer_equals_the_whole_answer_at_any_cut():
    rng = random.Random(0)
    text = "Sure <tool_call" + block(*CALLS[0]) + " mid " + block(*CALLS[2]) + "\n<tool_call>\nnot json\n</tool_call>!"
    whole_content, whole_calls = parse_tool_calls(text)
    for trial in range(300):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randrange(0, 12)))
        if trial < len(text) - 1:
            cuts = [trial + 1]  # every single cut point, then random ones
        content, calls, pieces = streamed(text, cuts)
        assert content == whole_content
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
        assert not any('"name": "get_weather"' in p for p in pieces)  # a call's markup is never content


def test_malformed_blocks_stay_content():
    bad = [f"{START}\nnot json\n{END}", f'{START}{{"name": 3, "arguments": {{}}}}{END}',
           f'{START}{{"name": "f", "arguments": "[1]"}}{END}', f'{START}{{"name": "f", "args": {{}}}}{END}',
           f'{START}[1, 2]{END}']
    for text in bad:
        assert parse_tool_calls("x " + text) == ("x " + text, [])
    content, calls = parse_tool_calls(bad[0] + block(*CALLS[1]))
    assert content == bad[0] and [c.name for c in calls] == ["add"]
    _, calls = parse_tool_calls(f'{START}{{"arguments": {{"a": 1}}, "name": "f", "id": 7}}{END}')  # other layouts
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"a": 1}')]


def test_an_answer_cut_inside_a_block():
    whole = block(*CALLS[1])
    content, calls = parse_tool_calls(whole[:-len(END)])  # the JSON was complete: still a call
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [CALLS[1]]
    cut = whole[:len(whole) // 2]
    assert parse_tool_calls(cut) == (cut, [])
    assert streamed(cut, [5, 9])[:2] == (cut, [])


def test_call_deltas_are_openai_incremental_shape():
    _, calls = parse_tool_calls(block(*CALLS[0]) + block(*CALLS[1]))
    first, second = calls[1].deltas()
    assert first == {"index": 1, "id": calls[1].id, "type": "function", "function": {"name": "add", "arguments": ""}}
    assert second == {"index": 1, "function": {"arguments": '{"a": 1, "b": -2}'}}
    assert calls[1].message() == {"id": calls[1].id, "type": "function",
                                  "function": {"name": "add", "arguments": '{"a": 1, "b": -2}'}}


@pytest.mark.parametrize("tools, choice, message", [
    ([], None, "must not be empty"),
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
    assert (auto.choice, auto.enforced, auto.parsed, auto.parallel) == ("auto", False, True, True)
    assert auto.tools == TOOLS and auto.parameters["get_weather"] == WEATHER
    none = tool_request(TOOLS, "none", None)
    assert (none.enforced, none.parsed) == (False, False) and none.tools == TOOLS  # still rendered, as vLLM does
    named = tool_request(TOOLS, {"type": "function", "function": {"name": "add"}}, False)
    assert (named.choice, named.enforced, named.parallel) == ("add", True, False)
    assert tool_request(TOOLS, "required", None).enforced


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
    assert parse_tool_calls(tok.decode(ids))[1][1].arguments == '{"a": 1, "b": -2}'
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


def test_template_messages_turn_openai_calls_into_template_form():
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, "é"]}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    out = template_messages(messages)
    assert out[1]["content"] == "" and out[1]["tool_calls"][0]["function"]["arguments"] == {"x": [1, "é"]}
    assert out[0] is messages[0] and out[2] is messages[2] and messages[1]["content"] is None  # input untouched
    for arguments, why in [("{nope", "not JSON"), ("[1]", "JSON object")]:
        bad = [{**messages[1], "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": arguments}}]}]
        with pytest.raises(APIError, match=why) as raised:
            template_messages(bad)
        assert raised.value.param == "messages"
