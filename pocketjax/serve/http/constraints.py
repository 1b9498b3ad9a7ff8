"""The request fields that constrain what is generated, as one `Structured` for the engine: OpenAI's
`response_format` and vLLM's `structured_outputs` extra (its present spelling: `{"json" | "regex" | "choice" |
"grammar" | "json_object": ...}`) on /v1/completions and /v1/chat/completions, and `text.format` on /v1/responses.

At most one constraint per request: `response_format` (other than "text") and `structured_outputs` together are a
400, as are tools enforced by a grammar (tool_choice "required" or named) with `structured_outputs`; an output format
(`response_format`, `text.format`) with them is for the text turns after the forced one (`tool_calls.answer_format`).
Every JSON schema is closed as tool schemas are (`tool_calls.close_schema`). vLLM's old top-level
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, ... were removed upstream; each is refused by name
with the spelling that replaced it. The options this server does not implement (`structural_tag`,
`whitespace_pattern`, `disable_any_whitespace`, `disable_additional_properties`) are refused by name too. Whether a
schema, regex or grammar compiles is the engine's to say (at submit); the server names the field it came from.
"""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ...engine.structured import Structured
from .api_error import APIError
from .openapi import Documented
from .tool_calls import close_schema

# vLLM's removed extras -> what replaced them (in its structured_outputs object)
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar",
          "guided_json_object": "json_object", "guided_decoding_backend": None, "guided_whitespace_pattern": None}
UNSUPPORTED = ("structural_tag", "whitespace_pattern", "disable_any_whitespace", "disable_additional_properties")
Removed = Annotated[Any, Documented(replace=True, type="null", description="Removed upstream: refused unless null.")]
Unsupported = Annotated[Any, Documented(replace=True, enum=[None, False], description="Not supported: refused "
                                                                                      "unless null or false.")]


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: OpenAI's name (required), description, schema and strict. The schema is always
    enforced, strict or not (as vLLM does), and closed as tool schemas are (`close_schema`: an object that lists its
    properties and says nothing of others allows no others)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=False)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured(self) -> Structured | None:
        if self.type != "json_schema" and self.json_schema is not None:
            raise APIError(400, f"response_format.json_schema is only read with type 'json_schema' (got type "
                                f"{self.type!r})", param="response_format")
        if self.type == "json_object":
            return Structured(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None:
                raise APIError(400, "response_format of type 'json_schema' needs its json_schema object",
                               param="response_format")
            return Structured(json_schema=close_schema(self.json_schema.schema_))
        return None


class TextFormat(BaseModel):
    """/v1/responses' `text.format`: the Responses API's spelling of response_format (a json_schema's name, schema,
    strict and description sit beside its type)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=False)
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    def structured(self) -> Structured | None:
        if self.type == "json_schema":
            if self.name is None or self.schema_ is None:
                raise APIError(400, "text.format of type 'json_schema' needs its name and schema", param="text")
            return Structured(json_schema=close_schema(self.schema_))
        if (self.name, self.schema_, self.strict, self.description) != (None,) * 4:
            raise APIError(400, f"text.format: name, schema, strict and description are only read with type "
                                f"'json_schema' (got type {self.type!r})", param="text")
        return Structured(json_object=True) if self.type == "json_object" else None

    @classmethod
    def of(cls, text: dict[str, Any] | None) -> tuple[Structured | None, dict[str, Any]]:
        """The constraint of a Responses request's `text` and the format its Response echoes; 400 naming text."""
        text = text or {}
        if set(text) - {"format"}:
            raise APIError(400, f"text.{sorted(set(text) - {'format'})[0]} is not supported", param="text")
        given = text.get("format") or {"type": "text"}
        try:
            return cls.model_validate(given).structured(), given
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise APIError(400, f"text.format.{where}: {first['msg']}", param="text") from None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` request extra: exactly one of json (a schema, as an object or a JSON string),
    regex, choice, grammar (Lark, llguidance's dialect) or json_object."""

    model_config = ConfigDict(strict=True, extra="forbid")
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Unsupported = None
    whitespace_pattern: Unsupported = None
    disable_any_whitespace: Unsupported = None
    disable_additional_properties: Unsupported = None

    def structured(self) -> Structured:
        for name in UNSUPPORTED:
            if getattr(self, name) not in (None, False):
                raise APIError(400, f"structured_outputs.{name} is not supported", param="structured_outputs")
        given = {"json_schema": closed_json(self.json_), "regex": self.regex, "choice": self.choice,
                 "grammar": self.grammar, "json_object": self.json_object or None}
        given = {key: value for key, value in given.items() if value is not None}
        if len(given) != 1:
            raise APIError(400, "structured_outputs needs exactly one of json, regex, choice, grammar, json_object "
                                f"(got {len(given)})", param="structured_outputs")
        return Structured(**given)


def closed_json(schema: dict[str, Any] | str | None) -> dict[str, Any] | str | None:
    """structured_outputs.json closed as every schema this server enforces (`close_schema`), given as an object or
    its JSON text; text that does not parse stays as it is, for the engine to name."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            return schema
    return close_schema(schema)


class ConstraintFields(BaseModel):
    """The constraint fields of both completion endpoints (mixed into their request models)."""

    model_config = ConfigDict(strict=True, extra="ignore")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's removed spellings: refused unless null, naming what replaced them (`constraint`)
    guided_json: Removed = None
    guided_regex: Removed = None
    guided_choice: Removed = None
    guided_grammar: Removed = None
    guided_json_object: Removed = None
    guided_decoding_backend: Removed = None
    guided_whitespace_pattern: Removed = None

    def constraint(self) -> tuple[Structured | None, str | None]:
        """The request's constraint and the field it came from (what a 400 about it names), or (None, None)."""
        for name, spelling in GUIDED.items():
            if getattr(self, name) is not None:
                instead = f'structured_outputs: {{"{spelling}": ...}}' if spelling else "structured_outputs"
                raise APIError(400, f"{name} is vLLM's old spelling (removed upstream) and is not accepted: send "
                                    f"{instead}", param=name)
        from_format = self.response_format.structured() if self.response_format is not None else None
        from_extra = self.structured_outputs.structured() if self.structured_outputs is not None else None
        if from_format is not None and from_extra is not None:
            raise APIError(400, "send one constraint: response_format or structured_outputs, not both",
                           param="structured_outputs")
        if from_format is not None:
            return from_format, "response_format"
        if from_extra is not None:
            return from_extra, "structured_outputs"
        return None, None
