"""The OpenAI-compatible HTTP API as a plain ASGI application.

Routes: `POST /v1/chat/completions`, `POST /v1/completions` (`frontend.completions`),
`GET /v1/models`, `GET /health`, `GET /metrics`,
`GET /openapi.json`, `POST /reset_prefix_cache` (every worker clears its prefix and encoder
caches; vLLM's route and answer, under the API key when one is set). Streaming responses send
their headers only once the first token chunk arrives, so a failure before the first token (no
worker, a refused image, the deadline) still answers with its own HTTP status; a failure after
it ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from mmserve.frontend import completions
from mmserve.frontend.answers import ChoiceReader, CollectedChoice, choice_finish, delta_events
from mmserve.frontend.chat import ChatPreprocessor, new_call_id, new_request_id
from mmserve.frontend.dispatch import Dispatcher
from mmserve.frontend.drain import Drain
from mmserve.frontend.errors import ApiError
from mmserve.frontend.logprobs import TokenTexts
from mmserve.frontend.media_ids import tenant_of
from mmserve.frontend.openapi import openapi_document
from mmserve.frontend.streaming import COMPONENT, SSE_HEADERS, ChunkReader
from mmserve.observability import metrics, nvtx
from mmserve.protocol import (
    ERROR_BODY_TOO_LARGE,
    ERROR_DEADLINE_EXCEEDED,
    ERROR_INTERNAL,
    ERROR_INVALID_API_KEY,
    ERROR_INVALID_JSON,
    ERROR_INVALID_VALUE,
    ERROR_METHOD_NOT_ALLOWED,
    ERROR_NO_WORKER,
    ERROR_NOT_FOUND,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionChunkChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceDelta,
    ChoiceFinishReason,
    ChoiceLogprobs,
    CompletionRequest,
    FinishReason,
    ModelCard,
    ModelList,
    OpenAIUsage,
    PreprocessedRequest,
    TokenChunk,
    TokenLogprob,
)
from mmserve.runtime.errors import RemoteError
from mmserve.runtime.lifetime import DEFAULT_DRAIN_TIMEOUT_S

log = logging.getLogger("mmserve.frontend")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON = [(b"content-type", b"application/json")]
_encoder = msgspec.json.Encoder()
# The frontend's series, looked up once: `labels()` validates and hashes its values each call.
_REQUESTS = metrics.REQUESTS.labels(COMPONENT)
_ACTIVE = metrics.ACTIVE.labels(COMPONENT)
_PREPROCESS_SECONDS = metrics.STAGE_SECONDS.labels(COMPONENT, "preprocess")


@dataclass(frozen=True)
class HttpOptions:
    api_key: str | None = None
    max_body_bytes: int = 64 * 1024 * 1024
    log_requests: bool = False  # a line for every request, not only for failed ones


@dataclass(frozen=True)
class Call:
    """One completion request as its route's handler takes it beside its body: the request's
    id, its arrival (perf_counter) and deadline (unix time), the exchange and the tenant."""

    request_id: str
    arrival: float
    deadline: float
    exchange: _Exchange
    tenant: str


class _ClientGone(Exception):
    """The client disconnected before the request was complete."""


class _Exchange:
    """One HTTP request/response pair: remembers whether the response has started."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self.started = False
        self.status = 0
        self.extra_headers: list[tuple[bytes, bytes]] = []

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.status = status
        await self._send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": headers + self.extra_headers,
            }
        )

    async def body(self, data: bytes, more: bool = False) -> None:
        await self._send({"type": "http.response.body", "body": data, "more_body": more})

    async def json(self, status: int, payload: Any) -> None:
        await self.start(status, _JSON)
        await self.body(_encoder.encode(payload))

    async def error(self, err: ApiError) -> None:
        if self.started:
            # Mid-stream: the status is already sent, so the error travels as an SSE event.
            await self.body(b"data: " + _encoder.encode(err.body()) + b"\n\ndata: [DONE]\n\n")
        else:
            await self.json(err.status, err.body())


