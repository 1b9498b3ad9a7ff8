"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health over one LLM.

FastAPI on uvicorn, as vLLM serves: pydantic request models give OpenAI-shaped 400s for free, and uvicorn's
ASGI 2.3 interface tells a streaming response when its client leaves. Every request becomes one handle per choice
on the LLM's one Scheduler, so HTTP clients share continuous batching; the scheduler thread runs the engine and
the event loop only waits on handles (`RequestHandle.deltas`), never on the device. A client that disconnects
cancels its handles, which frees their slots at the next step.
"""
from __future__ import annotations

import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine.request import Completion
from ..errors import CapacityError, CheckpointError, ConfigError, PocketJaxError, RequestError, StoppedError
from .anthropic_messages import messages_router
from .api_error import error_body
from .context import ServeContext, finish_all, merged
from .handle import RequestHandle
from .http_guard import HTTP_PROTOCOL, MISSING_KEY, HTTPGuard, ServerLimits, key_given
from .metrics import HTTPCounter, RequestMetrics, metrics_router, prompt_groups
from .openai_protocol import (APIError, ChatCompletionRequest, CompletionRequest, SamplingFields, StreamOptions,
                              TokenText, chat_logprobs, completion_logprobs, finish_reason,
                              prompt_logprobs, trimmed, usage, with_seed)
from .responses import responses_router
from .tokenization import tokenization_router
from .tool_calls import ToolRequest

if TYPE_CHECKING:
    from .llm import LLM

log = logging.getLogger("pocketjax.server")
LOOPBACK = ("127.0.0.1", "localhost", "::1")
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
# A 429 (queue full) says when to retry: the queue drains as requests finish, seconds at most for a typical load;
# the openai client waits Retry-After (when <= 60 s) instead of its own 0.5-8 s backoff.
RETRY_AFTER_S = 1


def create_app(llm: LLM, *, model_name: str | None = None, api_key: str | None = None,
               max_waiting: int | None = None, trust_request_chat_template: bool = False,
               limits: ServerLimits | None = None) -> FastAPI:
    """A FastAPI app serving `llm` (whose scheduler it shares with any other caller); `api_key` guards every route
    but /health and /metrics, checked before the body is read.

    `max_waiting` bounds the scheduler's queue: past it a request gets 429 at once instead of waiting.
    `trust_request_chat_template` lets `chat_template_kwargs.chat_template` replace the checkpoint's template (a
    template is code; off, such a request gets 400). `limits`: body, prompt and connection bounds (ServerLimits).
    """
    if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
        raise ConfigError("api_key must be a non-empty string (None: no key)")
    limits = ServerLimits() if limits is None else limits
    if llm.tokenizer is None:
        raise ConfigError("serving needs a checkpoint with a tokenizer (tokenizer.json): responses are text")
    if max_waiting is not None:
        if not isinstance(max_waiting, int) or max_waiting < 1:
            raise ConfigError(f"max_waiting must be a positive integer, got {max_waiting!r}")
        llm.scheduler.max_waiting = max_waiting
    name = model_name or default_model_name(llm)
    text_of = TokenText(llm.tokenizer)
    created = int(time.time())
    app = FastAPI(title="pocketjax", version="0.1.0")
    install_error_handlers(app)
    app.add_middleware(HTTPGuard, api_key=api_key, limits=limits)
    metrics = app.state.metrics = RequestMetrics(llm, name)
    app.add_middleware(HTTPCounter, metrics=metrics)
    ctx = app.state.context = ServeContext(llm, name, limits, metrics, created)
    off_loop, encode, budget = ctx.off_loop, ctx.encode, ctx.budget
    if llm.engine.constrainer is not None:
        # llguidance builds its view of the vocabulary holding the GIL (~1 s at Qwen's): no host thread keeps the
        # event loop free through that, so it is built now, before the first request, warm-up or not
        llm.engine.constrainer.prepare()

    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        headers = request.headers
        if not key_given(api_key.encode(), headers.get("authorization", "").encode(),
                         headers.get("x-api-key", "").encode()):
            raise APIError(401, MISSING_KEY, code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    @app.get("/health")
    async def health() -> dict[str, Any]:
        sched = llm.scheduler
        return {"status": "ok", "running": len(sched.running), "waiting": len(sched.waiting),
                "free_slots": llm.engine.num_free_slots}

    def model_card() -> dict[str, Any]:
        return {"id": name, "object": "model", "created": created, "owned_by": "pocketjax",
                "max_model_len": llm.engine.max_seq_len}

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @v1.get("/models/{model:path}")
    async def model(model: str) -> dict[str, Any]:
        """One model's card (`client.models.retrieve`); a name this server does not serve is a 404."""
        ctx.check_model(model)
        return model_card()

    def check(body: SamplingFields) -> None:
        ctx.check_model(body.model)
        body.check_supported()

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request):
        check(body)
        prompts = prompt_list(body.prompt)
        if len(prompts) * (body.n or 1) > limits.max_choices:
            raise APIError(400, f"{len(prompts)} prompts x n={body.n or 1} is over this server's limit of "
                                f"{limits.max_choices} completions per request", param="n")
        ids = [await off_loop(encode, p) if isinstance(p, str) else encode(p) for p in prompts]
        ids = [body.truncated(p, llm.engine.max_seq_len) for p in ids]
        echo, top, as_ids = bool(body.echo), body.logprobs, bool(body.return_tokens_as_token_ids)
        if body.stream and echo and top is not None:
            raise APIError(400, "echo with logprobs is not supported when streaming", param="echo")
        score_only = body.max_tokens == 0  # the prompt's logprobs and no completion (needs echo), as vLLM
        if score_only and not echo:
            raise APIError(400, "max_tokens 0 needs echo=true (it returns the prompt, with logprobs if asked)",
                           param="max_tokens")
        structured, constrained_by = body.constraint()
        if structured is not None and score_only:
            raise APIError(400, "max_tokens 0 generates nothing to constrain", param=constrained_by)
        n, jobs = body.n or 1, []
        for prompt in ids:
            # scoring generates one token for the prompt's logprobs, then drops it; without logprobs nothing runs
            asked = 1 if score_only else body.max_tokens
            sampling = body.sampling(budget(prompt, asked, COMPLETIONS_MAX_TOKENS), top or 0,
                                     body.prompt_top(top if echo else None), structured)
            jobs += [(prompt, with_seed(sampling, i)) for i in range(n)]
        if score_only and top is None:
            jobs = []
        reply = Reply(f"cmpl-{uuid.uuid4().hex}", "text_completion", name,
                      await ctx.submit(jobs, "prompt" if len(ids) > 1 else "n", constrained_by),
                      sum(len(p) for p in ids),
                      body.stream_options)
        heads = [(p if isinstance(p, str) and body.truncate_prompt_tokens is None
                  else llm.tokenizer.decode(i, skip_special_tokens=False)) if echo else ""
                 for p, i in zip(prompts, ids) for _ in range(n)]
        if body.stream:
            events = (echo_events(reply, heads) if score_only else
                      completion_events(reply, heads, top, text_of, as_ids))
            return sse_response(events)
        outs = await finish_all(request, reply.handles) if reply.handles else [None] * len(heads)
        choices = []
        for i, (out, head) in enumerate(zip(outs, heads)):
            if score_only:
                logprobs = None
                if out is not None:
                    entries = trimmed(out.prompt_logprobs, top)
                    logprobs = completion_logprobs(text_of, out.prompt_tokens, entries, as_ids=as_ids)
                choices.append({"index": i, "text": head, "logprobs": logprobs, "finish_reason": "length"})
                continue
            logprobs = None
            if top is not None:
                tokens, entries = out.token_ids, out.logprobs[:len(out.token_ids)]
                if echo:
                    tokens, entries = out.prompt_tokens + tokens, trimmed(out.prompt_logprobs, top) + entries
                logprobs = completion_logprobs(text_of, tokens, entries, as_ids=as_ids)
            choices.append({"index": i, "text": head + out.text, "logprobs": logprobs,
                            "finish_reason": finish_reason(out)})
            if body.prompt_logprobs is not None:  # vLLM's extra, per choice
                choices[-1]["prompt_logprobs"] = prompt_logprobs(text_of, out.prompt_tokens, out.prompt_logprobs,
                                                                 body.prompt_logprobs)
        return reply.body(choices, 0 if score_only else reply.completion_tokens())

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check(body)
        if (body.n or 1) > limits.max_choices:
            raise APIError(400, f"n={body.n} is over this server's limit of {limits.max_choices} completions per "
                                f"request", param="n")
        options = body.template_options(trust_request_chat_template, llm.tokenizer.chat_templates)
        messages = body.chat_messages()
        ctx.check_size("messages", messages=messages, chat_template_kwargs=options, tools=body.tools,
                       functions=body.functions)
        tools = await off_loop(body.tool_request)  # compiles each tool's parameters schema
        structured, constrained_by = ctx.answer_constraint(tools, *body.constraint())
        prompt = await off_loop(render_prompt, llm, messages, options, encode, tools)
        prompt = body.truncated(prompt, llm.engine.max_seq_len)
        top = (body.top_logprobs or 0) if body.logprobs else None
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        sampling = body.sampling(budget(prompt, asked, None), top or 0, body.prompt_logprobs, structured=structured)
        handles = await ctx.submit([(prompt, with_seed(sampling, i)) for i in range(body.n or 1)], "n",
                                   constrained_by)
        as_ids = bool(body.return_tokens_as_token_ids)
        reply = Reply(f"chatcmpl-{uuid.uuid4().hex}", "chat.completion", name, handles, len(prompt),
                      body.stream_options)
        head = body.echoed()
        if body.stream:
            return sse_response(echo_first(chat_events(reply, top, text_of, as_ids, tools), reply, head))
        choices = []
        outs = await finish_all(request, handles)
        for i, out in enumerate(outs):
            message, calls = chat_message(out.text, tools)
            if head:
                message["content"] = head + (message["content"] or "")
            choices.append({"index": i, "message": message,
                            "logprobs": (chat_logprobs(text_of, out.token_ids, out.logprobs[:len(out.token_ids)],
                                                       as_ids) if top is not None else None),
                            "finish_reason": chat_finish_reason(out, calls, tools)})
        answer = reply.body(choices, reply.completion_tokens())
        if body.prompt_logprobs is not None:  # vLLM's extra, once for the (shared) prompt
            answer["prompt_logprobs"] = prompt_logprobs(text_of, prompt, outs[0].prompt_logprobs, body.prompt_logprobs)
        return answer

    v1.include_router(responses_router(ctx))
    v1.include_router(messages_router(ctx))
    app.include_router(v1)
    app.include_router(tokenization_router(llm, name), dependencies=[Depends(authorize)])
    app.include_router(metrics_router(metrics))
    return app




