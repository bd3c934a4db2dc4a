"""The HTTP side of `lowbit serve`: an OpenAI-compatible FastAPI app over one Engine.

    GET  /v1/models, /v1/models/{id}   the served model, its context and the KV scheme actually served
    POST /v1/completions                prompt (text or token ids) -> text; stream=true for SSE
    POST /v1/chat/completions           messages through the model's chat template; stream=true for SSE
    GET  /health                        200 while the engine's worker is alive, else 503
    GET  /metrics                       JSON: KV bytes held, quantized tokens, tokens/s, requests,
                                        queue depth; Prometheus text (format 0.0.4) for
                                        ?format=prometheus or an Accept header naming text/plain or
                                        openmetrics (what Prometheus scrapers send); ?format=json wins

Errors use OpenAI's body {"error": {"message", "type", "param", "code"}}: malformed JSON and
invalid fields -> 400, unknown model -> 404, a prompt that does not fit the context -> 400.
Each response carries the served scheme in `system_fingerprint` and, as an extension field
`lowbit`, how many of its tokens sat quantized in its cache when it finished.

Every /v1 request is logged in one line on the `lowbit.serve.requests` logger when it ends (method,
path, status, id, prompt + completion tokens, finish reason, seconds, quantized tokens); `lowbit
serve` shows these lines on stderr unless --no-request-log (enable_request_log). /health and
/metrics are not logged (scrapers would flood the log).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from jinja2 import TemplateError
from starlette.exceptions import HTTPException as StarletteHTTPException

from lowbit import __version__
from lowbit.serve import engine as eng
from lowbit.serve.batch_engine import AdmissionError
from lowbit.serve.metrics import PROMETHEUS_CONTENT_TYPE, wants_prometheus
from lowbit.serve.protocol import ChatCompletionRequest, CompletionRequest, error_body, unsupported

request_log = logging.getLogger("lowbit.serve.requests")


def enable_request_log(stream=None) -> None:
    """Show the one-line-per-request log on `stream` (default stderr), whatever the root log level.
    A stream given explicitly replaces the one an earlier call installed (one request-log handler)."""
    if stream is not None:
        for h in [h for h in request_log.handlers if getattr(h, "_lowbit_requests", False)]:
            request_log.removeHandler(h)
    if not any(getattr(h, "_lowbit_requests", False) for h in request_log.handlers):
        h = logging.StreamHandler(stream or sys.stderr)
        h.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%Y-%m-%d %H:%M:%S"))
        h._lowbit_requests = True
        request_log.addHandler(h)
    request_log.setLevel(logging.INFO)
    request_log.propagate = False


def request_line(method: str, path: str, status: int, seconds: float, *, rid: str | None = None,
                 done: dict | None = None, stream: bool = False, error: str | None = None) -> str:
    """The log line of one request. done: the engine's "done" payload (usage, finish_reason, quantized_tokens)."""
    parts = [f"{method} {path} {status}"]
    if rid:
        parts.append(rid)
    if done:
        u = done.get("usage") or {}
        parts.append(f"{u.get('prompt_tokens', '?')} prompt + {u.get('completion_tokens', '?')} completion tokens "
                     f"({done.get('finish_reason')}), {done.get('quantized_tokens', 0)} quantized")
    parts.append(f"{seconds:.2f} s" + (" stream" if stream else ""))
    if error:
        parts.append(error if len(error) <= 200 else error[:197] + "...")
    return " | ".join(parts)


SHUTTING_DOWN = "the server is shutting down; retry on another replica or after it restarts"


class InFlight:
    """The /v1 generation requests being answered, so that a shutdown (SIGTERM) can let them finish
    within a grace period and end the rest cleanly -- a 503 for a plain request, a final error event
    for a stream -- instead of uvicorn cancelling their handlers (HTTP 500 and tracebacks). Event-loop
    side only (asyncio), like the handlers that use it."""

    def __init__(self):
        self.live: dict[str, tuple[object, asyncio.Queue]] = {}
        self.draining = False

    def add(self, handle, events: asyncio.Queue) -> None:
        self.live[handle.id] = (handle, events)

    def remove(self, handle) -> None:
        self.live.pop(handle.id, None)

    async def drain(self, grace: float) -> dict:
        """Refuse new requests (503), wait up to `grace` seconds for the live ones to finish, then end
        the rest: the engine drops them before its next step and their handlers answer at once.
        Returns {"finished": n, "ended": n} (of the requests live when the drain began) and "seconds"."""
        self.draining = True
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        start = len(self.live)
        deadline = loop.time() + grace
        while self.live and loop.time() < deadline:
            await asyncio.sleep(0.05)
        left = list(self.live.values())
        for handle, events in left:
            handle.cancel()
            events.put_nowait(("shutdown", SHUTTING_DOWN))
        # the handlers now send their 503 / final event; give them a moment to leave before connections close
        until = loop.time() + 2.0
        while self.live and loop.time() < until:
            await asyncio.sleep(0.02)
        return {"finished": start - len(left), "ended": len(left), "seconds": round(loop.time() - t0, 2)}


