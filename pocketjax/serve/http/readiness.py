"""Listening while the engine warms up: `/health` says "warming" (503, with progress) until every step shape is
compiled, and the generation routes answer 503 with Retry-After until then.

Why: compiling every shape takes 77-222 s on 2 cores with an empty compile cache; a server that only listens after
that looks dead to a liveness probe and refuses connections to every client. Listening at once, a readiness probe or
a load balancer waits on `/health`, the process is visibly alive, and the routes that need no engine step (models,
tokenizer, metrics) answer from the first second.

Why 503 rather than queueing a generation request until warm: warm-up and the scheduler both drive the engine's
device state, so a queued request could only wait, for up to minutes, holding a connection; a 503 with Retry-After
is what a load balancer and the openai / anthropic clients already retry on (they honour Retry-After), and a client
that calls a server still warming learns so at once.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from .api_error import error_body
from .http_guard import ErrorShape

log = logging.getLogger("pocketjax.server")
# The routes that run engine steps: refused while warming. /v1/messages/count_tokens, /v1/models, /tokenize,
# /metrics and /health need none and answer throughout.
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"})
RETRY_AFTER_S = 5  # warm-up compiles one shape in ~0.5-5 s on 2 cores; clients come back about that often
Progress = Callable[[int, int], None]


class WarmupStopped(Exception):
    """Raised from the progress callback once `Readiness.stop` is called: the warm-up ends after its current shape."""


class Readiness:
    """Whether a server's engine is warm: "warming" from `start` until its warm-up returns ("ready") or raises
    ("failed"); `done` / `total` count the shapes compiled so far. A Readiness never started is ready."""

    def __init__(self) -> None:
        self.done, self.total = 0, 0
        self.error: str | None = None
        self._warming = False
        self._started = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def status(self) -> str:
        return "failed" if self.error is not None else "warming" if self._warming else "ready"

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def progress(self, done: int, total: int) -> None:
        """The warm-up's progress callback: `done` of `total` shapes compiled (WarmupStopped once `stop` is called)."""
        self.done, self.total = done, total
        if self._stop.is_set():
            raise WarmupStopped(f"stopped after {done} of {total} shapes: the server is shutting down")

    def start(self, warm: Callable[[Progress], Any]) -> threading.Thread:
        """Run `warm(self.progress)` (e.g. `engine.warmup(progress_callback=...)`) on a daemon thread; ready when
        it returns. Nothing else may drive the engine until then: the generation routes are refused meanwhile."""
        self._warming, self._started = True, time.monotonic()
        thread = self._thread = threading.Thread(target=self._run, args=(warm,), name="pocketjax-warmup", daemon=True)
        thread.start()
        return thread

    def stop(self, timeout: float = 120.0) -> None:
        """End a running warm-up after the shape it is compiling and wait for it (a server shutting down: a process
        that exits while XLA compiles on another thread aborts in C++ instead of exiting cleanly)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self, warm: Callable[[Progress], Any]) -> None:
        try:
            warm(self.progress)
        except WarmupStopped as e:
            log.info("warm-up %s", e)
            self.error = str(e)
        except BaseException as e:  # noqa: BLE001 - reported on /health, and the generation routes stay closed
            log.exception("warm-up failed; /health answers 503 and generation routes stay closed")
            self.error = f"{type(e).__name__}: {e}"
        else:
            log.info("warm-up done: %d shapes in %.1f s; ready", self.done, time.monotonic() - self._started)
        finally:
            self._warming = False

    def health(self) -> dict[str, Any]:
        """/health's body while not ready: the status, the shapes compiled of all, seconds since warm-up began."""
        body: dict[str, Any] = {"status": self.status, "progress": {"done": self.done, "total": self.total},
                                "seconds": round(time.monotonic() - self._started, 1)}
        if self.error is not None:
            body["error"] = self.error
        return body


class WarmupGate:
    """ASGI middleware: while `readiness` is not ready, 503 with Retry-After on the generation routes (in the route's
    API's error shape, as `HTTPGuard`'s errors); everything else passes."""

    def __init__(self, app: Callable, *, readiness: Readiness, error_shapes: dict[str, ErrorShape] | None = None):
        self.app, self.readiness, self.error_shapes = app, readiness, error_shapes or {}

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        path = scope.get("path") or ""
        if scope["type"] != "http" or path not in GENERATION_PATHS or self.readiness.ready:
            return await self.app(scope, receive, send)
        state = self.readiness
        message = (f"warm-up failed ({state.error}): this server cannot generate" if state.error is not None else
                   f"the server is warming up ({state.done} of {state.total or '?'} shapes compiled): retry after "
                   f"{RETRY_AFTER_S} s, or wait until GET /health answers 200")
        error = error_body(message, "service_unavailable", code="warming_up")
        shape = next((f for prefix, f in self.error_shapes.items() if path.startswith(prefix)), None)
        body = json.dumps(error if shape is None else shape(503, error)).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"retry-after", str(RETRY_AFTER_S).encode())]})
        await send({"type": "http.response.body", "body": body})