def render_prompt(llm: LLM, messages: list[dict[str, Any]], options: dict[str, Any],
                  encode: Callable[[str], list[int]], tools: ToolRequest | None = None) -> list[int]:
    """The prompt ids of a conversation (on a host thread), with the request's tools rendered by the chat template
    (for every tool_choice, "none" included, as vLLM renders them): a request template that does not parse is a
    400."""
    try:
        text = llm.tokenizer.apply_chat_template(messages, tools=tools.tools if tools else None, **options)
    except CheckpointError as error:
        if "chat_template" not in options:
            raise
        raise APIError(400, f"chat_template_kwargs.chat_template: {error}", param="chat_template_kwargs") from None
    return encode(text)


def chat_message(text: str, tools: ToolRequest | None) -> tuple[dict[str, Any], int]:
    """The assistant message of an answer and how many tool calls it made: with tools whose calls are parsed, the
    text before the first call as content and the calls as `tool_calls` (`ToolRequest.answer`)."""
    if tools is None or not tools.parsed:
        return {"role": "assistant", "content": text}, 0
    return tools.answer(text)


def chat_finish_reason(completion: Completion, calls: int, tools: ToolRequest | None = None) -> str:
    """"tool_calls" for an answer that ended on its own after making calls; else the completion's own reason."""
    reason = finish_reason(completion)
    return reason if tools is None else tools.finish_reason(reason, calls)


