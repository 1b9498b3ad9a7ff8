"""Request fields -> the engine's Structured: response_format, vLLM's structured_outputs, and every refusal (a 400
naming the field), read through the endpoints' own request models."""
import pydantic
import pytest

import pocketjax as pj
from pocketjax.serve.http.api_error import APIError
from pocketjax.serve.http.openai_protocol import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.leg1_only  # HTTP / host-side: the same under any JAX (.ci/run's leg 2 runs the engine's tests)

SCHEMA = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
# Every schema this server enforces is closed, as tool schemas are (tool_calls.close_schema): written out here.
CLOSED = {**SCHEMA, "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "hi"}]


def constraint(**fields):
    """(Structured, field) of a chat request and of a completion request with `fields` (they must agree)."""
    chat = ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields}).constraint()
    completion = CompletionRequest.model_validate({"prompt": "hi", **fields}).constraint()
    assert chat == completion
    return chat


@pytest.mark.parametrize("fields, expected, field", [
    ({}, None, None),
    ({"response_format": {"type": "text"}}, None, None),
    ({"response_format": {"type": "json_object"}}, pj.Structured(json_object=True), "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True,
                                                                 "description": "an x"}}},
     pj.Structured(json_schema=CLOSED), "response_format"),
    ({"structured_outputs": {"json": SCHEMA}}, pj.Structured(json_schema=CLOSED), "structured_outputs"),
    ({"structured_outputs": {"json": '{"type": "object"}'}}, pj.Structured(json_schema={"type": "object"}),
     "structured_outputs"),
    ({"structured_outputs": {"regex": "[a-z]+"}}, pj.Structured(regex="[a-z]+"), "structured_outputs"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, pj.Structured(choice=("yes", "no")), "structured_outputs"),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, pj.Structured(grammar='start: "a"+'), "structured_outputs"),
    ({"structured_outputs": {"json_object": True}}, pj.Structured(json_object=True), "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": False}}, pj.Structured(regex="a"),
     "structured_outputs"),
])
def test_constraints_map_to_structured(fields, expected, field):
    assert constraint(**fields) == (expected, field)


@pytest.mark.parametrize("fields, param, message", [
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs its json_schema"),
    ({"response_format": {"type": "json_object", "json_schema": {"name": "x", "schema": {}}}}, "response_format",
     "only read with type 'json_schema'"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs", "whitespace_pattern"),
    ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}, "structured_outputs",
     "disable_any_whitespace"),
    ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}}, "structured_outputs",
     "disable_additional_properties"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs",
     "not both"),
    ({"guided_json": SCHEMA}, "guided_json", 'structured_outputs: {"json": ...}'),
    ({"guided_regex": "a"}, "guided_regex", 'structured_outputs: {"regex": ...}'),
    ({"guided_choice": ["a"]}, "guided_choice", 'structured_outputs: {"choice": ...}'),
    ({"guided_grammar": "start: a"}, "guided_grammar", 'structured_outputs: {"grammar": ...}'),
    ({"guided_json_object": True}, "guided_json_object", 'structured_outputs: {"json_object": ...}'),
    ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "old spelling"),
    ({"guided_whitespace_pattern": " "}, "guided_whitespace_pattern", "old spelling"),
])
def test_refused_constraints_name_their_field(fields, param, message):
    for model, base in ((ChatCompletionRequest, {"messages": MESSAGES}), (CompletionRequest, {"prompt": "hi"})):
        with pytest.raises(APIError) as raised:
            model.model_validate({**base, **fields}).constraint()
        assert raised.value.status == 400 and raised.value.param == param and message in raised.value.message


@pytest.mark.parametrize("fields, where", [
    ({"response_format": {"type": "structural_tag", "format": {}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format"),  # no name
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),  # no schema
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{}"}}}, "response_format"),
    ({"response_format": "json"}, "response_format"),
    ({"structured_outputs": {"regex": 3}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "backend": "xgrammar"}}, "structured_outputs"),  # unknown: refused
])
def test_malformed_constraint_fields_fail_validation_at_the_field(fields, where):
    """Shape errors are pydantic's: the server answers them 400 with the first location as `param`."""
    with pytest.raises(pydantic.ValidationError) as raised:
        ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})
    assert raised.value.errors()[0]["loc"][0] == where


def test_sampling_carries_the_constraint():
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, "response_format": {"type": "json_object"}})
    structured, _ = body.constraint()
    assert body.sampling(8, structured=structured).structured == pj.Structured(json_object=True)
    assert body.sampling(8).structured is None
