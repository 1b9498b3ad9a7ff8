"""The published API: GET /openapi.json as strict as the server. Each route declares every answer it can give (its
200 model, `text/event-stream` where `stream` is allowed, and the errors of its API family), and `install_openapi`
finishes the document with what only the app knows: the one model name it serves, its context and choice limits,
and the key scheme with `--api-key`.

Why a document this strict: generated clients, gateways that validate requests, and fuzzers read it as the contract.
tests/test_openapi.py fuzzes the server from it (schemathesis) and compares it with the checked-in docs/openapi.json.
FastAPI's own 422 never happens here (every validation failure is a 400, `replies.install_error_handlers`), so it is
taken out of the document.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import AfterValidator, BaseModel, BeforeValidator, Field, GetJsonSchemaHandler
from pydantic_core import CoreSchema


class Documented:
    """JSON-schema keywords a field's value meets, declared in the document and enforced by the code that owns the
    rule (`SamplingParams.validate` for ranges, `check_supported` for what is refused), which names the field in its
    own words; pydantic does not check them. `replace`: these keywords are the whole schema (for `Any` fields).

    The fuzzer holds the two together: a value the document refuses must be refused (negative_data_rejection)."""

    def __init__(self, replace: bool = False, **keywords: Any):
        self.replace, self.keywords = replace, keywords

    def __get_pydantic_json_schema__(self, core: CoreSchema, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        return dict(self.keywords) if self.replace else {**handler(core), **self.keywords}


def whole(value: Any) -> Any:
    """JSON's 5.0 as the integer 5 (JSON Schema's `integer` admits it, and generated clients send it); anything
    else as it came, for pydantic's strict int to judge (5.5 and "5" stay 400s)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Int = Annotated[int, BeforeValidator(whole)]  # every integer field of a request body


def bounded(**bounds: int) -> Any:
    """An `Int` that pydantic holds within `bounds` (ge, le): they must reach the int itself, inside the before-
    validator, to be checked and declared as minimum / maximum."""
    return Annotated[int, Field(**bounds), BeforeValidator(whole)]


def dumped(value: BaseModel) -> dict[str, Any]:
    return value.model_dump(exclude_unset=True, by_alias=True)


def plain(model: Any) -> Any:
    """`model` validated at the edge (its schema in the document, its errors 400s naming the field) and kept as the
    plain JSON it came as (the keys given, nothing added), which the chat templates and the code after them read."""
    return Annotated[model, AfterValidator(dumped)]


