"""The HTTP server: `create_app` assembles one FastAPI app over one LLM (the key and body guard, the error
handlers, the metrics, and the routers: OpenAI's completions and chat, Responses, Anthropic Messages, the tokenizer
routes, /v1/models, /health, /metrics); `serve` runs it under uvicorn, listening at once while the engine warms up
(readiness.py), `BackgroundServer` on a thread.

FastAPI on uvicorn, as vLLM serves: pydantic request models give OpenAI-shaped 400s for free, and uvicorn's
ASGI 2.3 interface tells a streaming response when its client leaves. Each router takes the app's `ServeContext`
(context.py): one model check, one context budget, one submit path, one bounded pool off the event loop.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import JSONResponse

from ...errors import ConfigError
from .anthropic_messages import anthropic_error, messages_router
from .completions import completions_router
from .context import ServeContext
from .http_guard import HTTP_PROTOCOL, HTTPGuard, ServerLimits
from .metrics import HTTPCounter, RequestMetrics, metrics_router
from .openapi import answers, get_and_head, install_openapi
from .readiness import Readiness, WarmupGate
from .response_models import Health, ModelCard, ModelList, Warming
from .replies import install_error_handlers
from .responses import responses_router
from .tokenization import tokenization_router

if TYPE_CHECKING:
    from ..llm import LLM

log = logging.getLogger("pocketjax.server")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def create_app(llm: LLM, *, model_name: str | None = None, api_key: str | None = None,
               max_waiting: int | None = None, trust_request_chat_template: bool = False,
               limits: ServerLimits | None = None, readiness: Readiness | None = None) -> FastAPI:
    """A FastAPI app serving `llm` (whose scheduler it shares with any other caller); `api_key` guards every route
    but /health and /metrics, checked before the body is read (`HTTPGuard`).

    `max_waiting` bounds the scheduler's queue: past it a request gets 429 at once instead of waiting.
    `trust_request_chat_template` lets `chat_template_kwargs.chat_template` replace the checkpoint's template (a
    template is code; off, such a request gets 400). `limits`: body, prompt and connection bounds (ServerLimits).
    `readiness`: the engine's warm-up, when it runs beside the server (`serve`): until it is done /health answers 503
    with its progress and the generation routes 503 with Retry-After; None: ready now.
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
    readiness = Readiness() if readiness is None else readiness
    app = FastAPI(title="pocketjax", version="0.1.0")
    install_error_handlers(app)
    vocab = max(llm.tokenizer.vocab_size, llm.model.config.vocab_size)  # every id one of them refuses is refused
    install_openapi(app, model_name=name, max_seq_len=llm.engine.max_seq_len, max_choices=limits.max_choices,
                    vocab_size=vocab, api_key=api_key is not None)
    shapes = {"/v1/messages": anthropic_error}
    app.add_middleware(WarmupGate, readiness=readiness, error_shapes=shapes)  # inside the guard: the key comes first
    app.add_middleware(HTTPGuard, api_key=api_key, limits=limits, error_shapes=shapes)
    metrics = app.state.metrics = RequestMetrics(llm, name)
    app.add_middleware(HTTPCounter, metrics=metrics)
    ctx = app.state.context = ServeContext(llm, name, limits, metrics, int(time.time()),
                                           trust_request_chat_template=trust_request_chat_template)
    if llm.engine.constrainer is not None:
        # llguidance builds its view of the vocabulary holding the GIL (~1 s at Qwen's): no host thread keeps the
        # event loop free through that, so it is built now, before the first request, warm-up or not
        llm.engine.constrainer.prepare()

    @get_and_head(app, "/health", responses={
        **answers(Health, description="Ready: the queue."),
        503: {"model": Warming, "description": "Not ready: warming up (with its progress) or failed."}})
    async def health() -> Any:
        """200 and the queue once ready; 503 and the warm-up's progress before (readiness probes wait on it)."""
        if not readiness.ready:
            return JSONResponse(readiness.health(), status_code=503)
        sched = llm.scheduler
        return {"status": "ok", "running": len(sched.running), "waiting": len(sched.waiting),
                "free_slots": llm.engine.num_free_slots}

    v1 = APIRouter(prefix="/v1")
    v1.include_router(models_router(ctx))
    v1.include_router(completions_router(ctx))
    v1.include_router(responses_router(ctx))
    v1.include_router(messages_router(ctx))
    app.include_router(v1)
    app.include_router(tokenization_router(ctx))
    app.include_router(metrics_router(metrics))
    return app