async def _wait_disconnect(http: Request, handle, events: asyncio.Queue) -> None:
    """Wait for the client of a non-streamed request to go away; then drop its work. Why: nothing else
    reads the connection while the engine works, so a request whose client had left kept decoding to
    the end (one logged 200 after 711 s). The engine drops a cancelled request before its next step."""
    while True:
        msg = await http.receive()
        if msg["type"] == "http.disconnect":
            handle.cancel()
            events.put_nowait(("disconnected", None))
            return


# OpenAI's default for /v1/completions; chat defaults to the rest of the context, capped here.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
DEFAULT_CHAT_MAX_TOKENS = 512
# a prompt text longer than this many characters per context token is checked on its prefix first
PREFIX_CHARS_PER_TOKEN = 64
PREFIX_SLACK = 16


@dataclass
class ServedModel:
    """What the app needs besides the engine: the model id clients send, its scheme, its context."""

    id: str
    scheme: dict  # kvcache.served_scheme(...)
    max_context: int
    weights: dict | None = None  # the weight quantization served, if any
    created: int = 0


class ClientError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _validation_message(exc: RequestValidationError) -> str:
    errs = exc.errors()
    if not errs:
        return "invalid request"
    e = errs[0]
    if e.get("type") == "json_invalid":
        return f"request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}"
    loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
    return f"{loc or 'body'}: {e.get('msg')}" + (f" (got {e['input']!r})" if "input" in e and loc else "")


