"""`POST /v1/completions`: OpenAI's legacy text completions, with vLLM's extras.

Each prompt of the request (a string, a list of strings, a list of token ids, or a list of
lists of them) is its own request through the dispatcher, all dispatched at once; its choice's
`index` is its place in the list. A string is tokenized as vLLM tokenizes a completion's prompt
(no chat template, the tokenizer's special tokens added); ids go as given, inside the
vocabulary. `echo` puts the prompt before the completion in the text and, with `logprobs`, its
tokens before the completion's (the first with no log-probability, as OpenAI's); vLLM's
`prompt_logprobs` come in vLLM's form in `choices[].prompt_logprobs`. A request that needs the
prompt's log-probabilities recomputes the whole prompt (no prefix-cache reuse for it).
`max_tokens` 0, allowed only with `echo`, scores the prompt and generates nothing: the engine
still runs the prompt (a prefill only), the first token is not emitted, and the choice finishes
with "length" and 0 completion tokens. With `n`, each prompt's completions come from one
prefill on one worker, choice `i * n + j` prompt i's j-th. No `suffix`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from mmserve.frontend.chat import stop_rules, token_choice
from mmserve.frontend.errors import ApiError
from mmserve.frontend.streaming import SSE_HEADERS, ChunkReader
from mmserve.observability import nvtx
from mmserve.protocol import (
    ERROR_INVALID_VALUE,
    ERROR_TOKEN_NOT_IN_VOCABULARY,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    FinishReason,
    Grammar,
    OpenAIUsage,
    PreprocessedRequest,
    PromptLogprob,
    TokenChunk,
    TokenLogprob,
    Usage,
)

if TYPE_CHECKING:
    from mmserve.frontend.app import Call, FrontendApp
    from mmserve.frontend.logprobs import TokenTexts

Prompt = str | list[int]


def prompts_of(request: CompletionRequest, vocab_size: int) -> list[Prompt]:
    """The request's prompts, each a string or a list of ids; an empty one, mixed kinds or
    an id outside the vocabulary is refused."""
    prompt = request.prompt
    if isinstance(prompt, str):
        prompts: list[Prompt] = [prompt]
    elif all(isinstance(each, int) for each in prompt):
        prompts = [[each for each in prompt if isinstance(each, int)]]
    elif all(isinstance(each, str) for each in prompt):
        prompts = [each for each in prompt if isinstance(each, str)]
    elif all(isinstance(each, list) for each in prompt):
        prompts = [each for each in prompt if isinstance(each, list)]
    else:
        raise ApiError(
            ERROR_INVALID_VALUE,
            "prompt must be a string, a list of strings, a list of token ids or a list of "
            "lists of token ids, not a mix of them",
            param="prompt",
        )
    if not prompts:
        raise ApiError(ERROR_INVALID_VALUE, "prompt must not be an empty list", param="prompt")
    for index, each in enumerate(prompts):
        if len(each) == 0:
            raise ApiError(ERROR_INVALID_VALUE, f"prompt {index} is empty", param="prompt")
        if isinstance(each, list) and not all(0 <= token < vocab_size for token in each):
            raise ApiError(
                ERROR_TOKEN_NOT_IN_VOCABULARY,
                f"prompt {index} holds a token id outside the vocabulary [0, {vocab_size})",
                param="prompt",
            )
    return prompts


def validate(app: FrontendApp, request: CompletionRequest) -> list[Prompt]:
    """Cheap checks before anything is tokenized or scheduled; the prompts."""
    preprocessor = app.preprocessor
    preprocessor.check_common(request.model, request.min_tokens, request.max_tokens)
    preprocessor.check_n(request.n, request.best_of)
    preprocessor.check_supported(request.unsupported_options())
    if request.max_tokens == 0 and not request.echo:
        raise ApiError(
            ERROR_INVALID_VALUE,
            "max_tokens 0 needs echo (it scores the prompt and generates nothing)",
            param="max_tokens",
        )
    preprocessor.check_logit_bias(request.logit_bias)
    return prompts_of(request, preprocessor.model.spec.vocab_size)


def _prompt_top(request: CompletionRequest) -> int | None:
    """How many most likely tokens the engines return at each prompt position; None: the
    prompt's log-probabilities are not needed."""
    wanted = [request.prompt_logprobs]
    if request.echo:
        wanted.append(request.logprobs)
    asked = [each for each in wanted if each is not None]
    return max(asked) if asked else None


async def _preprocess(
    app: FrontendApp,
    request: CompletionRequest,
    prompt: Prompt,
    request_id: str,
    call: Call,
    grammar: Grammar | None,
) -> PreprocessedRequest:
    preprocessor = app.preprocessor
    if isinstance(prompt, str):
        plan = await preprocessor.plan_prompt(None, prompt)
    else:
        plan = await preprocessor.plan_prompt(prompt)
    max_tokens = preprocessor.completion_budget(
        request.max_tokens, request.min_tokens, len(plan.token_ids), "prompt"
    )
    return PreprocessedRequest(
        request_id=request_id,
        deadline=call.deadline,
        model=preprocessor.model.name,
        plan=plan,
        sampling=token_choice(request, request.logprobs, _prompt_top(request), grammar),
        stop=stop_rules(request, max_tokens),
    )