@dataclass
class Reply:
    """One response being built: its id, object type, model name, the handles of its choices (in order) and the
    counts its usage reports."""

    id: str
    object: str
    model: str
    handles: list[RequestHandle]
    prompt_tokens: int
    stream_options: StreamOptions | None = None

    def completion_tokens(self) -> int:
        return sum(h.num_delivered for h in self.handles)

    def cached_tokens(self) -> int:
        """Prompt tokens the prefix cache held, each prompt counted once (as `prompt_tokens` counts it): what its
        first choice reused."""
        return sum(group[0].cached_prefix_len for group in prompt_groups(self.handles))

    def body(self, choices: list[dict], completion_tokens: int | None = None, chunk: bool = False) -> dict[str, Any]:
        """The response (or, with `chunk`, one stream chunk); with `completion_tokens` it carries usage."""
        out = {"id": self.id, "object": self.object + (".chunk" if chunk and self.object != "text_completion" else ""),
               "created": int(time.time()), "model": self.model, "choices": choices}
        if completion_tokens is not None:
            out["usage"] = usage(self.prompt_tokens, completion_tokens, self.cached_tokens())
        return out

    def chunk(self, choices: list[dict], completion_tokens: int) -> dict[str, Any]:
        """A stream chunk; usage so far only with stream_options.continuous_usage_stats (vLLM's extension)."""
        continuous = self.stream_options is not None and self.stream_options.continuous_usage_stats
        return self.body(choices, completion_tokens if continuous else None, chunk=True)

    def usage_chunk(self, completion_tokens: int) -> dict[str, Any] | None:
        """The last chunk, choices empty, with the usage: only with stream_options.include_usage."""
        if self.stream_options is None or not self.stream_options.include_usage:
            return None
        return self.body([], completion_tokens, chunk=True)