class _RequestClock:
    """Plain ASGI middleware (not BaseHTTPMiddleware, which would wrap the SSE streams): stamps each
    request's start (request.state.t0, the request log's seconds) and logs successful /v1 GETs.
    Generation requests log themselves when they end, errors in err()."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        scope.setdefault("state", {})["t0"] = t0
        status = {}

        async def send_status(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        await self.app(scope, receive, send_status)
        path = scope.get("path", "")
        if scope.get("method") == "GET" and path.startswith("/v1/") and status.get("code", 500) < 400:
            request_log.info(request_line("GET", path, status["code"], time.perf_counter() - t0))


def build_app(engine: eng.Engine, served: ServedModel) -> FastAPI:
    app = FastAPI(title="lowbit serve", version=__version__)
    tok = engine.tokenizer
    fingerprint = f"lowbit-{__version__}-kv-{served.scheme['name']}"
    served.created = served.created or int(time.time())
    inflight = app.state.inflight = InFlight()  # lowbit.serve.server drains it on shutdown

    def err(status: int, message: str, param=None, code=None, request: Request | None = None) -> JSONResponse:
        engine.metrics.client_error()
        if request is not None and request.url.path.startswith("/v1/"):
            t0 = getattr(request.state, "t0", None)
            request_log.info(request_line(request.method, request.url.path, status,
                                          time.perf_counter() - t0 if t0 else 0.0, error=message))
        type_ = "invalid_request_error" if status < 500 else "server_error"
        if status == 429:  # OpenAI's body for a request refused for capacity
            type_ = "requests"
        return JSONResponse(error_body(message, type_=type_, param=param, code=code), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError):
        return err(400, _validation_message(exc), request=request)

    @app.exception_handler(ClientError)
    async def _client_error(request: Request, exc: ClientError):
        return err(exc.status, exc.message, exc.param, exc.code, request=request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return err(exc.status_code, str(exc.detail), request=request)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception):  # a bug: still an OpenAI body, and logged
        logging.getLogger("lowbit.serve").error("unhandled error in %s", request.url.path, exc_info=exc)
        return err(500, f"internal server error: {type(exc).__name__}", request=request)

    app.add_middleware(_RequestClock)

    # ------------------------------------------------------------ info
    def model_card() -> dict:
        return {"id": served.id, "object": "model", "created": served.created, "owned_by": "lowbit",
                "max_model_len": served.max_context,
                "lowbit": {"kv_scheme": served.scheme, "weights": served.weights, "engine": engine.info}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != served.id:
            raise ClientError(404, f"model {model_id!r} not found; this server serves {served.id!r}", "model",
                              "model_not_found")
        return model_card()

    @app.get("/health")
    async def health():
        if not engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok", "model": served.id, "kv_scheme": served.scheme["name"]}

    @app.get("/metrics")
    async def metrics(request: Request, format: str | None = None):
        if format not in (None, "json", "prometheus"):
            raise ClientError(400, f"format {format!r} unknown; use json or prometheus", "format")
        if format == "prometheus" or (format is None and wants_prometheus(request.headers.get("accept"))):
            return PlainTextResponse(engine.metrics.prometheus(), media_type=PROMETHEUS_CONTENT_TYPE)
        return {"model": served.id, **engine.metrics.snapshot()}

    # ------------------------------------------------------ validation
    def check_common(req) -> None:
        if req.model != served.id:
            raise ClientError(404, f"model {req.model!r} not found; this server serves {served.id!r}", "model",
                              "model_not_found")
        msg = unsupported(req)
        if msg:
            raise ClientError(400, msg)

    def check_fit(n_prompt: int, max_tokens: int) -> None:
        if n_prompt == 0:
            raise ClientError(400, "the prompt is empty; send at least one token", "prompt")
        if n_prompt + max_tokens > served.max_context:
            raise ClientError(
                400,
                f"this model's context is {served.max_context} tokens, but the request needs {n_prompt + max_tokens} "
                f"({n_prompt} in the prompt, {max_tokens} to generate); shorten the prompt or lower max_tokens",
                "max_tokens" if n_prompt < served.max_context else "prompt",
                "context_length_exceeded",
            )

    def encode(text: str, param: str, **kw) -> list[int]:
        """Token ids of a prompt text; 400 for text that is not valid Unicode or cannot fit the context."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON can carry lone surrogates (\ud800); the tokenizer cannot
            raise ClientError(400, f"{param} is not valid Unicode (a lone surrogate at character {e.start}); "
                                   "send UTF-8 text", param) from None
        # a huge prompt (MBs) would hold the event loop for seconds in the tokenizer, only to be refused:
        # its first PREFIX_CHARS_PER_TOKEN * max_context characters already show whether it can fit
        # (a prefix's tokens exceed the whole's at most by the few the cut splits: PREFIX_SLACK); only a
        # prompt whose prefix fits is encoded whole
        cut = PREFIX_CHARS_PER_TOKEN * served.max_context
        if len(text) > cut and len(tok.encode(text[:cut], **kw)) > served.max_context + PREFIX_SLACK:
            raise ClientError(400, f"this model's context is {served.max_context} tokens, but the {param} alone "
                                   f"has more (its first {cut} characters do); shorten the prompt", param,
                              "context_length_exceeded")
        return list(tok.encode(text, **kw))

    def prompt_ids(req: CompletionRequest) -> list[int]:
        p = req.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise ClientError(400, f"prompt is a batch of {len(p)}; send one prompt per request", "prompt")
            p = p[0]
        if isinstance(p, str):
            return encode(p, "prompt")
        vocab = engine.model.config.vocab_size
        bad = [t for t in p if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ClientError(400, f"prompt token id {bad[0]!r} is outside the vocabulary [0, {vocab})", "prompt")
        return list(p)

    def chat_ids(req: ChatCompletionRequest) -> list[int]:
        if not getattr(tok, "chat_template", None):
            raise ClientError(400, f"model {served.id!r} has no chat template; use /v1/completions", "messages")
        try:
            msgs = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages]
        except ValueError as e:
            raise ClientError(400, str(e), "messages") from None
        try:
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        except (ValueError, TypeError, TemplateError) as e:  # e.g. a template that refuses a role order
            raise ClientError(400, f"the chat template rejected the messages: {e}", "messages") from None
        # the template writes the special tokens itself
        return encode(text, "messages", add_special_tokens=False)

    # ---------------------------------------------------------- running
    async def run(ids: list[int], req, max_tokens: int, kind: str, stream: bool, http: Request):
        engine.metrics.request(kind)
        t0 = time.perf_counter()
        path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
        if inflight.draining:
            request_log.info(request_line("POST", path, 503, time.perf_counter() - t0, error=SHUTTING_DOWN))
            r = err(503, SHUTTING_DOWN, code="server_shutting_down")
            r.headers["Retry-After"] = "1"
            return r
        params = eng.GenParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                               stop=req.stop_list(), seed=req.seed)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(what, payload):
            try:
                loop.call_soon_threadsafe(events.put_nowait, (what, payload))
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        try:
            handle = engine.submit(eng.Request(prompt_ids=ids, params=params, emit=emit))
        except AdmissionError as e:  # the batching engine: full (429, --when-full reject) or can never fit (400)
            request_log.info(request_line("POST", path, e.status, time.perf_counter() - t0, error=str(e)))
            r = err(e.status, str(e), "max_tokens" if e.status == 400 else None, e.code)
            if e.status == 429:
                r.headers["Retry-After"] = "1"
            return r
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + handle.id
        created = int(time.time())
        inflight.add(handle, events)
        if stream:
            return StreamingResponse(
                _sse(events, handle, rid, created, kind, req.include_usage(), t0, path),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        parts = []
        done = False
        watcher = asyncio.create_task(_wait_disconnect(http, handle, events))
        try:
            while True:
                what, payload = await events.get()
                if what == "delta":
                    parts.append(payload)
                elif what == "error":
                    request_log.info(request_line("POST", path, 500, time.perf_counter() - t0, rid=rid, error=payload))
                    done = True
                    return err(500, payload)
                elif what == "shutdown":
                    request_log.info(request_line("POST", path, 503, time.perf_counter() - t0, rid=rid, error=payload))
                    done = True
                    r = err(503, payload, code="server_shutting_down")
                    r.headers["Retry-After"] = "1"
                    return r
                elif what == "disconnected":  # nobody to answer; the finally logs it as 499
                    return JSONResponse(error_body("client closed the request"), status_code=499)
                else:
                    break
            done = True
            request_log.info(request_line("POST", path, 200, time.perf_counter() - t0, rid=rid, done=payload))
        finally:
            watcher.cancel()
            inflight.remove(handle)
            handle.cancel()  # no-op once done; drops the request if this handler was cancelled
            if not done:  # the client went away (or the server is stopping) before the answer
                request_log.info(request_line("POST", path, 499, time.perf_counter() - t0, rid=rid,
                                              error="cancelled before the answer"))
        text = "".join(parts)
        choice = ({"index": 0, "text": text, "logprobs": None, "finish_reason": payload["finish_reason"]}
                  if kind == "completions" else
                  {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                   "finish_reason": payload["finish_reason"]})
        return {"id": rid, "object": "text_completion" if kind == "completions" else "chat.completion",
                "created": created, "model": served.id, "system_fingerprint": fingerprint,
                "choices": [choice], "usage": payload["usage"],
                "lowbit": {"kv_scheme": served.scheme["name"], "quantized_tokens": payload["quantized_tokens"],
                           "engine": payload.get("engine")}}

    async def _sse(events, handle, rid, created, kind, include_usage, t0, path):
        obj = "text_completion" if kind == "completions" else "chat.completion.chunk"

        def chunk(delta_text=None, finish=None, role=False):
            if kind == "completions":
                choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
            else:
                delta = {}
                if role:
                    delta["role"] = "assistant"
                if delta_text is not None:
                    delta["content"] = delta_text
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            body = {"id": rid, "object": obj, "created": created, "model": served.id,
                    "system_fingerprint": fingerprint, "choices": [choice]}
            return f"data: {json.dumps(body)}\n\n"

        ended: dict = {"error": "cancelled mid-stream"}  # what the log line says when the loop does not finish
        try:
            if kind == "chat":
                yield chunk("", role=True)
            while True:
                what, payload = await events.get()
                if what == "delta":
                    yield chunk(payload)
                elif what == "error":
                    ended = {"error": payload}
                    yield f"data: {json.dumps(error_body(payload, type_='server_error'))}\n\n"
                    break
                elif what == "shutdown":  # the final event of a stream the shutdown ended
                    ended = {"error": payload}
                    body = error_body(payload, type_="server_error", code="server_shutting_down")
                    yield f"data: {json.dumps(body)}\n\n"
                    break
                else:
                    ended = {"done": payload}
                    yield chunk(None, finish=payload["finish_reason"])
                    if include_usage:
                        body = {"id": rid, "object": obj, "created": created, "model": served.id,
                                "system_fingerprint": fingerprint, "choices": [], "usage": payload["usage"],
                                "lowbit": {"kv_scheme": served.scheme["name"],
                                           "quantized_tokens": payload["quantized_tokens"],
                                           "engine": payload.get("engine")}}
                        yield f"data: {json.dumps(body)}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:
            inflight.remove(handle)
            handle.cancel()  # client gone mid-stream: the worker drops the request and its cache
            # the status line was 200 once streaming began; an error or cancel is said in the line itself
            request_log.info(request_line("POST", path, 200, time.perf_counter() - t0, rid=rid, stream=True, **ended))

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, http: Request):
        check_common(req)
        ids = prompt_ids(req)
        max_tokens = req.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS
        check_fit(len(ids), max_tokens)
        return await run(ids, req, max_tokens, "completions", req.stream, http)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, http: Request):
        check_common(req)
        ids = chat_ids(req)
        max_tokens = req.max_completion_tokens or req.max_tokens
        if max_tokens is None:
            max_tokens = max(1, min(DEFAULT_CHAT_MAX_TOKENS, served.max_context - len(ids)))
        check_fit(len(ids), max_tokens)
        return await run(ids, req, max_tokens, "chat", req.stream, http)

    return app