async def complete(app: FrontendApp, request: CompletionRequest, call: Call) -> None:
    prompts = validate(app, request)
    grammar = await app.preprocessor.grammar_of(request)
    app.check_ready()
    ids = (
        [call.request_id]
        if len(prompts) == 1
        else [f"{call.request_id}-{index}" for index in range(len(prompts))]
    )
    with nvtx.nvtx_range(nvtx.FE_PREPROCESS):
        preprocessed = await asyncio.gather(
            *(
                _preprocess(app, request, prompt, request_id, call, grammar)
                for prompt, request_id in zip(prompts, ids, strict=True)
            )
        )
    app.observe_preprocessed(call.arrival)
    completion = _Completion(app, request, call, prompts, list(preprocessed))
    if request.stream:
        await completion.stream(call)
    else:
        await call.exchange.json(200, await completion.collect())


@dataclass
class _Prompt:
    """One prompt's request: its chunks, the text echoed before each of its choices ("" without
    echo), and its log-probabilities once the stream's first chunk brought them."""

    reader: ChunkReader
    echo: str
    scored: list[TokenLogprob] = field(default_factory=list)


@dataclass
class _Choice:
    """One choice of a prompt as it grows."""

    index: int
    prompt: _Prompt
    texts: list[str] = field(default_factory=list)
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    finish: FinishReason | None = None
    offset: int = 0  # the text's length so far, for text_offset