class ErrorObject(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    """OpenAI's error body: what the openai clients parse into APIError.message, .type, .param and .code."""

    error: ErrorObject


class AnthropicErrorObject(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error body, on /v1/messages and /v1/messages/count_tokens."""

    type: Literal["error"]
    error: AnthropicErrorObject


# why each status happens, as the document says it (docs/serving-api.md has the table a client acts on)
WHY = {
    400: "Malformed: invalid JSON, a field of the wrong type or out of range, a field this server does not implement "
         "(named in `param`), a rule across fields, `exceeds_max_waiting`, or an auth header given twice.",
    401: "`invalid_api_key`: the server runs with --api-key and the request carries no valid "
         "`Authorization: Bearer KEY` or `x-api-key: KEY` (checked before the body is read).",
    404: "`model_not_found`: `model` names a model this server does not serve.",
    408: "`request_timeout`: the body did not arrive within --body-timeout.",
    413: "`body_too_large`: the body is over --max-body-bytes.",
    429: "`queue_full`: --max-waiting requests already wait for a slot; retry after `Retry-After` seconds.",
    500: "An internal error (never expected: report it).",
    503: "`warming_up` (the engine compiles its shapes; retry after `Retry-After` seconds or wait for GET /health) or "
         "`stopped` (the server is shutting down).",
}
RETRY_AFTER = {"description": "Seconds to wait before retrying.", "schema": {"type": "integer", "minimum": 1}}
REQUEST_ID = {"description": "The answer's id (`req_...`), as Anthropic names each answer.",
              "schema": {"type": "string"}}
# one server-sent event, as OpenAPI 3.1 describes a stream's items (`stream: true`): the OpenAI routes send data only
# (JSON chunks, then `[DONE]`), Responses and Anthropic's name each event's type too
SSE_EVENT = {"type": "object", "required": ["data"], "description": "One server-sent event of the stream.",
             "properties": {"event": {"type": "string"},
                            "data": {"type": "string", "description": "A JSON object (or, last on the OpenAI "
                                                                      "routes, `[DONE]`)."}}}
ANSWERED = (400, 404, 408, 413, 500)  # every route with a body: the guard's and the handlers' errors
GENERATION = (*ANSWERED, 429, 503)  # routes that run the engine: a full queue, warming up, stopping


def errors(*statuses: int, anthropic: bool = False) -> dict[int | str, dict[str, Any]]:
    """`responses=` entries for these error statuses in the family's error body (Anthropic's or OpenAI's), with
    Retry-After on 429 (always) and 503 (while warming), and Anthropic's request-id header."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        headers: dict[str, Any] = {}
        if status == 429:
            headers["Retry-After"] = {**RETRY_AFTER, "required": True}
        if status == 503:
            headers["Retry-After"] = RETRY_AFTER
        if anthropic:
            headers["request-id"] = REQUEST_ID
        out[status] = {"model": AnthropicError if anthropic else OpenAIError, "description": WHY[status],
                       **({"headers": headers} if headers else {})}
    return out


def answers(model: type[BaseModel] | None, *statuses: int, stream: bool = False, anthropic: bool = False,
            description: str = "The answer.") -> dict[int | str, dict[str, Any]]:
    """A route's `responses=`: 200 with `model` (and `text/event-stream` when it may stream), then `errors`."""
    ok: dict[str, Any] = {"description": description}
    if model is not None:
        ok["model"] = model
    if stream:
        ok["content"] = {"text/event-stream": {"schema": SSE_EVENT}}
    if anthropic:
        ok["headers"] = {"request-id": REQUEST_ID}
    return {200: ok, **errors(*statuses, anthropic=anthropic)}


def get_and_head(router: Any, path: str, **options: Any) -> Callable[[Callable], Callable]:
    """Register an endpoint for GET and HEAD (RFC 9110: HEAD wherever GET is; uvicorn sends no body for it), as two
    routes so each operation has its own id."""

    def register(endpoint: Callable) -> Callable:
        router.get(path, **options)(endpoint)
        router.head(path, **options)(endpoint)
        return endpoint

    return register


def install_openapi(app: FastAPI, *, model_name: str, max_seq_len: int, max_choices: int, vocab_size: int,
                    api_key: bool) -> None:
    """Make `app.openapi()` the published document (built once, then cached by FastAPI's rule)."""

    def document() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = finished(get_openapi(title=app.title, version=app.version, routes=app.routes,
                                                      description=DESCRIPTION),
                                          model_name, max_seq_len, max_choices, vocab_size, api_key)
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]


DESCRIPTION = ("pocketjax's OpenAI- and Anthropic-compatible API over one model. Every answer a route can give is "
               "declared; a request the schema refuses is refused by the server (a 400 naming the field), and the "
               "rules no schema can say (prompt length against the context, `n` x prompts, `max_tokens: 0` needs "
               "`echo`, ...) are listed in docs/serving-api.md.")
TOKEN_ID = "x-token-id"  # marks a token id's schema: install_openapi bounds it by the vocabulary
UNGUARDED = ("/health", "/metrics")  # as http_guard.OPEN_PATHS: probes and scrapers need no key
MODEL_FIELDS = ("model",)
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def finished(doc: dict[str, Any], model_name: str, max_seq_len: int, max_choices: int, vocab_size: int,
             api_key: bool) -> dict:
    """FastAPI's document with 422 and its schemas taken out, `model` pinned to the served name, the token, choice
    and vocabulary limits of this server in the request schemas, and with a key the two key schemes on guarded
    routes."""
    for path, operations in doc["paths"].items():
        for operation in operations.values():
            operation["responses"].pop("422", None)
            if api_key and path not in UNGUARDED:
                operation["security"] = [{"bearer": []}, {"x-api-key": []}]
                operation["responses"]["401"] = error_reference(operation, "401")
            for parameter in operation.get("parameters", []):
                if parameter["name"] == "model":
                    parameter["schema"] = {"type": "string", "enum": [model_name]}
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    for schema in schemas.values():
        bound_token_ids(schema, vocab_size)
        properties = schema.get("properties", {})
        for name in MODEL_FIELDS:
            if name in properties:
                pin(properties[name], {"type": "string", "enum": [model_name]})
        for name in TOKEN_FIELDS:
            if name in properties:
                bound(properties[name], "maximum", max_seq_len)
        if schema.get("title", "").endswith("Request") and "n" in properties:
            bound(properties["n"], "maximum", max_choices)
    if api_key:
        doc.setdefault("components", {})["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer", "description": "`Authorization: Bearer KEY` (--api-key)"},
            "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key",
                          "description": "`x-api-key: KEY` (--api-key; Anthropic's header)"}}
    return doc


def error_reference(operation: dict[str, Any], status: str) -> dict[str, Any]:
    """The 401 of a guarded route, in the error body its 400 has (the route's family)."""
    family = operation["responses"].get("400") or {"content": {"application/json": {"schema": {
        "$ref": "#/components/schemas/OpenAIError"}}}}
    return {"description": WHY[int(status)], "content": family["content"]}


def pin(prop: dict[str, Any], schema: dict[str, Any]) -> None:
    """Replace the non-null branch of a property's schema (`anyOf` with null when optional)."""
    branches = prop.get("anyOf")
    if branches is None:
        extra = {k: v for k, v in prop.items() if k in ("title", "description", "default")}
        prop.clear()
        prop.update(schema, **extra)
        return
    prop["anyOf"] = [schema if b.get("type") != "null" else b for b in branches]


def bound(prop: dict[str, Any], key: str, value: int) -> None:
    """Set `key` on the integer branch of a property's schema (at most `value`, never looser than it was)."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") == "integer":
            branch[key] = min(value, branch.get(key, value))


def bound_token_ids(schema: Any, vocab_size: int) -> None:
    """Every schema marked a token id (TOKEN_ID), anywhere in `schema`, at most vocab_size - 1."""
    if isinstance(schema, dict):
        if schema.pop(TOKEN_ID, False):
            schema["maximum"] = vocab_size - 1
        for value in schema.values():
            bound_token_ids(value, vocab_size)
    elif isinstance(schema, list):
        for value in schema:
            bound_token_ids(value, vocab_size)

