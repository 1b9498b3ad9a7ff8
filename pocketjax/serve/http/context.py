"""What every HTTP route of one server shares: the LLM, the model name, the limits, the metrics, and the one way off
the event loop (a bounded pool of host threads).

Routers (chat and completions, Responses, Anthropic Messages, tokenization) take a `ServeContext` rather than
callbacks, so there is one model check, one context budget, one submit path and one off-loop helper. Preparing a
request (rendering a template, tokenizing, compiling a constraint at submit) runs on a pool, never on the loop:
a 2 s constraint compile must not stall the other clients' streams (docs/security.md). Compiling has a pool of its
own (`grammar_pool`): four slow schemas then wait for each other, while every other request's template, tokens and
submit go on through `pool`.
"""
from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from fastapi import Request

from ...engine.request import Completion
from ...engine.structured import Structured
from ...errors import StructuredOutputError
from ..handle import RequestHandle
from .api_error import APIError
from .http_guard import ServerLimits
from .metrics import RequestMetrics
from .tool_call_parser import END, START
from .tool_calls import ToolRequest

if TYPE_CHECKING:
    from ..llm import LLM

HOST_WORKERS = 4  # threads that render templates, tokenize and submit, off the event loop
GRAMMAR_WORKERS = 4  # threads that compile constraints (a tool's schema, a response format) and submit their requests
MAX_JSON_DEPTH = 32  # nesting of messages and chat_template_kwargs (templates read a few levels)
T = TypeVar("T")


@dataclass
class ServeContext:
    """One server's shared state and the request plumbing every endpoint uses."""

    llm: LLM
    name: str  # the `model` clients pass
    limits: ServerLimits
    metrics: RequestMetrics
    created: int  # the model's `created` timestamp in /v1/models
    trust_request_chat_template: bool = False  # a request may bring its own chat template (code: off by default)
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(HOST_WORKERS, thread_name_prefix="pocketjax-host"))
    grammar_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(GRAMMAR_WORKERS, thread_name_prefix="pocketjax-grammar"))

    @property
    def max_chars(self) -> int:
        """The longest text prompt (or conversation) this server renders or tokenizes."""
        return self.limits.prompt_chars(self.llm.engine.max_seq_len)

    async def off_loop(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on a host thread of the bounded pool: the event loop keeps serving other clients."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    async def compiling(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on the grammar pool: work that compiles a schema or grammar (seconds for a hostile
        one) queues behind other compiles only, never ahead of another request's template or tokens."""
        return await asyncio.get_running_loop().run_in_executor(self.grammar_pool,
                                                                functools.partial(fn, *args, **kwargs))

    async def checked_tools(self, given: Any, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args): a request's tools checked (each schema compiled), on the grammar pool when it `given` any;
        without tools nothing compiles and it runs here, so such a request never queues behind slow schemas."""
        return await self.compiling(fn, *args) if given else fn(*args)

    def encode(self, prompt: str | list, param: str = "prompt") -> list[int]:
        """A prompt's ids (text is tokenized, ids are checked by the engine later); 400 past the prompt-size limit
        before any tokenizing."""
        if isinstance(prompt, str) and len(prompt) > self.max_chars:
            raise APIError(400, f"prompt of {len(prompt)} characters is over this server's limit of {self.max_chars}",
                           param=param, code="prompt_too_long")
        return self.llm.encode(prompt)

    def check_size(self, param: str, **values: Any) -> None:
        """400 naming `param` when a request's JSON fields (`values` by name: a conversation, its tools, template
        variables) hold more characters than this server renders, before any rendering or tokenizing; a field nested
        too deep is a 400 naming it."""
        if sum(json_size(value, name) for name, value in values.items()) > self.max_chars:
            raise APIError(400, f"the {param} is over this server's limit of {self.max_chars} characters",
                           param=param, code="prompt_too_long")

    def answer_constraint(self, tools: ToolRequest | None, structured: Structured | None,
                          constrained_by: str | None) -> tuple[Structured | None, str | None]:
        """The answer's constraint and the field it comes from: the tool grammar when tool_choice forces calls (then
        a structured-output field too is a 400 naming it), else the request's own (`structured`, from
        `constrained_by`)."""
        if tools is None or not tools.enforced:
            return structured, constrained_by
        if structured is not None:
            raise APIError(400, f"tool_choice {tools.choice!r} constrains the answer to tool calls: it cannot take "
                                f"{constrained_by} too", param=constrained_by)
        tags = self.llm.tokenizer.token_id(START) is not None and self.llm.tokenizer.token_id(END) is not None
        return Structured(grammar=tools.grammar(tags)), "tools"

    def check_model(self, model: str | None) -> None:
        """404 when a request names a model this server does not serve (None: the served one), as OpenAI answers it."""
        if model is not None and model != self.name:
            raise APIError(404, f"The model `{model}` does not exist (this server serves `{self.name}`)",
                           param="model", code="model_not_found")

    def budget(self, prompt: Sequence[int], asked: int | None, default: int | None,
               param: str = "max_tokens") -> int:
        """max_tokens for a prompt: asked, or the default (None: the rest of the context); 400 past the context,
        naming `param` (the endpoint's own name for max_tokens) or the prompt."""
        max_seq_len = self.llm.engine.max_seq_len
        room = max_seq_len - len(prompt)
        max_tokens = (room if default is None else default) if asked is None else asked
        if room < 1 or max_tokens > room:
            raise APIError(400, f"This model's maximum context length is {max_seq_len} tokens. However, you requested "
                                f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} for the "
                                f"completion).", param="prompt" if room < 1 else param,
                           code="context_length_exceeded")
        return max_tokens

    async def submit(self, jobs: Sequence[tuple[list[int], Any]], param: str | None = None,
                     constrained_by: str | None = None) -> list[RequestHandle]:
        """`submit_all` off the loop: submitting validates a request, compiling its constraint (the matcher then
        stays on the request: the scheduler never compiles), so a constrained request goes through the grammar pool
        and an unconstrained one never waits behind it."""
        constrained = any(getattr(sampling, "structured", None) is not None for _, sampling in jobs)
        run = self.compiling if constrained else self.off_loop
        return await run(submit_all, self.llm, jobs, param, self.metrics, constrained_by)