async def completion_events(reply: Reply, heads: list[str], top: int | None, text_of: TokenText,
                            as_ids: bool = False) -> AsyncIterator[dict]:
    """/v1/completions stream chunks: each choice's new text (after its echoed prompt, `heads`) with the logprobs
    of its new tokens, a last chunk per choice with its finish_reason, then the usage chunk if asked."""
    sent, offsets = [0] * len(reply.handles), [len(h) for h in heads]
    async for i, tokens, text, done in merged(reply.handles):
        entries = reply.handles[i].request.logprobs[sent[i]:sent[i] + len(tokens)]
        sent[i] += len(tokens)
        if tokens or text:
            logprobs = None
            if top is not None:
                logprobs = completion_logprobs(text_of, tokens, entries, offsets[i], as_ids)
                offsets[i] += sum(len(text_of(t)) for t in tokens)
            text, heads[i] = heads[i] + text, ""
            yield reply.chunk([{"index": i, "text": text, "logprobs": logprobs, "finish_reason": None}], sum(sent))
        if done is not None:
            yield reply.chunk([{"index": i, "text": heads[i], "logprobs": None, "finish_reason": finish_reason(done)}],
                              sum(sent))
    if (last := reply.usage_chunk(sum(sent))) is not None:
        yield last


async def echo_first(events: AsyncIterator[dict], reply: Reply, head: str) -> AsyncIterator[dict]:
    """Chat stream chunks with `head` (chat's echo) as each choice's first content, after its role chunk (vLLM)."""
    async for event in events:
        yield event
        if head and event["choices"] and event["choices"][0].get("delta", {}).get("role"):
            yield reply.chunk([{"index": event["choices"][0]["index"], "delta": {"content": head}, "logprobs": None,
                                "finish_reason": None}], 0)


