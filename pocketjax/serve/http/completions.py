"""POST /v1/completions and /v1/chat/completions: OpenAI's two generation endpoints (with vLLM's extras) over the
server's `ServeContext`, beside the Responses and Anthropic routers built the same way.

Every choice is a handle of its own on the LLM's one Scheduler, so HTTP clients share continuous batching; the
event loop only waits on handles (`RequestHandle.deltas`), never on the device, and prepares requests (templates,
tokenizing, constraint compiles) on the context's host pool. A client that disconnects cancels its handles, which
frees their slots at the next step.
"""
from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request

from ...engine.request import Completion
from ...errors import CheckpointError
from .api_error import APIError
from .context import ServeContext, finish_all, merged
from .logprobs import TokenText, chat_logprobs, completion_logprobs, prompt_logprobs, trimmed
from .openapi import GENERATION, answers
from .openai_protocol import ChatCompletionRequest, CompletionRequest, SamplingFields, with_seed
from .replies import Reply, sse_response
from .response_models import ChatCompletion, Completion as CompletionBody
from .tool_calls import ToolRequest, answer_format

if TYPE_CHECKING:
    from ..llm import LLM

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


def completions_router(ctx: ServeContext) -> APIRouter:
    """POST /completions and /chat/completions (mounted under /v1) over the server's context (model check, context
    budget, the bounded host pool, submit with its limits and metrics)."""
    router = APIRouter()
    llm, limits = ctx.llm, ctx.limits
    text_of = TokenText(llm.tokenizer)

    def check(body: SamplingFields) -> None:
        ctx.check_model(body.model)
        body.check_supported()

    @router.post("/completions", responses=answers(CompletionBody, *GENERATION, stream=True))
    async def completions(body: CompletionRequest, request: Request):
        check(body)
        prompts = prompt_list(body.prompt)
        if len(prompts) * (body.n or 1) > limits.max_choices:
            raise APIError(400, f"{len(prompts)} prompts x n={body.n or 1} is over this server's limit of "
                                f"{limits.max_choices} completions per request", param="n")
        ids = [await ctx.off_loop(ctx.encode, p) if isinstance(p, str) else ctx.encode(p) for p in prompts]
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
            sampling = body.sampling(ctx.budget(prompt, asked, COMPLETIONS_MAX_TOKENS), top or 0,
                                     body.prompt_top(top if echo else None), structured)
            jobs += [(prompt, with_seed(sampling, i)) for i in range(n)]
        if score_only and top is None:
            jobs = []
        reply = Reply(f"cmpl-{uuid.uuid4().hex}", "text_completion", ctx.name,
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

    @router.post("/chat/completions", responses=answers(ChatCompletion, *GENERATION, stream=True))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check(body)
        if (body.n or 1) > limits.max_choices:
            raise APIError(400, f"n={body.n} is over this server's limit of {limits.max_choices} completions per "
                                f"request", param="n")
        options = body.template_options(ctx.trust_request_chat_template, llm.tokenizer.chat_templates)
        messages = body.chat_messages()
        ctx.check_size("messages", messages=messages, chat_template_kwargs=options, tools=body.tools,
                       functions=body.functions)
        tools = await ctx.checked_tools(body.tools or body.functions, body.tool_request)  # compiles their schemas
        own, field = body.constraint()
        structured, constrained_by = ctx.answer_constraint(tools, answer_format(tools, own, field), field)
        prompt = await ctx.off_loop(render_prompt, llm, messages, options, ctx.encode, tools)
        prompt = body.truncated(prompt, llm.engine.max_seq_len)
        top = (body.top_logprobs or 0) if body.logprobs else None
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if body.max_completion_tokens is not None and body.max_tokens is not None:  # the newer name wins; the
            if body.max_tokens < 1:  # older still holds to its range, as the document says
                raise APIError(400, "max_tokens must be >= 1", param="max_tokens")
            ctx.budget(prompt, body.max_tokens, None)
        sampling = body.sampling(ctx.budget(prompt, asked, None), top or 0, body.prompt_logprobs,
                                 structured=structured, tools=tools)
        handles = await ctx.submit([(prompt, with_seed(sampling, i)) for i in range(body.n or 1)], "n",
                                   constrained_by)
        as_ids = bool(body.return_tokens_as_token_ids)
        reply = Reply(f"chatcmpl-{uuid.uuid4().hex}", "chat.completion", ctx.name, handles, len(prompt),
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

    return router


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    """OpenAI's four prompt forms as a list of prompts: a string, strings, token ids, lists of token ids."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    return list(prompt)


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


def finish_reason(completion: Completion) -> str:
    return completion.finish_reason or "stop"


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
