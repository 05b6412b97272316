"""Streamed chat requests read to their end, for the fault tests."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass

import httpx

MODEL = "tiny-qwen2_vl-seed0"
# A fault must end every stream it touches well within this; the frontend's own deadline
# (300 s) is far beyond it, so only the failure detection can meet it.
BOUND_S = 30.0
RETRY_PAUSE_S = 0.1


def chat_body(max_tokens: int, text: str = "Tell me a long story.") -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }


@dataclass
class Outcome:
    status: int
    tokens: int = 0
    finished: bool = False
    error: str | None = None
    ended_at: float = 0.0  # time.monotonic() when the answer ended


async def stream_chat(
    client: httpx.AsyncClient, body: dict[str, object], first: asyncio.Event | None = None
) -> Outcome:
    """One streamed request, read to its end: finished, or the code of its error."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        outcome = Outcome(response.status_code)
        if response.status_code != 200:
            await response.aread()
            outcome.error = response.json()["error"]["code"]
            outcome.ended_at = time.monotonic()
            return outcome
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                outcome.error = event["error"]["code"]
                continue
            choice = event["choices"][0]
            if choice["delta"].get("content"):
                outcome.tokens += 1
                if first is not None:
                    first.set()
            outcome.finished = outcome.finished or choice["finish_reason"] is not None
        outcome.ended_at = time.monotonic()
        return outcome


async def stream_until(
    client: httpx.AsyncClient, stop: asyncio.Event, body: dict[str, object]
) -> list[tuple[float, Outcome]]:
    """One client's streams back to back until `stop`: (sent at, outcome) of each. After a
    refusal it pauses `RETRY_PAUSE_S`, as a client's retry does: six clients re-sending at once
    would keep two cores busy with 503s while the cluster elects leaders and reconnects."""
    sent: list[tuple[float, Outcome]] = []
    while not stop.is_set():
        started = time.monotonic()
        outcome = await stream_chat(client, body)
        sent.append((started, outcome))
        if outcome.status != 200:
            await asyncio.sleep(RETRY_PAUSE_S)
    return sent


async def started_streams(
    client: httpx.AsyncClient, count: int, max_tokens: int, text: str
) -> list[asyncio.Task[Outcome]]:
    """`count` streamed requests (`"{text} {i}"`, `max_tokens` each), once every one of them
    has its first token."""
    firsts = [asyncio.Event() for _ in range(count)]
    streams = [
        asyncio.ensure_future(stream_chat(client, chat_body(max_tokens, f"{text} {i}"), firsts[i]))
        for i in range(count)
    ]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 120)
    return streams
