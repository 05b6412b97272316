"""Migration: a request whose instance is lost mid-stream goes on on another one.

The frontend holds the client's stream, so it owns the request's recovery (Dynamo's frontend
does the same, `--migration-limit`). A failure that names a lost instance
(`RemoteError.lost_instance`: it crashed, its connection or lease went, it sent nothing for the
idle timeout, or it stopped at its drain deadline; a relay such as the encode worker passes on
its next hop's) sends the request again, its instances chosen among all but the lost ones, with
what the client already has:

- nothing streamed yet (a prefill or an encode worker lost before the first token): the
  request as it was, its media offered again;
- tokens streamed: the same plan with the tokens of the choice appended (`protocol.Resumption`),
  which the new instance reads after the prompt and continues as its own: the draws go on at
  the next token index (the same text for a seeded or greedy request), the penalties and
  `min_tokens` / `max_tokens` count those tokens, the prompt's log-probabilities are not sent
  again, and the text resumes where the client's ends (stop strings across the cut, characters
  split across tokens);
- with `n` > 1, each unfinished choice continues as a request of its own (`<id>.<choice>`),
  their chunks merged into the one stream; the choices that had finished stay as sent.

At most `limit` migrations a request (its choices together), none past its deadline; then the
client gets the failure it would have had without migration. Each migration is counted in
`mmserve_migrations_total{role,reason}` and logged once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from mmserve.observability import metrics
from mmserve.protocol import PreprocessedRequest, Resumption, TokenChunk, Usage
from mmserve.runtime.errors import RemoteError

log = logging.getLogger("mmserve.frontend")

DEFAULT_MIGRATION_LIMIT = 3  # Dynamo's recommended start: survives a transient loss or two

Attempt = Callable[[PreprocessedRequest, Sequence[str]], AsyncGenerator[TokenChunk, None]]
"""Send a request through the pipeline, its instances chosen among all but those listed (the
lost ones)."""

Refresh = Callable[[PreprocessedRequest, str], Awaitable[PreprocessedRequest]]
"""The request with the media of client request `id` offered again (the first instance read
what was offered)."""


@dataclass
class _Budget:
    """What one client request's streams share: its id, the migrations left and the instances
    lost."""

    request_id: str
    left: int
    lost: list[str] = field(default_factory=list)


@dataclass
class _Choice:
    tokens: list[int] = field(default_factory=list)
    finished: bool = False


class Migrator:
    """Streams requests through `attempt`, migrating them as the module says."""

    def __init__(
        self,
        attempt: Attempt,
        refresh: Refresh,
        role_of: Callable[[str], str],
        limit: int = DEFAULT_MIGRATION_LIMIT,
    ) -> None:
        self._attempt = attempt
        self._refresh = refresh
        self._role_of = role_of
        self.limit = limit

    def generate(self, request: PreprocessedRequest) -> AsyncGenerator[TokenChunk, None]:
        if self.limit == 0:
            return self._attempt(request, ())
        return self._migrating(request, _Budget(request.request_id, self.limit))

    async def _migrating(
        self, request: PreprocessedRequest, budget: _Budget
    ) -> AsyncGenerator[TokenChunk, None]:
        choices = _choices(request)
        current = request
        while True:
            try:
                async with contextlib.aclosing(self._attempt(current, budget.lost)) as chunks:
                    async for chunk in chunks:
                        choice = choices[chunk.index]
                        choice.tokens += chunk.token_ids
                        choice.finished = chunk.finish_reason is not None
                        yield chunk
                return
            except RemoteError as failure:
                if all(choice.finished for choice in choices.values()):
                    return  # lost after its last chunk: the client has it all
                self._count(request, failure, budget, choices)
            streamed = {index: c.tokens for index, c in choices.items() if c.tokens}
            if not streamed:
                current = await self._refresh(request, budget.request_id)
                continue
            if len(choices) == 1:
                [(index, tokens)] = streamed.items()
                current = _resumed(await self._refresh(request, budget.request_id), index, tokens)
                continue
            async with contextlib.aclosing(self._fanned_out(request, choices, budget)) as rest:
                async for chunk in rest:
                    yield chunk
            return

    def _count(
        self,
        request: PreprocessedRequest,
        failure: RemoteError,
        budget: _Budget,
        choices: dict[int, _Choice],
    ) -> None:
        """Take one migration from `budget` for `failure`, or raise it when the request may
        not migrate: nothing was lost, no migration is left, or the deadline passed."""
        lost = failure.lost_instance
        if not lost or budget.left <= 0 or time.time() >= request.deadline:
            raise failure
        budget.left -= 1
        budget.lost.append(lost)
        role = self._role_of(lost)
        metrics.MIGRATIONS.labels(role, failure.code).inc()
        log.warning(
            "request %s: %s %s lost after %d tokens (%s); migrating, %d of %d",
            request.request_id,
            role,
            lost,
            sum(len(choice.tokens) for choice in choices.values()),
            failure,
            self.limit - budget.left,
            self.limit,
        )

    async def _fanned_out(
        self, request: PreprocessedRequest, choices: dict[int, _Choice], budget: _Budget
    ) -> AsyncGenerator[TokenChunk, None]:
        """Each unfinished choice of `request` continued as a request of its own, their chunks
        as they come; the chunk that finishes the last choice carries the usage of all (the
        prompt once, every choice's tokens)."""
        unfinished = [index for index, choice in choices.items() if not choice.finished]
        refreshed = [await self._refresh(request, budget.request_id) for _ in unfinished]
        parts = [
            self._migrating(_resumed(again, index, choices[index].tokens), budget)
            for again, index in zip(refreshed, unfinished, strict=True)
        ]
        usage: Usage | None = None
        async with contextlib.aclosing(_merged(parts)) as chunks:
            async for chunk in chunks:
                choice = choices[chunk.index]
                choice.tokens += chunk.token_ids
                choice.finished = chunk.finish_reason is not None
                usage = chunk.usage or usage
                last = all(each.finished for each in choices.values())
                yield msgspec.structs.replace(
                    chunk,
                    request_id=request.request_id,
                    usage=_all_choices(usage, choices) if last and usage else None,
                )


def _choices(request: PreprocessedRequest) -> dict[int, _Choice]:
    """The request's choices by index, a resumed one with the tokens it had."""
    resume = request.resume
    if resume is None:
        return {index: _Choice() for index in range(request.sampling.n)}
    return {resume.choice: _Choice(tokens=list(resume.token_ids))}


def _resumed(request: PreprocessedRequest, choice: int, tokens: list[int]) -> PreprocessedRequest:
    """`request`'s choice `choice` as a request of its own that continues after `tokens`: one
    choice, its prompt's log-probabilities already sent. A choice of a request with `n` > 1
    gets an id of its own, as the routers book each request they route."""
    own_id = request.request_id if request.sampling.n == 1 else f"{request.request_id}.{choice}"
    return msgspec.structs.replace(
        request,
        request_id=own_id,
        sampling=msgspec.structs.replace(request.sampling, n=1, prompt_logprobs=None),
        resume=Resumption(choice=choice, token_ids=list(tokens)),
    )


def _all_choices(last: Usage, choices: dict[int, _Choice]) -> Usage:
    """The usage of every choice: the prompt and its cached tokens as the last request counted
    them, every choice's tokens."""
    completion = sum(len(choice.tokens) for choice in choices.values())
    return msgspec.structs.replace(last, completion_tokens=completion)


async def _merged(
    streams: list[AsyncGenerator[TokenChunk, None]],
) -> AsyncGenerator[TokenChunk, None]:
    """The chunks of `streams` as each comes; the first failure ends them all. Leaving early
    (the client gone) closes every stream: nothing keeps running."""
    queue: asyncio.Queue[TokenChunk | Exception | None] = asyncio.Queue()

    async def pump(stream: AsyncGenerator[TokenChunk, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    queue.put_nowait(chunk)
            queue.put_nowait(None)
        except Exception as exc:
            queue.put_nowait(exc)

    tasks = [
        asyncio.create_task(pump(stream), name="mmserve-migrated-choice") for stream in streams
    ]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