def models_router(ctx: ServeContext) -> APIRouter:
    """GET /models and /models/{id} (mounted under /v1): the one model this server serves."""
    router = APIRouter()

    def model_card() -> dict[str, Any]:
        return {"id": ctx.name, "object": "model", "created": ctx.created, "owned_by": "pocketjax",
                "max_model_len": ctx.llm.engine.max_seq_len}

    @get_and_head(router, "/models", responses=answers(ModelList, 400))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card()]}

    @get_and_head(router, "/models/{model:path}", responses=answers(ModelCard, 400, 404))
    async def model(model: str) -> dict[str, Any]:
        """One model's card (`client.models.retrieve`); a name this server does not serve is a 404."""
        ctx.check_model(model)
        return model_card()

    return router


def default_model_name(llm: LLM) -> str:
    """The name clients pass as `model`: the checkpoint folder's name (the embedded model: pocket-coder)."""
    path = getattr(llm.model, "path", None)
    return str(path).rstrip("/").rsplit("/", 1)[-1] if path else "pocketjax"


def serve(llm: LLM, host: str = "127.0.0.1", port: int = 8000, *, api_key: str | None = None,
          model_name: str | None = None, max_waiting: int | None = None, log_level: str = "info",
          trust_request_chat_template: bool = False, limits: ServerLimits | None = None, warmup: bool = False) -> None:
    """Serve `llm` until interrupted (the CLI's `pocketjax serve`), with `limits` on bodies and connections.
    `warmup`: compile every engine shape on a thread while already listening (`Readiness`); `llm` must not have
    started its scheduler (nothing else may drive the engine meanwhile)."""
    import uvicorn

    if api_key is None and host not in LOOPBACK:
        log.warning("serving on %s without --api-key: anyone who can reach this port can use the model", host)
    if trust_request_chat_template:
        log.warning("--trust-request-chat-template: clients may render their own chat templates (bounded in time "
                    "and size, but code all the same)")
    limits = ServerLimits() if limits is None else limits
    if warmup and llm.started:
        raise ConfigError("serve(warmup=True) needs an LLM whose scheduler has not started (it would drive the "
                          "engine beside the warm-up): warm it up first, or pass warmup=False")
    readiness = Readiness()
    app = create_app(llm, model_name=model_name, api_key=api_key, max_waiting=max_waiting,
                     trust_request_chat_template=trust_request_chat_template, limits=limits, readiness=readiness)
    if warmup:  # listening from now on; /health is 503 "warming" until it is done
        readiness.start(lambda progress: llm.engine.warmup(progress_callback=progress))
    options = limits.uvicorn_options()
    log.info("HTTP: uvicorn's %s, at most %d connections", HTTP_PROTOCOL.__name__, limits.connections())
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, **options)
    finally:
        readiness.stop()  # interrupted while warming up: end after the current shape, then exit


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


def main() -> None:
    """Print the document `pocketjax serve` publishes with its defaults (the embedded model, no key), which
    docs/openapi.json holds: `python -m pocketjax.serve.http.server > docs/openapi.json` (tests/test_openapi.py
    compares them)."""
    import json

    from ..llm import LLM

    with LLM(warmup=False) as llm:
        print(json.dumps(create_app(llm).openapi(), indent=2, ensure_ascii=False))


if __name__ == "__main__":
    main()