class FrontendApp:
    def __init__(
        self,
        preprocessor: ChatPreprocessor,
        dispatcher: Dispatcher,
        http: HttpOptions | None = None,
        drain: Drain | None = None,
    ) -> None:
        self.preprocessor = preprocessor
        self.dispatcher = dispatcher
        self.http = http or HttpOptions()
        self.drain = drain or Drain(DEFAULT_DRAIN_TIMEOUT_S)
        pixels = preprocessor.pixel_range.min_pixels, preprocessor.pixel_range.max_pixels
        self._openapi = _encoder.encode(
            openapi_document(
                preprocessor.model.name,
                pixels,
                preprocessor.video_range,
                preprocessor.pan_and_scan,
                preprocessor.options.max_n,
                audio_in_video=preprocessor.audio_in_video,
            )
        )

    @functools.cached_property
    def token_texts(self) -> TokenTexts:
        """Token ids' texts and bytes for logprobs, made the first time a request asks."""
        return TokenTexts(self.preprocessor.model.tokenizer)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        exchange = _Exchange(send)
        route = (scope["method"], scope["path"])
        if route == ("GET", "/health"):
            await self._health(exchange)
        elif route == ("GET", "/metrics"):
            await exchange.start(200, [(b"content-type", metrics.CONTENT_TYPE.encode())])
            await exchange.body(metrics.render())
        else:
            with self.drain.serving():
                await self._route(route, scope, receive, exchange)

    async def _route(
        self, route: tuple[str, str], scope: Scope, receive: Receive, exchange: _Exchange
    ) -> None:
        if route == ("POST", "/v1/chat/completions"):
            await self._chat_completions(scope, receive, exchange)
        elif route == ("POST", "/v1/completions"):
            await self._completions(scope, receive, exchange)
        elif route == ("GET", "/v1/models"):
            await self._guarded(scope, exchange, self._models)
        elif route == ("POST", "/reset_prefix_cache"):
            await self._guarded(scope, exchange, self._reset_prefix_cache)
        elif route == ("GET", "/openapi.json"):
            await exchange.start(200, _JSON)
            await exchange.body(self._openapi)
        elif scope["path"] in _ROUTES:
            exchange.extra_headers.append((b"allow", _ROUTES[scope["path"]]))  # RFC 9110
            await exchange.error(
                ApiError(ERROR_METHOD_NOT_ALLOWED, f"{scope['method']} is not allowed here")
            )
        else:
            await exchange.error(ApiError(ERROR_NOT_FOUND, f"no route {scope['path']}"))

    async def _guarded(
        self, scope: Scope, exchange: _Exchange, handler: Callable[[_Exchange], Awaitable[None]]
    ) -> None:
        try:
            self._authorize(scope)
        except ApiError as err:
            await exchange.error(err)
            return
        await handler(exchange)

    async def _models(self, exchange: _Exchange) -> None:
        model = self.preprocessor.model
        await exchange.json(200, ModelList(data=[ModelCard(id=model.name, created=model.created)]))

    async def _health(self, exchange: _Exchange) -> None:
        if self.drain.draining:
            await exchange.json(503, {"status": "draining", "reason": "the frontend is stopping"})
        elif self.dispatcher.ready():
            await exchange.json(200, {"status": "ok"})
        else:
            await exchange.json(
                503, {"status": "unavailable", "reason": "no worker is reachable for the model"}
            )

    async def _reset_prefix_cache(self, exchange: _Exchange) -> None:
        """Every instance clears its caches; 200 with an empty body once all did (as vLLM
        answers), else the dispatcher's error naming those that did not."""
        started = time.perf_counter()
        try:
            cleared = await self.dispatcher.reset_prefix_cache()
        except RemoteError as err:
            metrics.ERRORS.labels(COMPONENT, err.code).inc()
            log.warning("reset_prefix_cache failed: %s", err)
            await exchange.error(ApiError(err.code, err.message, status=err.status))
            return
        except (KeyboardInterrupt, SystemExit, asyncio.CancelledError):
            raise
        except BaseException:
            metrics.ERRORS.labels(COMPONENT, "internal").inc()
            log.exception("reset_prefix_cache failed")
            await exchange.error(ApiError(ERROR_INTERNAL, "internal error; see the server log"))
            return
        log.info(
            "prefix and encoder caches cleared on %d instances in %.1f ms",
            cleared,
            (time.perf_counter() - started) * 1e3,
        )
        await exchange.start(200, [(b"content-length", b"0")])
        await exchange.body(b"")

    def _authorize(self, scope: Scope) -> None:
        expected = self.http.api_key
        if expected is None:
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token, expected.encode()):
            raise ApiError(ERROR_INVALID_API_KEY, "a valid API key is required (Bearer token)")

    async def _chat_completions(self, scope: Scope, receive: Receive, exchange: _Exchange) -> None:
        chat = ChatCompletionRequest
        await self._serve(scope, receive, exchange, "chatcmpl", chat, self._complete)

    async def _completions(self, scope: Scope, receive: Receive, exchange: _Exchange) -> None:
        complete = functools.partial(completions.complete, self)
        await self._serve(scope, receive, exchange, "cmpl", CompletionRequest, complete)

    async def _serve(
        self,
        scope: Scope,
        receive: Receive,
        exchange: _Exchange,
        kind: str,
        request_type: type[RequestT],
        complete: Callable[[RequestT, Call], Awaitable[None]],
    ) -> None:
        """One completion request of either route (`kind`, its ids' prefix; the body a
        `request_type`), under the API key, the deadline, the client's disconnect, the metrics
        and the request log."""
        request_id = new_request_id(kind)
        arrival = time.perf_counter()
        exchange.extra_headers.append((b"x-request-id", request_id.encode()))
        _REQUESTS.inc()
        _ACTIVE.inc()
        outcome = "ok"
        try:
            self._authorize(scope)
            tenant = tenant_of(dict(scope["headers"]).get(b"authorization", b""))
            body = await _read_body(scope, receive, self.http.max_body_bytes)
            timeout = self.preprocessor.options.request_timeout_s
            request = decode_request(body, request_type)
            call = Call(request_id, arrival, time.time() + timeout, exchange, tenant)
            work = asyncio.ensure_future(complete(request, call))
            outcome = await _race(work, receive, timeout)
            if outcome == "disconnected":
                raise _ClientGone
            if outcome == "deadline":
                raise ApiError(
                    ERROR_DEADLINE_EXCEEDED, f"the request took longer than {timeout:g} s"
                )
        except _ClientGone:
            outcome = "disconnected"
            metrics.ERRORS.labels(COMPONENT, outcome).inc()
        except ApiError as err:
            outcome = err.code
            metrics.ERRORS.labels(COMPONENT, err.code).inc()
            await exchange.error(err)
        except (KeyboardInterrupt, SystemExit, asyncio.CancelledError):
            raise
        except BaseException:  # also a Rust panic: pyo3's PanicException is no Exception
            outcome = "internal"
            metrics.ERRORS.labels(COMPONENT, outcome).inc()
            log.exception("%s failed", request_id)
            await exchange.error(ApiError(ERROR_INTERNAL, "internal error; see the server log"))
        finally:
            _ACTIVE.dec()
            if outcome != "ok" or self.http.log_requests:
                log.info(
                    "%s status=%s outcome=%s %.1f ms",
                    request_id,
                    exchange.status or "-",
                    outcome,
                    (time.perf_counter() - arrival) * 1e3,
                )

    async def _complete(self, request: ChatCompletionRequest, call: Call) -> None:
        self.preprocessor.validate(request)
        grammar = await self.preprocessor.chat_grammar_of(request)
        self.check_ready()
        with nvtx.nvtx_range(nvtx.FE_PREPROCESS):
            preprocessed = await self.preprocessor.preprocess(
                request, call.request_id, call.deadline, call.tenant, grammar
            )
        self.observe_preprocessed(call.arrival)
        generation = _Generation(self, request, preprocessed, call.arrival)
        if request.stream:
            await generation.stream(call.exchange)
        else:
            await call.exchange.json(200, await generation.collect())

    def check_ready(self) -> None:
        if not self.dispatcher.ready():
            raise ApiError(ERROR_NO_WORKER, "no worker is reachable for the model; retry later")

    @staticmethod
    def observe_preprocessed(arrival: float) -> None:
        _PREPROCESS_SECONDS.observe(time.perf_counter() - arrival)