def json_size(value: Any, param: str, depth: int = 0) -> int:
    """Characters of the strings and keys in a JSON value; 400 past MAX_JSON_DEPTH levels of nesting."""
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"{param} nests deeper than {MAX_JSON_DEPTH} levels", param=param)
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(str(k)) + json_size(v, param, depth + 1) for k, v in value.items())
    if isinstance(value, list):
        return sum(json_size(v, param, depth + 1) for v in value)
    return 1


def submit_all(llm: LLM, jobs: Sequence[tuple[list[int], Any]], param: str | None = None,
               metrics: RequestMetrics | None = None, constrained_by: str | None = None) -> list[RequestHandle]:
    """Submit every (prompt ids, sampling) or none: a refusal (full queue, invalid request) cancels the ones
    already queued and raises its typed error before any response is sent; `metrics` then follows the accepted.
    A constraint that does not compile is a 400 naming `constrained_by`, the field it came from.

    Every job waits in the queue before any is admitted, so more jobs than the queue holds could never be
    accepted: that is a 400 naming `param` (retrying cannot help), where a queue full of others' requests is a 429.
    """
    limit = llm.scheduler.max_waiting
    if len(jobs) > limit:
        raise APIError(400, f"this request asks for {len(jobs)} completions (prompts x n), more than this server "
                            f"queues at once (--max-waiting {limit}): it can never be accepted; send at most "
                            f"{limit} per request", param=param, code="exceeds_max_waiting")
    handles: list[RequestHandle] = []
    try:  # queued together (`LLM.submit_many`): the loop admits a request's choices or prompts as one batch
        handles = llm.submit_many([prompt for prompt, _ in jobs], [sampling for _, sampling in jobs])
        for handle in handles:
            if handle.done():  # the scheduler fails an invalid request's handle at submit
                handle.result(timeout=0)
    except BaseException as error:
        for handle in handles:
            handle.cancel()
        if isinstance(error, StructuredOutputError):
            raise APIError(400, f"{constrained_by}: {error}", param=constrained_by) from None
        raise
    if metrics is not None:
        metrics.watch_all(handles)
    return handles


async def finish_all(request: Request, handles: list[RequestHandle]) -> list[Completion]:
    """Every handle's Completion; if the client disconnects first (or one fails), the others are cancelled."""

    async def wait(handle: RequestHandle) -> Completion:
        async for _ in handle.deltas():
            pass
        return handle.result(timeout=0)

    watcher = asyncio.create_task(cancel_on_disconnect(request, handles))
    try:
        return list(await asyncio.gather(*(wait(h) for h in handles)))
    finally:
        watcher.cancel()
        for handle in handles:
            handle.cancel()  # no-op for a finished one


async def cancel_on_disconnect(request: Request, handles: list[RequestHandle]) -> None:
    """Wait for the client to go away (the body is read, so the next ASGI message is the disconnect); cancel."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except Exception:  # noqa: BLE001 - a broken connection is a disconnect too
        pass
    for handle in handles:
        handle.cancel()


async def merged(handles: list[RequestHandle]) -> AsyncIterator[tuple[int, list[int], str, Completion | None]]:
    """(choice index, new token ids, new text, Completion once it ended) from every handle as they arrive; a failed
    handle raises its error. Leaving early (the client left) cancels every handle."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, handle: RequestHandle) -> None:
        try:
            async for tokens, text in handle.deltas():
                queue.put_nowait((i, tokens, text, None))
            queue.put_nowait((i, [], "", handle.result(timeout=0)))
        except BaseException as error:  # noqa: BLE001 - handed to the consumer, which raises it
            queue.put_nowait((i, None, None, error))

    tasks = [asyncio.create_task(pump(i, h)) for i, h in enumerate(handles)]
    try:
        left = len(handles)
        while left:
            i, tokens, text, done = await queue.get()
            if isinstance(done, BaseException):
                raise done
            left -= done is not None
            yield i, tokens, text, done
    finally:
        for task in tasks:
            task.cancel()
        for handle in handles:
            handle.cancel()
