"""POST /tokenize, POST /detokenize, GET /tokenizer_info: the server's tokenizer over HTTP, in vLLM's shapes.

Clients count tokens against the context with them, and lm-evaluation-harness's `local-completions` probes
`/tokenizer_info` then `/tokenize` (its `tokenizer_backend="auto"`): when both answer it tokenizes through the
server (`RemoteTokenizer`: eos/bos/pad tokens and the chat template from /tokenizer_info, ids from /tokenize with
`add_special_tokens: false`, text from /detokenize) instead of loading the checkpoint's tokenizer itself.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from .api_error import APIError
from .openapi import ANSWERED, answers, get_and_head
from .openai_messages import ChatMessage, Tool
from .openai_protocol import TokenId, chat_messages, template_options
from .response_models import Text, Tokens

if TYPE_CHECKING:
    from ..llm import LLM
    from .context import ServeContext


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one: `prompt` or `messages`."""

    # an unknown field is a 400 naming it; exactly one of prompt and messages (the route says so too)
    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}}]})
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template adds them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None  # only a name of one of the checkpoint's own templates
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")  # an unknown field is a 400 naming it
    model: str | None = None
    tokens: list[TokenId]


def tokenization_router(ctx: ServeContext) -> APIRouter:
    """The three routes over the served LLM's tokenizer; requests naming another model get 404 as the /v1 routes do,
    and tokenizing or rendering runs on the context's host pool, as the /v1 routes prepare their prompts."""
    llm = ctx.llm
    tokenizer = llm.tokenizer
    router = APIRouter()

    @router.post("/tokenize", responses=answers(Tokens, *ANSWERED))
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "send exactly one of prompt or messages", param="prompt")
        if body.messages is None:  # the server's prompt-size limit holds here as on /v1: 400 before tokenizing
            ctx.check_size("prompt", prompt=body.prompt)
            ids = await ctx.off_loop(tokenizer.encode, body.prompt,  # a large prompt: off the event loop
                                     add_special_tokens=body.add_special_tokens in (None, True))
        else:
            if body.chat_template is not None and body.chat_template not in tokenizer.chat_templates:
                raise APIError(400, f"chat_template must name one of this model's templates "
                                    f"{sorted(tokenizer.chat_templates)}; a template in the request is not "
                                    f"accepted", param="chat_template")
            options = {**template_options(body.chat_template_kwargs, trusted=False),  # variables only (400 naming
                       "add_generation_prompt": body.add_generation_prompt}  # a key that would replace more)

            def render() -> list[int]:  # off the event loop, as the chat endpoint renders (bounded by the sandbox)
                text = tokenizer.apply_chat_template(chat_messages(body.messages), tools=body.tools,
                                                     chat_template=body.chat_template,
                                                     continue_final_message=body.continue_final_message, **options)
                return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))

            ctx.check_size("messages", messages=body.messages, chat_template_kwargs=body.chat_template_kwargs,
                           tools=body.tools)
            ids = await ctx.off_loop(render)
        out: dict[str, Any] = {"count": len(ids), "max_model_len": llm.engine.max_seq_len, "tokens": ids,
                               "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = [tokenizer.backend.id_to_token(i) for i in ids]
        return out

    @router.post("/detokenize", responses=answers(Text, *ANSWERED))
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        ctx.check_model(body.model)
        bad = [t for t in body.tokens if not 0 <= t < tokenizer.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary [0, {tokenizer.vocab_size})",
                           param="tokens")
        return {"prompt": tokenizer.decode(body.tokens, skip_special_tokens=False)}

    @get_and_head(router, "/tokenizer_info", responses=answers(
        None, 400, description="tokenizer_config.json as vLLM serves it (special tokens as text, the chat template)."))
    async def tokenizer_info() -> dict[str, Any]:
        return tokenizer_config(llm)

    return router


def tokenizer_config(llm: LLM) -> dict[str, Any]:
    """tokenizer_config.json as vLLM's /tokenizer_info serves it (transformers' init kwargs): special tokens as
    their text, added_tokens_decoder as id -> text, plus tokenizer_class and the default chat template's source."""
    tokenizer = llm.tokenizer
    config = {key: value for key, value in tokenizer.config.items() if key not in ("vocab_file", "merges_file")}
    for key in ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"):
        if key in config:
            config[key] = tokenizer.special_tokens.get(key)
    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        config["added_tokens_decoder"] = {k: v.get("content") if isinstance(v, dict) else v
                                          for k, v in decoder.items()}
    config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    templates = tokenizer.chat_templates
    default = templates.get("default") or (next(iter(templates.values())) if len(templates) == 1 else None)
    config["chat_template"] = default
    return config
