"""Deployments of each pattern with two instances of each language role, streamed requests
with images read to their end, and a fault dealt to the worker serving most of them mid-stream:
what the migration tests share."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai

from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.deployment import Deployment, free_port, serve_directory
from tests.support.images import photo_like
from tests.support.waiting import wait_until_async

from .conftest import metric
from .streams import BOUND_S

MODEL = "tiny-qwen2_vl-seed0"
TOKENS = 48
STREAMS = 8
MOCK = ["--engine", "mock", "--mock-decode-ms-per-token", "30"]
# A tiny model's distribution is nearly flat: at low temperature a seeded draw stays far from
# the float32 rounding between two ids, where a migration's prefill of the prompt and the tokens
# so far and the decode steps that made them may differ.
TEMPERATURE = 0.3


@dataclass(frozen=True)
class Pattern:
    components: list[tuple[str, str, list[str]]]
    streaming: tuple[str, ...]  # the workers that stream tokens (one of them is hit)
    language: tuple[str, ...]  # the language workers, restarted in turn


def _two(role: str, *flags: str) -> list[tuple[str, str, list[str]]]:
    return [(f"{role}-{x}", role, list(flags)) for x in "ab"]


PATTERNS = {
    "agg": Pattern(_two("worker", "--encode"), ("worker-a", "worker-b"), ()),
    "ep_d": Pattern(
        _two("prefill", "--encode") + _two("decode"),
        ("decode-a", "decode-b"),
        ("prefill-a", "prefill-b", "decode-a", "decode-b"),
    ),
    "e_pd": Pattern([("encode", "encode", []), *_two("worker")], ("worker-a", "worker-b"), ()),
    "e_p_d": Pattern(
        [("encode", "encode", []), *_two("prefill"), *_two("decode")],
        ("decode-a", "decode-b"),
        ("prefill-a", "prefill-b", "decode-a", "decode-b"),
    ),
}


@dataclass
class Served:
    pattern: str
    deployment: Deployment
    ports: dict[str, int]  # metrics port of each worker
    images: str
    streams: int = STREAMS
    references: list[str] = field(default_factory=list)

    @property
    def spec(self) -> Pattern:
        return PATTERNS[self.pattern]

    def role(self, name: str) -> str:
        return next(role for n, role, _ in self.deployment.workers if n == name)

    def active(self, name: str) -> float:
        if self.deployment.processes[name].poll() is not None:
            return 0.0
        labels = f'component="{self.role(name)}"'
        return metric(self.ports[name], "mmserve_active_requests", labels)

    def busiest(self) -> str:
        return max(self.spec.streaming, key=self.active)

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=f"{self.deployment.base_url}/v1", api_key="unused", max_retries=0
        )


@contextlib.contextmanager
def image_server(root: Path) -> Iterator[str]:
    """Four small images of different sizes on a loopback server: its base URL."""
    for i in range(4):
        photo_like(84 + 28 * (i % 2), 56 + 28 * (i // 2), seed=i).save(root / f"{i}.png")
    with serve_directory(root) as (url, _server):
        yield url


@contextlib.contextmanager
def deployed(
    pattern: str, engine: list[str], streams: int, nats_url: str, images: str, logs: Path
) -> Iterator[Served]:
    """`pattern` with every worker on `engine`, and its fault-free answers to `streams`
    streams."""
    spec = PATTERNS[pattern]
    ports = {name: free_port() for name, _, _ in spec.components}
    deployment = Deployment(
        pattern,
        build_tiny_model("qwen2_vl"),
        nats_url,
        logs,
        worker_flags=engine,
        components=[
            (name, role, [*flags, "--metrics-port", str(ports[name])])
            for name, role, flags in spec.components
        ],
    )
    with deployment.running():
        found = Served(pattern, deployment, ports, images, streams)
        found.references = asyncio.run(answers_of(found, range(streams)))
        try:
            yield found
        finally:
            for process in deployment.processes.values():
                if process.poll() is None:
                    process.send_signal(signal.SIGCONT)  # a frozen one must hear the SIGTERM


def messages(images: str, i: int) -> list[dict[str, object]]:
    """The chat of stream `i`: one of the four images of `image_server`, and a text of its
    own."""
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": f"{images}/{i % 4}.png"}},
                {"type": "text", "text": f"Tell story {i} about this picture."},
            ],
        }
    ]


def body(served: Served, i: int) -> dict[str, object]:
    """Stream `i`: an image, exactly `TOKENS` tokens, greedy (every fourth) or seeded: of 4
    streams over 2 workers, the one serving most serves a seeded one."""
    sampling = {"temperature": 0.0} if i % 4 == 0 else {"temperature": TEMPERATURE, "seed": i}
    return {
        "model": MODEL,
        "messages": messages(served.images, i),
        "max_tokens": TOKENS,
        "extra_body": {"min_tokens": TOKENS},
        "stream_options": {"include_usage": True},
        **sampling,
    }


@dataclass
class Answer:
    text: str = ""
    deltas: int = 0  # content deltas so far
    completion_tokens: int = 0


async def answer(
    client: openai.AsyncOpenAI, served: Served, i: int, progress: Answer | None = None
) -> Answer:
    """Stream `i` read to its end (an error event raises)."""
    progress = progress or Answer()
    stream = await client.chat.completions.create(stream=True, **body(served, i))  # type: ignore[call-overload]
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            progress.text += chunk.choices[0].delta.content
            progress.deltas += 1
        if chunk.usage is not None:
            progress.completion_tokens = chunk.usage.completion_tokens
    return progress


async def answers_of(served: Served, indices: range) -> list[str]:
    async with served.client() as client:
        found = await asyncio.gather(*(answer(client, served, i) for i in indices))
    assert all(a.completion_tokens == TOKENS for a in found), found
    return [a.text for a in found]


@dataclass
class Faulted:
    answers: list[Answer]
    victim: str
    at: int  # the median stream's tokens when the fault came
    ended_s: float  # from the fault to the end of the last stream


async def faulted(served: Served, fault: str, cut: int) -> Faulted:
    """The streams, `fault` (kill, stop) dealt to the worker serving most of them once most
    have `cut` tokens. The worker is found once every stream has begun (the routing is done
    by then), so that the fault comes at the cut, not a metrics read later."""
    progress = [Answer() for _ in range(served.streams)]

    def median() -> int:
        return sorted(p.deltas for p in progress)[served.streams // 2]

    async with served.client() as client:
        streams = [
            asyncio.ensure_future(answer(client, served, i, progress[i]))
            for i in range(served.streams)
        ]
        await wait_until_async(
            lambda: min(p.deltas for p in progress) > 0, 120, "every stream begun", 0.005
        )
        victim = await asyncio.to_thread(served.busiest)
        await wait_until_async(lambda: median() >= cut, 120, f"{cut} tokens", 0.005)
        process = served.deployment.processes[victim]
        process.send_signal(signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
        hit, at = time.monotonic(), median()
        answers = await asyncio.wait_for(asyncio.gather(*streams), BOUND_S)
        return Faulted(list(answers), victim, at, time.monotonic() - hit)


def check(served: Served, answers: list[Answer]) -> None:
    for i, (found, reference) in enumerate(zip(answers, served.references, strict=True)):
        assert found.completion_tokens == TOKENS, (i, found)
        assert found.text == reference, (i, found.text, reference)