async def echo_events(reply: Reply, heads: list[str]) -> AsyncIterator[dict]:
    """/v1/completions stream chunks of max_tokens 0 with echo (and no logprobs): each choice's prompt, ended."""
    for i, head in enumerate(heads):
        yield reply.chunk([{"index": i, "text": head, "logprobs": None, "finish_reason": "length"}], 0)
    if (last := reply.usage_chunk(0)) is not None:
        yield last


async def chat_events(reply: Reply, top: int | None, text_of: TokenText, as_ids: bool = False,
                      tools: ToolRequest | None = None) -> AsyncIterator[dict]:
    """/v1/chat/completions stream chunks: the assistant role per choice, content deltas with the logprobs of their
    tokens, a last chunk per choice with its finish_reason, then the usage chunk if asked.

    With tools whose calls are parsed, each choice's text goes through the request's ToolCallParser: content
    (before the first call) is sent as it is released, each call as OpenAI's tool_calls deltas: index, id, type and
    name first, then its arguments as the model writes them (no <tool_call> markup is ever sent as content); the
    logprobs of a batch of tokens ride on its first delta."""
    sent = [0] * len(reply.handles)
    parsers = [tools.parser() if tools is not None and tools.parsed else None for _ in reply.handles]
    for i in range(len(reply.handles)):
        yield reply.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None}], 0)
    async for i, tokens, text, done in merged(reply.handles):
        entries = reply.handles[i].request.logprobs[sent[i]:sent[i] + len(tokens)]
        sent[i] += len(tokens)
        logprobs = chat_logprobs(text_of, tokens, entries, as_ids) if top is not None and tokens else None
        parser = parsers[i]
        if parser is None:  # ids still forming a character carry no text, but logprobs
            deltas = [{"content": text}] if text or logprobs is not None else []
        else:
            events = (parser.feed(text) if text else []) + (parser.finish() if done is not None else [])
            deltas = [tools.delta(event) for event in events]
            if not deltas and logprobs is not None:
                deltas = [{}]
        for k, delta in enumerate(deltas):
            yield reply.chunk([{"index": i, "delta": delta, "logprobs": logprobs if k == 0 else None,
                                "finish_reason": None}], sum(sent))
        if done is not None:
            reason = chat_finish_reason(done, len(parser.calls), tools) if parser is not None else finish_reason(done)
            yield reply.chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason}], sum(sent))
    if (last := reply.usage_chunk(sum(sent))) is not None:
        yield last


def default_model_name(llm: LLM) -> str:
    """The name clients pass as `model`: the checkpoint folder's name (the embedded model: pocket-coder)."""
    path = getattr(llm.model, "path", None)
    return str(path).rstrip("/").rsplit("/", 1)[-1] if path else "pocketjax"


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's four prompt forms as a list of prompts: a string, strings, token ids, lists of token ids."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return list(prompt)