class _Completion:
    """Turns the prompts' chunk streams into `text_completion` objects."""

    def __init__(
        self,
        app: FrontendApp,
        request: CompletionRequest,
        call: Call,
        prompts: list[Prompt],
        preprocessed: list[PreprocessedRequest],
    ) -> None:
        self._app = app
        self._request = request
        self._id = call.request_id
        self._created = int(time.time())
        self._model = app.preprocessor.model.name
        tokenizer = app.preprocessor.model.tokenizer
        self._prompts = []
        for prompt, each in zip(prompts, preprocessed, strict=True):
            echo = ""
            if request.echo:
                echo = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
            self._prompts.append(_Prompt(ChunkReader(app.dispatcher, each, call.arrival), echo))
        self._choices = [
            _Choice(index * request.n + choice, prompt)
            for index, prompt in enumerate(self._prompts)
            for choice in range(request.n)
        ]
        needs_texts = request.logprobs is not None or request.prompt_logprobs is not None
        self._texts: TokenTexts | None = app.token_texts if needs_texts else None

    async def _chunks(self) -> AsyncGenerator[tuple[_Choice, TokenChunk]]:
        """Every prompt's chunks as they come, each with its choice; the first failure
        stops the others and raises."""
        queue: asyncio.Queue[tuple[int, TokenChunk | BaseException | None]] = asyncio.Queue()

        async def read(index: int, prompt: _Prompt) -> None:
            try:
                async for chunk in prompt.reader.chunks():
                    await queue.put((index, chunk))
                await queue.put((index, None))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # handed to the reader of the queue
                await queue.put((index, exc))

        tasks = [
            asyncio.ensure_future(read(index, prompt)) for index, prompt in enumerate(self._prompts)
        ]
        try:
            running = len(tasks)
            while running:
                index, item = await queue.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield self._choices[index * self._request.n + item.index], item
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def _delta(self, choice: _Choice, chunk: TokenChunk) -> CompletionChoice:
        """The choice's part in one chunk (the echoed prompt, and its log-probabilities, with
        the first), its state updated."""
        prompt = choice.prompt
        if chunk.prompt_logprobs:  # the stream's first chunk: before any other choice's
            prompt.scored = chunk.prompt_logprobs
        first = not choice.texts
        text = (prompt.echo if first else "") + chunk.text
        choice.texts.append(text)
        logprobs = None
        if self._request.logprobs is not None and self._texts is not None:
            entries = []
            if first and self._request.echo:
                entries = self._echo_entries(prompt.reader.preprocessed, prompt.scored)
            entries += [(each, each.top) for each in chunk.logprobs]
            logprobs = self._legacy(choice, entries)
        if first and self._request.prompt_logprobs is not None:
            choice.prompt_logprobs = self._vllm_prompt_logprobs(prompt.scored)
        choice.finish = chunk.finish_reason
        return CompletionChoice(
            index=choice.index,
            text=text,
            logprobs=logprobs,
            finish_reason=chunk.finish_reason,
            prompt_logprobs=choice.prompt_logprobs if first else None,
        )

    def _echo_entries(
        self, preprocessed: PreprocessedRequest, prompt: list[TokenLogprob]
    ) -> list[tuple[TokenLogprob | int, list[tuple[int, float]] | None]]:
        """The echoed prompt's tokens: the first without a log-probability, then each with
        its `logprobs` most likely."""
        top = self._request.logprobs or 0
        first: list[tuple[TokenLogprob | int, list[tuple[int, float]] | None]] = [
            (preprocessed.plan.token_ids[0], None)
        ]
        return first + [(each, each.top[:top]) for each in prompt]

    def _legacy(
        self,
        choice: _Choice,
        entries: list[tuple[TokenLogprob | int, list[tuple[int, float]] | None]],
    ) -> CompletionLogprobs:
        """OpenAI's legacy log-probabilities of `entries` (a token's, or a bare id for the
        echoed first), offsets continuing the choice's text."""
        assert self._texts is not None
        of = self._texts.of
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offsets: list[int] = []
        for entry, top in entries:
            token_id = entry if isinstance(entry, int) else entry.token_id
            text = of(token_id)[0]
            tokens.append(text)
            offsets.append(choice.offset)
            choice.offset += len(text)
            if isinstance(entry, int) or top is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(entry.logprob)
            best = {of(other)[0]: value for other, value in top}
            best.setdefault(text, entry.logprob)
            tops.append(best)
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets
        )

    def _vllm_prompt_logprobs(
        self, prompt: list[TokenLogprob]
    ) -> list[dict[str, PromptLogprob] | None]:
        """vLLM's `prompt_logprobs`: None, then per position its token's entry and the
        `prompt_logprobs` most likely ones' (rank from 1)."""
        assert self._texts is not None
        of = self._texts.of
        top = self._request.prompt_logprobs or 0
        result: list[dict[str, PromptLogprob] | None] = [None]
        for each in prompt:
            entries = {
                str(token): PromptLogprob(logprob=value, rank=rank, decoded_token=of(token)[0])
                for rank, (token, value) in enumerate(each.top[:top], start=1)
            }
            entries.setdefault(
                str(each.token_id),
                PromptLogprob(
                    logprob=each.logprob, rank=each.rank, decoded_token=of(each.token_id)[0]
                ),
            )
            result.append(entries)
        return result

    def _usage(self) -> OpenAIUsage:
        """Each prompt counted once, the completions' tokens summed."""
        usages = [prompt.reader.usage() for prompt in self._prompts]
        return OpenAIUsage.from_usage(
            Usage(
                prompt_tokens=sum(each.prompt_tokens for each in usages),
                completion_tokens=sum(each.completion_tokens for each in usages),
                cached_tokens=sum(each.cached_tokens for each in usages),
            )
        )

    def _response(
        self, choices: list[CompletionChoice], usage: OpenAIUsage | None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=self._id, created=self._created, model=self._model, choices=choices, usage=usage
        )

    async def collect(self) -> CompletionResponse:
        merged: dict[int, list[CompletionChoice]] = {choice.index: [] for choice in self._choices}
        chunks = self._chunks()
        async with contextlib.aclosing(chunks):
            async for choice, chunk in chunks:
                merged[choice.index].append(self._delta(choice, chunk))
        return self._response(
            [_joined(parts) for _, parts in sorted(merged.items())], self._usage()
        )

    async def stream(self, call: Call) -> None:
        """One event per chunk of any prompt, the first written once one came (so a failure
        before it still answers with its own status); the usage last where asked."""
        options = self._request.stream_options
        continuous = options is not None and options.continuous_usage_stats
        chunks = self._chunks()
        started = False
        async with contextlib.aclosing(chunks):
            async for choice, chunk in chunks:
                delta = self._delta(choice, chunk)
                if not started:
                    await call.exchange.start(200, SSE_HEADERS)
                    started = True
                usage = self._usage() if continuous else None
                await call.exchange.body(_event(self._response([delta], usage)), True)
        tail = b""
        if options is not None and options.include_usage:
            tail = _event(self._response([], self._usage()))
        await call.exchange.body(tail + b"data: [DONE]\n\n")


def _event(payload: CompletionResponse) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def _joined(parts: list[CompletionChoice]) -> CompletionChoice:
    """A choice's deltas as one choice."""
    first, last = parts[0], parts[-1]
    logprobs = None
    if first.logprobs is not None:
        each = [part.logprobs for part in parts if part.logprobs is not None]
        logprobs = CompletionLogprobs(
            tokens=[token for part in each for token in part.tokens],
            token_logprobs=[value for part in each for value in part.token_logprobs],
            top_logprobs=[top for part in each for top in part.top_logprobs],
            text_offset=[offset for part in each for offset in part.text_offset],
        )
    return CompletionChoice(
        index=first.index,
        text="".join(part.text for part in parts),
        logprobs=logprobs,
        finish_reason=last.finish_reason,
        prompt_logprobs=first.prompt_logprobs,
    )