@dataclass
class _Choice:
    """A choice collected for a non-streamed answer."""

    answer: CollectedChoice
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: FinishReason | None = None


class _Generation:
    """Turns the dispatcher's token chunks into OpenAI responses for one request."""

    def __init__(
        self,
        app: FrontendApp,
        request: ChatCompletionRequest,
        preprocessed: PreprocessedRequest,
        arrival: float,
    ) -> None:
        self._app = app
        self._request = request
        self._preprocessed = preprocessed
        self._reader = ChunkReader(app.dispatcher, preprocessed, arrival)
        self._created = int(time.time())
        options = request.stream_options
        self._continuous_usage = options is not None and options.continuous_usage_stats
        # How each choice's text is read (reasoning, tool calls); None: passed on as it is.
        self._rules = app.preprocessor.output_rules(request, preprocessed.plan.token_ids)
        self._readers = (
            [ChoiceReader(self._rules, new_call_id) for _ in range(request.n)]
            if self._rules.reads
            else None
        )

    async def _chunks(self) -> AsyncGenerator[tuple[TokenChunk, bool]]:
        """Each chunk, and whether it is the last: every choice has its finish."""
        chunks = self._reader.chunks()
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk, self._reader.finished

    def usage(self) -> OpenAIUsage:
        """The worker's usage (its last chunk carries it), else counted here."""
        return OpenAIUsage.from_usage(self._reader.usage())

    def _usage_so_far(self) -> OpenAIUsage:
        """`stream_options.continuous_usage_stats`: the tokens so far, the worker's usage once
        its last chunk came (only that knows the cached tokens)."""
        if self._reader.worker_usage is not None:
            return OpenAIUsage.from_usage(self._reader.worker_usage)
        prompt = self._reader.prompt_tokens
        completion = self._reader.completion_tokens
        return OpenAIUsage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    def _logprobs(self, logprobs: list[TokenLogprob]) -> ChoiceLogprobs | None:
        if not self._request.logprobs:
            return None
        return ChoiceLogprobs(content=self._app.token_texts.chat(logprobs))

    async def collect(self) -> ChatCompletionResponse:
        choices = [
            _Choice(CollectedChoice(self._rules, new_call_id)) for _ in range(self._request.n)
        ]
        async for chunk, _ in self._chunks():
            choice = choices[chunk.index]
            choice.answer.add(chunk.text)
            choice.logprobs += chunk.logprobs
            choice.finish = chunk.finish_reason
        answers = []
        for index, choice in enumerate(choices):
            message, finish = choice.answer.message(choice.finish)
            answers.append(
                ChatCompletionChoice(
                    index=index,
                    message=message,
                    finish_reason=finish,
                    logprobs=self._logprobs(choice.logprobs),
                )
            )
        return ChatCompletionResponse(
            id=self._preprocessed.request_id,
            created=self._created,
            model=self._preprocessed.model,
            choices=answers,
            usage=self.usage(),
        )

    async def stream(self, exchange: _Exchange) -> None:
        """One write per chunk from the worker: the events it makes, a choice's role with its
        first, the closing ones with the last (a 1-token completion is one write after the
        head)."""
        chunks = self._chunks()
        started: set[int] = set()
        events: list[bytes] = []
        async with contextlib.aclosing(chunks):
            # Wait for the first chunk before committing to a 200.
            chunk, last = await anext(chunks)
            await exchange.start(200, SSE_HEADERS)
            while True:
                if chunk.index not in started:
                    started.add(chunk.index)
                    events.append(self._event(ChoiceDelta(role="assistant", content=""), chunk))
                events += self._text_events(chunk)
                if last:
                    break
                await exchange.body(b"".join(events), True)
                events = []
                chunk, last = await anext(chunks)
        options = self._request.stream_options
        if options is not None and options.include_usage:
            usage_chunk = self._chunk([], self.usage())
            events.append(b"data: " + _encoder.encode(usage_chunk) + b"\n\n")
        events.append(b"data: [DONE]\n\n")
        await exchange.body(b"".join(events))

    def _text_events(self, chunk: TokenChunk) -> list[bytes]:
        """A chunk's events: its text with its tokens' log-probabilities (asked for, they come
        even while the text waits for the rest of a character), then the finish."""
        chosen = self._logprobs(chunk.logprobs) if chunk.logprobs else None
        if self._readers is not None:
            return self._read_events(chunk, self._readers[chunk.index], chosen)
        events = []
        if chunk.text or chosen is not None:
            events.append(self._event(ChoiceDelta(content=chunk.text), chunk, logprobs=chosen))
        if chunk.finish_reason is not None:
            events.append(self._event(ChoiceDelta(), chunk, chunk.finish_reason))
        return events

    def _read_events(
        self, chunk: TokenChunk, reader: ChoiceReader, chosen: ChoiceLogprobs | None
    ) -> list[bytes]:
        """The events of a chunk whose text is read: its reasoning, then its content and
        calls (the log-probabilities with the first, or alone while the text is held back),
        then the finish."""
        piece = reader.push(chunk.text)
        if chunk.finish_reason is not None:
            piece.extend(reader.finish())
        events = []
        for delta in delta_events(piece):
            events.append(self._event(delta, chunk, logprobs=chosen))
            chosen = None
        if chosen is not None:
            events.append(self._event(ChoiceDelta(content=""), chunk, logprobs=chosen))
        if chunk.finish_reason is not None:
            finish = choice_finish(chunk.finish_reason, reader.called)
            events.append(self._event(ChoiceDelta(), chunk, finish))
        return events

    def _event(
        self,
        content: ChoiceDelta,
        of: TokenChunk,
        finish: ChoiceFinishReason | None = None,
        logprobs: ChoiceLogprobs | None = None,
    ) -> bytes:
        choice = ChatCompletionChunkChoice(
            index=of.index, delta=content, finish_reason=finish, logprobs=logprobs
        )
        usage = self._usage_so_far() if self._continuous_usage else None
        return b"data: " + _encoder.encode(self._chunk([choice], usage)) + b"\n\n"

    def _chunk(
        self, choices: list[ChatCompletionChunkChoice], usage: OpenAIUsage | None = None
    ) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self._preprocessed.request_id,
            created=self._created,
            model=self._preprocessed.model,
            choices=choices,
            usage=usage,
        )