def sse_response(events: AsyncIterator[dict]) -> StreamingResponse:
    """Server-sent events in OpenAI's format, ending with `data: [DONE]`; an error after the headers went out is
    one `data: {"error": ...}` event (as vLLM sends). Starlette cancels the stream when the client disconnects,
    and `merged` then cancels the handles."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield f"data: {json.dumps(event, separators=(',', ':'))}\n\n"
        except PocketJaxError as error:
            _, payload = error_response(error)
            yield f"data: {json.dumps(payload)}\n\n"
        except Exception as error:  # noqa: BLE001 - a failure after the headers still ends the stream properly
            log.exception("stream failed")
            yield f"data: {json.dumps(error_body(f'internal error: {type(error).__name__}', 'server_error'))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def error_response(error: PocketJaxError) -> tuple[int, dict[str, Any]]:
    """HTTP status and OpenAI error body of a typed pocketjax error."""
    if isinstance(error, RequestError):  # SamplingError included
        return 400, error_body(str(error))
    if isinstance(error, CapacityError):  # a full queue: clients back off and retry (openai's client does)
        return 429, error_body(str(error), "rate_limit_error", code="queue_full")
    if isinstance(error, StoppedError):
        return 503, error_body(str(error), "server_error", code="stopped")
    return 500, error_body(str(error), "server_error")


class ErrorResponse(JSONResponse):
    """An error body as ASCII JSON: a message that quotes the request (a lone surrogate in `model`) always encodes."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def install_error_handlers(app: FastAPI) -> None:
    """Every error answers with OpenAI's error object: validation failures and malformed JSON as 400 (FastAPI
    would say 422), typed pocketjax errors by kind, unknown routes as 404, anything else as 500."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return ErrorResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        first = problems[0] if problems else {}
        loc = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            message, param = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}", None
        else:
            message = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}"
                                for e in problems[:3])
            param = loc[0] if loc else None
        return ErrorResponse(error_body(message, param=param), status_code=400)

    @app.exception_handler(PocketJaxError)
    async def pocketjax_error(request: Request, error: PocketJaxError) -> JSONResponse:
        status, body = error_response(error)
        headers = {"Retry-After": str(RETRY_AFTER_S)} if status == 429 else None
        return ErrorResponse(body, status_code=status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if error.status_code < 500 else "server_error"
        return ErrorResponse(error_body(str(error.detail), kind), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def crash(request: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error in %s", request.url.path)
        return ErrorResponse(error_body(f"internal error: {type(error).__name__}", "server_error"), status_code=500)


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000, *, api_key: str | None = None,
          model_name: str | None = None, max_waiting: int | None = None, log_level: str = "info",
          trust_request_chat_template: bool = False, limits: ServerLimits | None = None) -> None:
    """Serve `llm` until interrupted (the CLI's `pocketjax serve`), with `limits` on bodies and connections."""
    import uvicorn

    if api_key is None and host not in LOOPBACK:
        log.warning("serving on %s without --api-key: anyone who can reach this port can use the model", host)
    if trust_request_chat_template:
        log.warning("--trust-request-chat-template: clients may render their own chat templates (bounded in time "
                    "and size, but code all the same)")
    limits = ServerLimits() if limits is None else limits
    app = create_app(llm, model_name=model_name, api_key=api_key, max_waiting=max_waiting,
                     trust_request_chat_template=trust_request_chat_template, limits=limits)
    options = limits.uvicorn_options()
    log.info("HTTP: uvicorn's %s, at most %d connections", HTTP_PROTOCOL.__name__, limits.connections())
    uvicorn.run(app, host=host, port=port, log_level=log_level, **options)


class BackgroundServer:
    """uvicorn serving `app` on a daemon thread, on 127.0.0.1 and an ephemeral port by default (tests, benchmarks,
    notebooks): `with BackgroundServer(app) as server: OpenAI(base_url=server.url + "/v1", ...)`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 limits: ServerLimits | None = None, **uvicorn_options: Any):
        """`uvicorn_options` go to uvicorn.Config over the limits' own (e.g. http="h11", loop="asyncio" to compare
        HTTP stacks)."""
        import uvicorn

        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = host, self._socket.getsockname()[1]
        self.url = f"http://{host}:{self.port}"
        options = (ServerLimits() if limits is None else limits).uvicorn_options()  # as `serve` runs it
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, **{**options, **uvicorn_options}))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="pocketjax-http", daemon=True)

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url}")
            time.sleep(0.01)
        return self

    def connections(self) -> list[Any]:
        """The open connections' uvicorn protocol objects: which HTTP stack (`type(c)`) and event loop (`c.loop`)
        serve them, and how many a server holds."""
        return list(self._server.server_state.connections)

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()
