"""Migration in the frontend's dispatcher, in one process over a real nats-server: role
endpoints on runtimes of their own with mock engines (20 ms a token), one of them crashed
mid-stream by closing its NATS connection (its calls, heartbeats and subscriptions go at once,
its discovery record expires as a killed process's does), or stopped past its drain deadline.
Each stream ends with the fault-free tokens and text; the faults around a migration (the
replacement lost too, the limit, the deadline, the client leaving, media no one holds any more)
end as the module's tests say, never in a hang."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import pytest_asyncio
from prometheus_client import REGISTRY

from mmserve.engines.mock import MockEngine
from mmserve.frontend.nats_dispatch import NatsDispatcher, TransferTensorSink
from mmserve.models.family import resolve_model_spec
from mmserve.protocol import (
    ItemState,
    MediaPayload,
    PreprocessedRequest,
    SamplingParams,
    StopConditions,
    TokenChunk,
)
from mmserve.router.scheduler import RouterMode
from mmserve.router.settings import RouterSettings
from mmserve.runtime import RemoteError
from mmserve.tiny.checkpoints import build_tiny_model
from mmserve.topology import Role
from mmserve.worker.endpoints import Endpoints
from tests.support.images import photo_like, png_bytes
from tests.support.waiting import wait_until_async
from tests.worker.test_handlers import InProcess, Prompts, inline_transfer

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(120)]

MAX_TOKENS = 40
MS_PER_TOKEN = 20.0
IMAGE = png_bytes(photo_like(84, 56, seed=1))


@pytest.fixture(scope="module")
def model_path() -> Path:
    return build_tiny_model("qwen2_vl")


@pytest.fixture(scope="module")
def prompts(model_path: Path) -> Prompts:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    return Prompts(tokenizer=tokenizer, spec=resolve_model_spec(model_path).core)


@dataclass
class Workers:
    """Workers of one namespace in this process, as their processes would be, shared by the
    module's tests; a crashed one is started again on its engine after each test."""

    processes: InProcess
    roles: dict[str, Role]
    engines: dict[str, MockEngine]
    served: dict[str, Endpoints] = field(default_factory=dict)
    crashed: set[str] = field(default_factory=set)

    async def start(self, name: str) -> None:
        role = self.roles[name]
        encodes = role in (Role.ENCODE, Role.WORKER)
        self.served[name] = await self.processes.start(role, self.engines[name], encode=encodes)

    def active(self, name: str) -> int:
        return self.engines[name].admission.depth

    def busiest(self, *names: str) -> str:
        return max(names, key=self.active)

    async def crash(self, name: str) -> None:
        """As a killed process: its connection closes, its discovery record expires."""
        self.crashed.add(name)
        await self.served[name].runtime.nc.close()

    async def revive(self) -> None:
        for name in sorted(self.crashed):  # encode last: "encode" sorts after the others
            await self.start(name)
        self.crashed.clear()

    @contextlib.asynccontextmanager
    async def dispatcher(self, limit: int = 3) -> AsyncIterator[NatsDispatcher]:
        """The frontend's dispatcher with `limit`, once it lists every worker."""
        runtime = await self.processes.runtime()
        dispatcher = await NatsDispatcher.start(
            runtime,
            RouterSettings(mode=RouterMode.ROUND_ROBIN),
            media=TransferTensorSink(inline_transfer(), keep_s=60),
            migration_limit=limit,
        )
        live = {endpoints.runtime.instance_id for endpoints in self.served.values()}

        def listed() -> bool:
            return live <= {i for w in dispatcher._watchers.values() for i in w.instance_ids()}

        try:
            await wait_until_async(listed, what="every worker listed")
            yield dispatcher
        finally:
            await dispatcher.stop()
            with contextlib.suppress(Exception):
                await runtime.shutdown(graceful_timeout=0.5)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines(model_path: Path) -> AsyncIterator[list[MockEngine]]:
    """The module's engines: its deployments take turns, each serving one at a time."""
    # Imported here first: transformers' lazy imports race when threads make them at once.
    from transformers import AutoTokenizer  # noqa: F401

    options = {"decode_ms_per_token": MS_PER_TOKEN, "prefill_us_per_token": 0.0}
    loaded = await asyncio.gather(*(MockEngine.load(model_path, **options) for _ in range(5)))
    yield list(loaded)
    for engine in loaded:
        await engine.close()