# Each path's one method, for the `Allow` header of a 405.
_ROUTES = {
    "/v1/chat/completions": b"POST",
    "/v1/completions": b"POST",
    "/v1/models": b"GET",
    "/health": b"GET",
    "/metrics": b"GET",
    "/openapi.json": b"GET",
    "/reset_prefix_cache": b"POST",
}


RequestT = TypeVar("RequestT")


_DECODERS: dict[type, msgspec.json.Decoder[Any]] = {}


def decode_request(body: bytes, kind: type[RequestT]) -> RequestT:
    """The body as a `kind` (a request Struct), or the client's error naming the field."""
    decoder = _DECODERS.get(kind)
    if decoder is None:
        decoder = _DECODERS[kind] = msgspec.json.Decoder(kind)
    try:
        try:
            result: RequestT = decoder.decode(body)
            return result
        except msgspec.ValidationError:
            # JSON Schema's integers (as /openapi.json names them) include 1.0 and 1e3;
            # msgspec's typed decoding takes only 1 and 1000.
            plain = _integral_floats_as_ints(msgspec.json.decode(body))
            return msgspec.convert(plain, kind)
    except msgspec.ValidationError as err:
        message = str(err)
        _, _, path = message.partition(" - at `$.")
        raise ApiError(
            ERROR_INVALID_VALUE, f"invalid request: {message}", path.rstrip("`") or None
        ) from err
    except msgspec.DecodeError as err:
        raise ApiError(ERROR_INVALID_JSON, f"the body is not valid JSON: {err}") from err


def _integral_floats_as_ints(value: Any) -> Any:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral_floats_as_ints(item) for item in value]
    if isinstance(value, dict):
        return {key: _integral_floats_as_ints(item) for key, item in value.items()}
    return value


async def _read_body(scope: Scope, receive: Receive, limit: int) -> bytes:
    too_large = ApiError(ERROR_BODY_TOO_LARGE, f"the request body exceeds {limit} bytes")
    declared = dict(scope["headers"]).get(b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    parts = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


async def _race(work: asyncio.Future[None], receive: Receive, timeout: float) -> str:
    """Waits for `work`, cancelling it when the client disconnects or the deadline passes.

    Returns "ok", "disconnected" or "deadline"; an exception from `work` propagates.
    """
    disconnect = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait(
            {work, disconnect}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        disconnect.cancel()
    if work in done:
        work.result()
        return "ok"
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    return "disconnected" if disconnect in done else "deadline"


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
