"""HTTP routes: the OpenAI-compatible API over the engine.

Each completion request becomes one engine request per (prompt, choice); engine events arrive on
the engine thread and are handed to the request's asyncio queue. A streaming response turns them
into SSE chunks; a client that goes away (streaming or not, queued or running) aborts every
engine request it started, which frees their slots at once. Parsing, template rendering and
tokenization run on worker threads, never on the event loop, so a large body cannot hold up
other streams or ``/health``; the generation routes bypass FastAPI's routing
(:class:`GenerationLane`). Request parsing and response shapes live in
``protocol``, the checks every request passes (keys, body size, the last-resort 500) in
``guard``; this module wires them to the engine, the metrics and the request log.
Non-goal: model or engine code (this module imports neither ``model`` nor ``ops``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from headstart import __version__
from headstart.engine.engine import Engine, EngineRequest, Failed, Finish, Piece, QueueFull
from headstart.models import ChatFormat
from headstart.models.contract import ToolCallParsing
from headstart.sampling import derived_seed
from headstart.server import protocol as P
from headstart.server.auth import ApiKeys
from headstart.server.guard import ERROR, LOGGED, Guard, disconnected, read_body
from headstart.server.metrics import Metrics
from headstart.server.reasoning import ReasoningSplitter
from headstart.server.request_log import RequestLog, request_record
from headstart.server.turns import divergence
from headstart.tokenizer import Tokenizer

log = logging.getLogger("headstart.server")

R = TypeVar("R")

CHAT_PATH, COMPLETIONS_PATH = "/v1/chat/completions", "/v1/completions"
#: Threads that parse, render and tokenize request bodies (``ServerState.workers``).
PREP_WORKERS = 4


@dataclass
class ServerState:
    engine: Engine
    tokenizer: Tokenizer
    model_name: str
    context: int
    generation_defaults: dict[str, float]
    metrics: Metrics
    chat: ChatFormat = field(default_factory=ChatFormat)  # the model family's chat format
    # Chat-template variables the model folder asks for (headstart.json); a request's win.
    template_defaults: dict[str, Any] = field(default_factory=dict)
    keys: ApiKeys | None = None
    request_log: RequestLog | None = None
    max_tokens_cap: int | None = None  # server-wide cap on tokens generated per request
    max_body_bytes: int = 8 << 20  # larger request bodies get 413
    body_timeout_s: float = 30.0  # a body that takes longer to arrive gets 408
    metrics_open: bool = False  # /metrics without an API key even when keys are set
    draining: bool = False
    # Parsing, template rendering and tokenization run here, off the event loop.
    workers: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(
            max_workers=PREP_WORKERS, thread_name_prefix="headstart-prep"
        )
    )
    created: int = field(default_factory=lambda: int(time.time()))
    _ids: itertools.count = field(default_factory=itertools.count)
    _mailbox: _Mailbox | None = None

    def mailbox(self, loop: asyncio.AbstractEventLoop) -> _Mailbox:
        """The mailbox of engine events for ``loop`` (the server's one event loop)."""
        if self._mailbox is None or self._mailbox.loop is not loop:
            self._mailbox = _Mailbox(loop)
        return self._mailbox

    def next_engine_id(self) -> str:
        return f"e{next(self._ids)}"

    @property
    def max_generations(self) -> int:
        """Most engine requests (prompts x n) one HTTP request may start: more can never run."""
        return self.engine.num_slots + self.engine.max_queue


class _Mailbox:
    """Engine events on their way to the event loop's queues, one wake-up of the loop for all
    that are posted before it runs. Why: ``call_soon_threadsafe`` per event writes the loop's
    wake-up pipe per event, 16 writes a step at 16 streams, and each write gives up the
    interpreter, which the engine thread then waits to take back while the loop holds it.

    ``post`` runs on the engine thread, ``_deliver`` on the loop; each deque operation is
    atomic, and a post that finds its item alone after appending it schedules a delivery, so
    none is stranded: a delivery drains until the deque is empty."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.items: collections.deque[tuple[asyncio.Queue, Any]] = collections.deque()

    def post(self, queue: asyncio.Queue, item: Any) -> None:
        self.items.append((queue, item))
        if len(self.items) == 1:
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop is closed: nobody is left to read it
                self.items.clear()

    def _deliver(self) -> None:
        items = self.items
        while True:
            try:
                queue, item = items.popleft()
            except IndexError:
                return
            queue.put_nowait(item)


@dataclass
class _Choice:
    """What one choice has produced so far."""

    index: int
    engine_id: str
    splitter: ReasoningSplitter | None  # chat requests of a model that thinks
    tools: ToolCallParsing | None = None  # chat requests with tools, of a model that calls them
    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    logprobs: list[P.LogprobEntry] = field(default_factory=list)
    finish: Finish | None = None
    started: bool = False  # the first streamed chunk (with the role) was sent
    last_token_at: float | None = None


class _Generation:
    """One HTTP completion request's engine requests and their events."""

    def __init__(
        self,
        state: ServerState,
        kind: str,
        req: P.ChatCompletionRequest | P.CompletionRequest,
        prompts: list[list[int]],
        prompt_text: str | None,
        snapshot_at: tuple[int, ...] = (),
        info: dict[str, Any] | None = None,
    ) -> None:
        self.state = state
        self.info = info if info is not None else {}  # the guard's per-request scope state
        self.recorded = False
        self.kind = kind
        self.req = req
        self.prompts = prompts
        self.id = P.new_request_id("chat" if kind == "chat" else "completion")
        self.created = int(time.time())
        self.started_at = time.monotonic()
        self.ttft: float | None = None
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.choices: list[_Choice] = []
        self.params = []
        self.snapshot_at = snapshot_at
        self.error: str | None = None
        loop = asyncio.get_running_loop()
        for p, ids in enumerate(prompts):
            limit = state.context - len(ids)
            if state.max_tokens_cap is not None:
                limit = min(limit, state.max_tokens_cap)
            if limit < 1:
                field_name = "messages" if kind == "chat" else "prompt"
                raise P.APIError(
                    400,
                    f"the prompt has {len(ids)} tokens, which leaves no room "
                    f"in the context of {state.context} tokens",
                    param=field_name,
                    code="context_length_exceeded",
                )
            base = P.sampling_params(
                req,
                defaults=state.generation_defaults,
                max_new_tokens=limit,
                vocab_size=state.tokenizer.vocab_size,
            )
            for j in range(req.n):
                params = base
                if req.seed is not None and req.n > 1:  # distinct but reproducible choices
                    params = replace(base, seed=derived_seed(req.seed, j))
                index = p * req.n + j
                chat = state.chat
                splitter = (
                    ReasoningSplitter.for_prompt(prompt_text)
                    if prompt_text is not None and chat.thinks
                    else None
                )
                parser = (
                    chat.tool_calls(req.tools)
                    if kind == "chat" and req.parses_tool_calls and chat.tool_calls is not None
                    else None
                )
                self.choices.append(_Choice(index, state.next_engine_id(), splitter, parser))
                self.params.append((ids, params))

        mailbox = state.mailbox(loop)

        def sink_for(index: int):
            def sink(event: Any) -> None:
                mailbox.post(self.queue, (index, event))

            return sink

        self._sinks = [sink_for(c.index) for c in self.choices]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(c.finish.completion_tokens for c in self.choices if c.finish)

    @property
    def cached_tokens(self) -> int:
        """Per prompt, the most any of its choices restored from the prompt cache."""
        n = self.req.n
        return sum(
            max(
                (c.finish.cached_tokens if c.finish else 0)
                for c in self.choices[p * n : (p + 1) * n]
            )
            for p in range(len(self.prompts))
        )

    def submit(self) -> None:
        submitted = []
        try:
            for choice, (ids, params), sink in zip(
                self.choices, self.params, self._sinks, strict=True
            ):
                self.state.engine.submit(
                    EngineRequest(
                        choice.engine_id,
                        ids,
                        params,
                        params.max_tokens,
                        sink,
                        self.snapshot_at,
                        self.req.draft,
                    )
                )
                submitted.append(choice.engine_id)
        except QueueFull as e:
            for engine_id in submitted:
                self.state.engine.abort(engine_id)
            raise P.APIError(
                429,
                f"server busy: {e}; retry shortly",
                code="queue_full",
                headers={"Retry-After": "1"},
            ) from None
        except ValueError as e:
            for engine_id in submitted:
                self.state.engine.abort(engine_id)
            raise P.APIError(400, str(e), code="context_length_exceeded") from None

    def abort(self) -> None:
        for c in self.choices:
            if c.finish is None:
                self.state.engine.abort(c.engine_id)

    @property
    def done(self) -> bool:
        return self.error is not None or all(c.finish is not None for c in self.choices)

    def take(self, index: int, event: Any) -> list[dict[str, Any]]:
        """Record an engine event; return the chunks to stream for it."""
        c = self.choices[index]
        now = time.monotonic()
        if isinstance(event, Failed):
            self.error = event.message
            return []
        chunks: list[dict[str, Any]] = []
        if isinstance(event, Piece):
            if self.ttft is None:
                self.ttft = now - self.started_at
                self.state.metrics.first_token(self.ttft)
            elif c.last_token_at is not None:
                self.state.metrics.token(now - c.last_token_at)
            c.last_token_at = now
            entry = None
            if event.logprob is not None and self.params[index][1].logprobs is not None:
                entry = (event.token_id, event.logprob, event.top_logprobs or [])
                c.logprobs.append(entry)
            chunks += self._text_chunks(c, event.text, entry, None)
        elif isinstance(event, Finish):
            c.finish = event
            chunks += self._text_chunks(c, event.text, None, event.reason, event.stop_reason)
        return chunks

    def _text_chunks(
        self,
        c: _Choice,
        text: str,
        entry: P.LogprobEntry | None,
        finish_reason: str | None,
        stop_reason: str | int | None = None,
    ) -> list[dict[str, Any]]:
        as_ids = self.req.return_tokens_as_token_ids
        tok = self.state.tokenizer
        if self.kind == "chat":
            reasoning, content = c.splitter.push(text) if c.splitter else ("", text)
            if finish_reason is not None and c.splitter:
                r2, c2 = c.splitter.flush()
                reasoning, content = reasoning + r2, content + c2
            calls = []
            if c.tools is not None:
                first = len(c.tools.calls)
                content, calls = c.tools.push(content)
                if finish_reason is not None:
                    content += c.tools.flush()
                calls = [call.openai(index=first + k) for k, call in enumerate(calls)]
                if finish_reason == "stop" and c.tools.calls:
                    finish_reason = "tool_calls"
            c.reasoning.append(reasoning)
            c.text.append(content)
            logprobs = P.chat_logprobs(tok, [entry], as_token_ids=as_ids) if entry else None
            if not (reasoning or content or calls or logprobs or finish_reason or not c.started):
                return []
            role, c.started = not c.started, True
            return [
                P.chat_chunk(
                    request_id=self.id,
                    model=self.state.model_name,
                    index=c.index,
                    created=self.created,
                    role=role,
                    content=content or None,
                    reasoning=reasoning or None,
                    finish_reason=finish_reason,
                    logprobs=logprobs,
                    tool_calls=calls or None,
                    stop_reason=stop_reason,
                )
            ]
        offset = sum(len(t) for t in c.text)
        c.text.append(text)
        logprobs = (
            P.completion_logprobs(tok, [entry], as_token_ids=as_ids, text_offset=offset)
            if entry
            else None
        )
        # Every token gets its chunk, even one whose text is held back (part of a character,
        # or the start of a stop string): the client learns the token has come, and a first
        # token is counted when it is computed, not a decode step later (vLLM does the same).
        return [
            P.completion_chunk(
                request_id=self.id,
                model=self.state.model_name,
                index=c.index,
                text=text,
                created=self.created,
                finish_reason=finish_reason,
                logprobs=logprobs,
                stop_reason=stop_reason,
            )
        ]

    def usage(self) -> dict[str, Any]:
        return P.usage_info(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def full_response(self) -> dict[str, Any]:
        tok, as_ids = self.state.tokenizer, self.req.return_tokens_as_token_ids
        choices = []
        for c in self.choices:
            assert c.finish is not None
            if self.kind == "chat":
                reasoning = "".join(c.reasoning)
                calls = c.tools.calls if c.tools is not None else []
                reason = "tool_calls" if calls and c.finish.reason == "stop" else c.finish.reason
                text = "".join(c.text)
                choices.append(
                    P.chat_choice(
                        c.index,
                        content=text if text or not calls else None,
                        reasoning=reasoning or None,
                        finish_reason=reason,
                        stop_reason=c.finish.stop_reason,
                        tool_calls=[call.openai() for call in calls] or None,
                        logprobs=P.chat_logprobs(tok, c.logprobs, as_token_ids=as_ids)
                        if self.req.num_logprobs is not None
                        else None,
                    )
                )
            else:
                choices.append(
                    P.completion_choice(
                        c.index,
                        text="".join(c.text),
                        finish_reason=c.finish.reason,
                        stop_reason=c.finish.stop_reason,
                        logprobs=P.completion_logprobs(tok, c.logprobs, as_token_ids=as_ids)
                        if self.req.num_logprobs is not None
                        else None,
                    )
                )
        build = P.chat_completion_response if self.kind == "chat" else P.completion_response
        return build(
            request_id=self.id,
            model=self.state.model_name,
            choices=choices,
            usage=self.usage(),
            created=self.created,
        )

    def record(self, status: int, error: str | None = None) -> None:
        """Count and log this request's end, once (later calls do nothing)."""
        if self.recorded:
            return
        self.recorded = True
        self.info[LOGGED] = True
        state = self.state
        reasons = [c.finish.reason if c.finish else "abort" for c in self.choices]
        duration = time.monotonic() - self.started_at
        state.metrics.request_finished(
            status=status,
            finish_reason=reasons[0] if len(reasons) == 1 else "multi",
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            duration_s=duration,
            was_running=False,
        )
        if state.request_log is not None:
            state.request_log.write(
                request_record(
                    id=self.id,
                    endpoint=f"/v1/{'chat/' if self.kind == 'chat' else ''}completions",
                    status=status,
                    prompt_tokens=self.prompt_tokens,
                    completion_tokens=self.completion_tokens,
                    cached_tokens=self.cached_tokens,
                    ttft_s=self.ttft,
                    duration_s=duration,
                    finish_reason=reasons[0] if len(reasons) == 1 else reasons,
                    error=error,
                    n=len(self.choices),
                    stream=bool(self.req.stream),
                )
            )


def _error_response(e: P.APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _off_loop(state: ServerState, fn: Callable[..., R], *args: Any) -> R:
    return await asyncio.get_running_loop().run_in_executor(state.workers, fn, *args)


@dataclass(frozen=True)
class _Prepared:
    """A parsed, checked and tokenized completion request, ready for the engine."""

    req: P.ChatCompletionRequest | P.CompletionRequest
    prompts: list[list[int]]
    prompt_text: str | None = None  # chat: the rendered prompt (for the reasoning split)
    snapshot_at: tuple[int, ...] = ()


def _prepare_chat(state: ServerState, body: bytes) -> _Prepared:
    """Worker thread: parse, check and render a chat body, and encode it once."""
    req = P.parse_chat_request(body)
    _check_model(state, req.model)
    _check_size(state, 1, req.n)
    _check_text_size(state, [m.content or "" for m in req.messages], "messages")
    if state.template_defaults:
        kwargs = {**state.template_defaults, **req.chat_template_kwargs}
        req = req.model_copy(update={"chat_template_kwargs": kwargs})
    enc = P.chat_prompt(state.tokenizer, req)
    at = divergence(
        state.tokenizer.apply_chat_template,
        [m.template_dict() for m in req.messages],
        enc.text,
        req.tools,
        **req.chat_template_kwargs,
    )
    boundary = enc.tokens_within(at) if at is not None else 0
    # A snapshot there helps the next turn only when something follows it in this prompt.
    snapshot_at = (boundary,) if 0 < boundary < len(enc.ids) else ()
    return _Prepared(req, [enc.ids], enc.text, snapshot_at)


def _prepare_completion(state: ServerState, body: bytes) -> _Prepared:
    """Worker thread: parse and check a completions body, and encode its prompts."""
    req = P.parse_completion_request(body)
    _check_model(state, req.model)
    _check_size(state, len(req.prompt), req.n)
    for prompt in req.prompt:
        if isinstance(prompt, str):
            _check_text_size(state, [prompt], "prompt")
    return _Prepared(req, P.completion_prompts(state.tokenizer, req))


async def warm_request_path(state: ServerState) -> None:
    """Before the first request: start every parsing worker and run each generation route's
    parsing once (a completions body of token ids, one of text, a chat body), nothing sent to
    the engine. Why: the pool starts its threads one a request, on the first burst, and the
    first parse of each route runs code for the first time; both held the event loop and the
    engine thread's admission of the first burst of new prompts after start-up (BENCHMARKS.md).
    A failure here is logged and changes nothing else."""
    started = threading.Barrier(PREP_WORKERS)

    def meet() -> None:  # each task holds its thread until all have one: the pool starts them all
        started.wait(timeout=5.0)

    bodies = (
        (_prepare_completion, {"model": state.model_name, "prompt": [1, 2, 3], "max_tokens": 1}),
        (_prepare_completion, {"prompt": "Hello", "max_tokens": 1, "stream": True}),
        (_prepare_chat, {"messages": [{"role": "user", "content": "Hello"}], "stream": True}),
    )
    try:
        await asyncio.gather(*(_off_loop(state, meet) for _ in range(PREP_WORKERS)))
        for prepare, body in bodies:
            with contextlib.suppress(P.APIError):  # refused (say, no chat template): it ran
                await _off_loop(state, prepare, state, json.dumps(body).encode())
    except Exception:  # a slower first request, never a failed start-up
        log.exception("warming up the request path failed")


def _check_size(state: ServerState, prompts: int, n: int) -> None:
    """A request that could never be held at once is refused before any work (400, not the
    429 of a full queue, which says to retry)."""
    if prompts * n > state.max_generations:
        raise P.APIError(
            400,
            f"{prompts} prompt(s) x n={n} asks for {prompts * n} "
            f"generations; this server holds at most {state.max_generations} at "
            "once (slots + queue)",
            param="n" if prompts == 1 else "prompt",
            code="too_many_generations",
        )


#: The request models behind the routes that read their body themselves.
_BODIES = {CHAT_PATH: P.ChatCompletionRequest, COMPLETIONS_PATH: P.CompletionRequest}


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, with the request bodies of the completion routes (they parse the body
    themselves, so FastAPI cannot see it): what schema-driven clients and fuzzers read."""
    if app.openapi_schema is None:
        from fastapi.openapi.utils import get_openapi

        schema = get_openapi(title=app.title, version="1", routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for path, model in _BODIES.items():
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(body.pop("$defs", {}))
            components[model.__name__] = body
            ref = {"$ref": f"#/components/schemas/{model.__name__}"}
            schema["paths"][path]["post"]["requestBody"] = {
                "required": True,
                "content": {"application/json": {"schema": ref}},
            }
        app.openapi_schema = schema
    return app.openapi_schema


def _check_text_size(state: ServerState, texts: list[str], param: str) -> None:
    """Refuse, before tokenizing, text that cannot fit the context whatever its tokens: a text
    of n bytes has at least n / max_token_bytes tokens (with a 2x margin for normalizers that
    shrink text). Tokenizing megabytes only to find them too long would cost seconds of CPU."""
    size = sum(len(t.encode("utf-8")) for t in texts)
    limit = 2 * state.context * state.tokenizer.max_token_bytes
    if size > limit:
        raise P.APIError(
            400,
            f"the prompt's {size} bytes cannot fit the context of {state.context} tokens",
            param=param,
            code="context_length_exceeded",
        )


def create_app(state: ServerState, lifespan: Any = None) -> GenerationLane:
    app = FastAPI(
        title="headstart",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        lifespan=lifespan,
    )
    app.state.headstart = state
    app.openapi = lambda: _openapi(app)
    # Inside Starlette's outermost error middleware, which would re-raise to the server (and
    # so drop the connection) after any 500: the guard answers and returns instead.
    app.add_middleware(Guard, state=state)

    @app.exception_handler(P.APIError)
    async def api_error(request: Request, e: P.APIError) -> JSONResponse:
        return _answer_error(state, request.scope, e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        # Unknown routes (404) and wrong methods (405), in the OpenAI shape.
        if e.status_code == 404:
            message = f"{request.method} {request.url.path[:200]} is not an endpoint of this server"
        elif e.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path[:200]}"
        else:
            message = str(e.detail)
        err = P.APIError(e.status_code, message, headers=dict(e.headers or {}))
        return await api_error(request, err)

    @app.get("/health")
    async def health() -> Response:
        stats = state.engine.stats()
        body = {
            "status": "draining" if state.draining else "ok",
            "slots": stats["slots"],
            "free_slots": stats["free_slots"],
            "running": stats["running"],
            "waiting": stats["waiting"],
        }
        return JSONResponse(body, status_code=503 if state.draining else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = state.engine.stats()
        state.metrics.set_load(stats["running"], stats["waiting"])
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "headstart",
                    "max_model_len": state.context,
                }
            ],
        }

    # What SGLang's model gateway (sglang-router) reads from a worker when it registers one:
    # the served model's name (so the gateway lists and routes it by that name) and its limits.
    # Neither a model path nor a tokenizer path is given: the gateway routes HTTP workers by the
    # request's text and needs no tokenizer of its own.
    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        return {
            "served_model_name": state.model_name,
            "model_id": state.model_name,
            "context_length": state.context,
            "max_total_tokens": state.context * state.engine.num_slots,
            "tp_size": 1,
            "dp_size": 1,
            "is_embedding": False,
            "version": __version__,
        }

    @app.get("/model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "is_generation": True,
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }

    # What HTTP reaches is GenerationLane's handler; FastAPI's routes stay for the schema.
    @app.post(CHAT_PATH)
    async def chat(request: Request) -> Response:
        return await _generate(state, request, CHAT_PATH)

    @app.post(COMPLETIONS_PATH)
    async def completions(request: Request) -> Response:
        return await _generate(state, request, COMPLETIONS_PATH)

    return GenerationLane(app, state)


class GenerationLane:
    """The server's ASGI app: a POST to a generation route goes straight to its handler,
    behind the same :class:`Guard` as every route; anything else goes to the FastAPI app.

    Why: FastAPI's router and the five middleware layers it wraps around every ``send`` cost
    more of the event loop per request than the rest of the request's HTTP work, and a burst
    of new prompts waits for the loop to get through all of them. The lane answers an
    :class:`APIError` as the FastAPI app's handler does."""

    def __init__(self, app: FastAPI, state: ServerState) -> None:
        self.app, self.state = app, state
        self._guarded = Guard(self._serve, state)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in _PREPARE:
            await self._guarded(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    async def _serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            response = await _generate(self.state, request, scope["path"])
        except P.APIError as e:
            response = _answer_error(self.state, scope, e)
        await response(scope, receive, send)


_PREPARE = {
    CHAT_PATH: ("chat", _prepare_chat),
    COMPLETIONS_PATH: ("completion", _prepare_completion),
}


async def _generate(state: ServerState, request: Request, path: str) -> Response:
    kind, prepare = _PREPARE[path]
    # The request counts as arriving while its body is read and parsed, so an idle engine
    # gathering a burst waits for the ones still being parsed (Inbox.arriving).
    with state.engine.arriving():
        body = await read_body(request, state.max_body_bytes, state.body_timeout_s)
        # Even a small body goes to a worker: parsed on the loop, each request of a burst
        # would be submitted before the next one is read, and the engine would start a step
        # without the rest of the burst (measured: bursts split in two steps).
        prep = await _off_loop(state, prepare, state, body)
    return await _complete(state, request, kind, prep)


def _answer_error(state: ServerState, scope: Scope, e: P.APIError) -> JSONResponse:
    state.metrics.error(e.type)
    scope.setdefault("state", {})[ERROR] = e.type
    return _error_response(e)


def _check_model(state: ServerState, name: str | None) -> None:
    if state.draining:
        raise P.APIError(503, "the server is shutting down", type="service_unavailable")
    if name is not None and name != state.model_name:
        raise P.APIError(
            404,
            f"model '{name[:200]}' does not exist; this server serves '{state.model_name}'",
            param="model",
            code="model_not_found",
        )


async def _complete(state: ServerState, request: Request, kind: str, prep: _Prepared) -> Response:
    info = request.scope.setdefault("state", {})
    gen = _Generation(state, kind, prep.req, prep.prompts, prep.prompt_text, prep.snapshot_at, info)
    gen.submit()
    if prep.req.stream:
        return _GenerationStream(gen, request)
    # The client may leave while its request waits or runs: free the slots at once.
    watcher = asyncio.ensure_future(_on_disconnect(request, gen))
    try:
        while not gen.done:
            index, event = await gen.queue.get()
            if event is _GONE:
                gen.abort()
                gen.record(499, "client_disconnected")
                return Response(status_code=499)
            gen.take(index, event)
    except BaseException:
        gen.abort()
        gen.record(499, "cancelled")
        raise
    finally:
        watcher.cancel()
    if gen.error is not None:
        gen.abort()
        gen.record(500, "server_error")
        raise P.APIError(500, gen.error)
    gen.record(200)
    return JSONResponse(gen.full_response())


_GONE = object()  # queued by the disconnect watcher


async def _on_disconnect(request: Request, gen: _Generation) -> None:
    await disconnected(request)
    gen.queue.put_nowait((-1, _GONE))


#: The head of a stream: what Starlette's StreamingResponse sent for it.
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


class _GenerationStream:
    """SSE for one generation, written straight to the ASGI ``send``.

    Not Starlette's StreamingResponse: it watches for a disconnect through an anyio task group
    per response and sends every chunk alone, and a burst of new requests spent most of the
    event loop's time there. Here one asyncio task watches for the client leaving (it queues
    ``_GONE``), and the events already queued when the stream wakes go out in one write.
    Whatever ends the response (done, client gone, cancelled), its engine requests are aborted
    and it is recorded once."""

    def __init__(self, gen: _Generation, request: Request) -> None:
        self.gen, self.request = gen, request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gen = self.gen
        watcher = asyncio.ensure_future(_on_disconnect(self.request, gen))
        status, error = 499, "client_disconnected"  # unless the last chunk goes out
        try:
            await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
            chunks: list[bytes] = []
            while not gen.done:
                index, event = await gen.queue.get()
                while event is not _GONE:
                    chunks.extend(P.sse(chunk) for chunk in gen.take(index, event))
                    if gen.done or gen.queue.empty():
                        break
                    index, event = gen.queue.get_nowait()
                if event is _GONE:
                    return
                if chunks and not gen.done:  # the last ones go with the tail
                    body = b"".join(chunks)
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                    chunks = []
            tail, final = chunks, (200, None)
            if gen.error is not None:
                tail.append(P.sse(P.APIError(500, gen.error).body()))
                final = (500, "server_error")
            elif gen.req.include_usage:
                object_type = "chat.completion.chunk" if gen.kind == "chat" else "text_completion"
                usage = P.usage_chunk(
                    request_id=gen.id,
                    model=gen.state.model_name,
                    object_type=object_type,
                    usage=gen.usage(),
                    created=gen.created,
                )
                tail.append(P.sse(usage))
            tail.append(P.SSE_DONE)
            await send({"type": "http.response.body", "body": b"".join(tail)})
            status, error = final
        finally:
            watcher.cancel()
            gen.abort()
            gen.record(status, error)