@contextlib.asynccontextmanager
async def workers(
    nats_url: str, model_path: Path, roles: dict[str, Role], engines: list[MockEngine]
) -> AsyncIterator[Workers]:
    processes = InProcess(nats_url, model_path)
    started = Workers(processes, roles, dict(zip(roles, engines, strict=False)))
    try:
        for name in sorted(roles):  # encode last: its watchers start with the language hop
            await started.start(name)
        yield started
    finally:
        await processes.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def agg_module(
    nats_url: str, model_path: Path, engines: list[MockEngine]
) -> AsyncIterator[Workers]:
    roles = dict.fromkeys(("agg-a", "agg-b", "agg-c"), Role.WORKER)
    async with workers(nats_url, model_path, roles, engines) as started:
        yield started


@pytest_asyncio.fixture(loop_scope="module")
async def agg(agg_module: Workers) -> AsyncIterator[Workers]:
    yield agg_module
    await agg_module.revive()


E_P_D = {
    "decode-a": Role.DECODE,
    "decode-b": Role.DECODE,
    "prefill-a": Role.PREFILL,
    "prefill-b": Role.PREFILL,
    "zz-encode": Role.ENCODE,
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def e_p_d(
    nats_url: str, model_path: Path, engines: list[MockEngine]
) -> AsyncIterator[Workers]:
    async with workers(nats_url, model_path, E_P_D, engines) as started:
        yield started


async def stream(dispatcher: NatsDispatcher, request: PreprocessedRequest) -> list[TokenChunk]:
    async with contextlib.aclosing(dispatcher.generate(request)) as chunks:
        return [chunk async for chunk in chunks]


async def request(prompts: Prompts, text: str, **sampling: object) -> PreprocessedRequest:
    planned = await prompts.request([IMAGE], text=text)
    return msgspec.structs.replace(
        planned,
        sampling=SamplingParams(**{"temperature": 0.0, **sampling}),  # type: ignore[arg-type]
        stop=StopConditions(max_tokens=MAX_TOKENS),
    )


def tokens(chunks: list[TokenChunk], choice: int = 0) -> list[int]:
    return [t for chunk in chunks if chunk.index == choice for t in chunk.token_ids]


def text(chunks: list[TokenChunk], choice: int = 0) -> str:
    return "".join(chunk.text for chunk in chunks if chunk.index == choice)


def migrations(role: str) -> float:
    labels = {"role": role, "reason": "disconnected"}
    return REGISTRY.get_sample_value("mmserve_migrations_total", labels) or 0.0


async def after_tokens(streams: list[asyncio.Task], counts: list[int], n: int) -> None:
    """Until every stream has at least `n` tokens (`counts` is filled as they come)."""
    await wait_until_async(lambda: min(counts) >= n, 30, f"{n} tokens on every stream", 0.01)
    assert not any(stream.done() for stream in streams)


def counting(
    dispatcher: NatsDispatcher, request: PreprocessedRequest, counts: list[int], i: int
) -> asyncio.Task[list[TokenChunk]]:
    """`request` streamed in a task, `counts[i]` its tokens so far."""

    async def run() -> list[TokenChunk]:
        chunks = []
        async with contextlib.aclosing(dispatcher.generate(request)) as replies:
            async for chunk in replies:
                chunks.append(chunk)
                counts[i] += len(chunk.token_ids)
        return chunks

    return asyncio.ensure_future(run())


async def test_streams_on_a_crashed_worker_go_on_with_their_tokens(
    agg: Workers, prompts: Prompts
) -> None:
    """Greedy and seeded streams, one with three choices: the worker serving most is crashed
    after the tenth token, every stream ends as it would have; under a dispatcher with
    `--migration-limit 0` the streams it served end with the error."""
    requests = [await request(prompts, f"story {i}") for i in range(4)]
    requests.append(await request(prompts, "choices", temperature=0.8, seed=3, n=3))
    async with agg.dispatcher() as dispatcher, agg.dispatcher(limit=0) as without:
        free = await asyncio.gather(*(stream(dispatcher, r) for r in requests))
        before = migrations("worker")
        counts = [0] * (len(requests) + 3)
        streams = [counting(dispatcher, r, counts, i) for i, r in enumerate(requests)]
        plain = [counting(without, requests[i], counts, len(requests) + i) for i in range(3)]
        await after_tokens(streams + plain, counts, 10)
        await agg.crash(agg.busiest("agg-a", "agg-b", "agg-c"))
        done = await asyncio.wait_for(asyncio.gather(*streams), 30)
        cut = await asyncio.wait_for(asyncio.gather(*plain, return_exceptions=True), 30)
    for chunks, reference, sent in zip(done, free, requests, strict=True):
        for choice in range(sent.sampling.n):
            assert tokens(chunks, choice) == tokens(reference, choice)
            assert text(chunks, choice) == text(reference, choice)
        usage, expected = chunks[-1].usage, reference[-1].usage
        assert usage is not None and expected is not None
        # The cached tokens are the last instance's: the prompt may be in its prefix cache.
        assert (usage.prompt_tokens, usage.completion_tokens) == (
            expected.prompt_tokens,
            expected.completion_tokens,
        )
        assert sum(chunk.usage is not None for chunk in chunks) == 1
    assert migrations("worker") - before >= 1
    failed = [o for o in cut if isinstance(o, RemoteError)]
    assert all(o.code == "disconnected" and o.lost_instance for o in failed)
    assert failed or all(isinstance(o, list) for o in cut)


async def test_a_replacement_lost_too_is_replaced_within_the_limit(
    agg: Workers, prompts: Prompts
) -> None:
    """Two of three workers crash at once (a replacement may be chosen while it is dead but
    still listed): every stream lands on the third. One stream losing two workers in turn goes
    on on the third; under a limit of 1 it ends with the error."""
    requests = [await request(prompts, f"saga {i}") for i in range(3)]
    async with agg.dispatcher() as dispatcher:
        free = await asyncio.gather(*(stream(dispatcher, r) for r in requests))
        counts = [0] * 3
        streams = [counting(dispatcher, r, counts, i) for i, r in enumerate(requests)]
        await after_tokens(streams, counts, 5)
        await asyncio.gather(agg.crash("agg-a"), agg.crash("agg-b"))
        done = await asyncio.wait_for(asyncio.gather(*streams), 40)
    assert [tokens(chunks) for chunks in done] == [tokens(chunks) for chunks in free]

    epic = await request(prompts, "epic")
    for limit in (3, 1):
        await agg.revive()
        async with agg.dispatcher(limit=limit) as dispatcher:
            reference = await stream(dispatcher, epic)
            twice = await losing_two_workers(agg, dispatcher, epic)
            if limit == 1:
                with pytest.raises(RemoteError) as raised:
                    await asyncio.wait_for(twice, 30)
                assert raised.value.code == "disconnected"
            else:
                chunks = await asyncio.wait_for(twice, 30)
                assert tokens(chunks) == tokens(reference) and text(chunks) == text(reference)


async def losing_two_workers(
    workers: Workers, dispatcher: NatsDispatcher, sent: PreprocessedRequest
) -> asyncio.Task[list[TokenChunk]]:
    """`sent` streamed, its worker crashed at its 5th token and the next at its 15th (once it
    migrated there)."""
    progress = [0]
    task = counting(dispatcher, sent, progress, 0)
    for lost in (5, 15):

        def reached(n: int = lost) -> bool:
            return progress[0] >= n

        await wait_until_async(reached, 30, f"{lost} tokens", 0.01)
        await workers.crash(workers.busiest(*workers.roles))
    return task


async def test_the_client_leaving_during_a_migration_leaves_nothing_running(
    agg: Workers, prompts: Prompts
) -> None:
    sent = await request(prompts, "long", n=2, temperature=1.0)
    sent = msgspec.structs.replace(sent, stop=StopConditions(max_tokens=2000))
    async with agg.dispatcher() as dispatcher:
        counts = [0]
        long = counting(dispatcher, sent, counts, 0)
        await after_tokens([long], counts, 5)
        victim = agg.busiest("agg-a", "agg-b", "agg-c")
        others = [name for name in ("agg-a", "agg-b", "agg-c") if name != victim]
        await agg.crash(victim)
        # Its choices go on on the others, each a request of its own; the client leaves.
        await wait_until_async(
            lambda: sum(map(agg.active, others)) == 2, 30, "both choices migrated", 0.02
        )
        long.cancel()
        await wait_until_async(
            lambda: sum(map(agg.active, others)) == 0, 10, "nothing left running", 0.02
        )


async def test_a_request_past_its_deadline_does_not_migrate(agg: Workers, prompts: Prompts) -> None:
    # Its deadline passes while the loss is found out (about 3 s).
    sent = msgspec.structs.replace(await request(prompts, "brief"), deadline=time.time() + 2.0)
    async with agg.dispatcher() as dispatcher:
        before = migrations("worker")
        counts = [0]
        brief = counting(dispatcher, sent, counts, 0)
        await after_tokens([brief], counts, 5)
        await agg.crash(agg.busiest("agg-a", "agg-b", "agg-c"))
        with pytest.raises(RemoteError) as raised:
            await asyncio.wait_for(brief, 30)
    assert raised.value.code == "deadline_exceeded"
    assert migrations("worker") == before


async def test_media_no_encoder_holds_any_more_is_a_clear_error(
    agg: Workers, prompts: Prompts
) -> None:
    """An image named by its id alone that only the crashed worker's encoder cache held: the
    migrated request cannot have it, and says so."""
    sent = await request(prompts, "again", temperature=0.0)
    async with agg.dispatcher() as dispatcher:
        for engine in agg.engines.values():
            await engine.clear_caches()
        await stream(dispatcher, sent)
        holder = next(name for name, e in agg.engines.items() if len(e.encoder_cache))
        by_id = msgspec.structs.replace(sent, payloads=[MediaPayload(state=ItemState.REUSE)])
        counts = [0]
        held = await until_served_by(agg, dispatcher, by_id, holder, counts)
        await agg.crash(holder)
        with pytest.raises(RemoteError) as raised:
            await asyncio.wait_for(held, 30)
    assert raised.value.code == "media_id.gone"


async def until_served_by(
    workers: Workers,
    dispatcher: NatsDispatcher,
    sent: PreprocessedRequest,
    name: str,
    counts: list[int],
) -> asyncio.Task[list[TokenChunk]]:
    """A stream of `sent` (a new id each try) past its fifth token on `name`: round robin
    sends every third try there, and a try elsewhere fails at once (no cache holds the
    image)."""
    for attempt in range(9):
        counts[0] = 0
        again = msgspec.structs.replace(sent, request_id=f"{sent.request_id}-{attempt}")
        task = counting(dispatcher, again, counts, 0)

        def settled(task: asyncio.Task[list[TokenChunk]] = task) -> bool:
            return task.done() or counts[0] >= 5

        await wait_until_async(settled, 30, "tokens or a failure", 0.01)
        if not task.done() and workers.active(name):
            return task
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, RemoteError):
            await task
    raise AssertionError(f"round robin never sent the request to {name}")


async def test_a_stream_cut_at_the_drain_deadline_migrates(agg: Workers, prompts: Prompts) -> None:
    requests = [await request(prompts, f"fable {i}") for i in range(4)]
    labels = {"role": "worker", "reason": "unavailable"}
    before = REGISTRY.get_sample_value("mmserve_migrations_total", labels) or 0.0
    async with agg.dispatcher() as dispatcher:
        free = await asyncio.gather(*(stream(dispatcher, r) for r in requests))
        counts = [0] * 4
        streams = [counting(dispatcher, r, counts, i) for i, r in enumerate(requests)]
        await after_tokens(streams, counts, 5)
        victim = agg.busiest("agg-a", "agg-b", "agg-c")
        agg.crashed.add(victim)  # started again after the test
        await agg.served[victim].runtime.shutdown(graceful_timeout=0.1)
        done = await asyncio.wait_for(asyncio.gather(*streams), 30)
    assert [tokens(chunks) for chunks in done] == [tokens(chunks) for chunks in free]
    assert (REGISTRY.get_sample_value("mmserve_migrations_total", labels) or 0.0) > before


@pytest.mark.parametrize("victim", ["decode", "prefill"])
async def test_e_p_d_a_lost_decode_or_prefill_worker_is_replaced(
    e_p_d: Workers, prompts: Prompts, victim: str
) -> None:
    """Decode lost mid-stream behind the encode worker, which relays the loss: the request
    resumes on the other decode worker through a new prefill. A prefill worker lost before
    its handover (0.1 s a prompt token): the request goes to the other one."""
    names = [f"{victim}-a", f"{victim}-b"]
    sent = await request(prompts, f"relay {victim}")
    async with e_p_d.dispatcher() as dispatcher:
        free = await stream(dispatcher, sent)
        before = migrations(victim)
        counts = [0]
        if victim == "prefill":
            for name in names:
                e_p_d.engines[name].prefill_s_per_token = 0.1
        relayed = counting(dispatcher, sent, counts, 0)
        try:
            if victim == "decode":
                await after_tokens([relayed], counts, 5)
            else:
                await wait_until_async(
                    lambda: any(map(e_p_d.active, names)), 30, "a prefill running", 0.01
                )
            await e_p_d.crash(e_p_d.busiest(*names))
            chunks = await asyncio.wait_for(relayed, 60)
        finally:
            for name in names:
                e_p_d.engines[name].prefill_s_per_token = 0.0
            await e_p_d.revive()
    assert tokens(chunks) == tokens(free) and text(chunks) == text(free)
    assert migrations(victim) - before == 1
