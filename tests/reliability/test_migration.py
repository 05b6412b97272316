"""No request lost when a worker dies or is restarted, in agg, EP/D, E/PD and E/P/D: real
processes over the suite's nats-server, two instances of each language role, one deployment
per pattern shared by its scenarios, on the mock engine (30 ms a token, tokens drawn from the
prompt: a resumed stream must give the very ids and text the fault-free one has).

- SIGKILL of the worker serving most of 8 concurrent streams with images, at a random token
  between the 5th and the 40th of 48: every stream ends with its 48 tokens and the fault-free
  text. On the hf engine (aggregated, the tiny Qwen2-VL), with greedy and seeded streams: the
  same text as without the fault, which only exact continuation of the draws gives.
- SIGSTOP of that worker, past the keepalive and the idle timeout: the same; once it runs
  again nothing of the abandoned calls keeps running there.
- A rolling restart under constant load: every language worker SIGTERMed in turn, a
  replacement started after each exits: no request fails, each answer is the fault-free one,
  each drained worker exits 0 by itself.

EP/D and E/PD get the SIGKILL; agg and E/P/D every scenario (`EVERY_SCENARIO`).
"""

from __future__ import annotations

import asyncio
import random
import signal
from collections.abc import Iterator

import openai
import pytest

from tests.support.waiting import wait_until_async

from .conftest import Trial, restart_worker
from .migration import (
    MOCK,
    STREAMS,
    TOKENS,
    Answer,
    Served,
    answer,
    check,
    deployed,
    faulted,
    image_server,
)
from .streams import BOUND_S

# The patterns that get every scenario, the others the SIGKILL alone (each scenario costs
# seconds of CI on two cores): a frozen worker is found out by its caller's idle timeout (10 s),
# and a drained one leaves as the runtime makes it, the same in every pattern; the frontend's
# own call (agg) and the encode worker's relayed call to decode and prefill (E/P/D) cover both
# callers and every language role.
EVERY_SCENARIO = ("agg", "e_p_d")


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with image_server(tmp_path_factory.mktemp("migration-images")) as url:
        yield url


@pytest.fixture(scope="module", params=["agg", "ep_d", "e_pd", "e_p_d"])
def served(
    request: pytest.FixtureRequest,
    nats_url: str,
    images: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:
    logs = tmp_path_factory.mktemp(f"migration-{request.param}")
    with deployed(request.param, MOCK, STREAMS, nats_url, images, logs) as found:
        yield found


def test_sigkill_mid_stream_every_stream_ends_as_without_the_fault(
    served: Served, trial: Trial
) -> None:
    cut = random.Random(served.pattern).randint(5, 40)
    hit = asyncio.run(faulted(served, "kill", cut))
    check(served, hit.answers)
    restart_worker(served.deployment, hit.victim)
    trial(
        f"{served.pattern}: SIGKILL the worker serving most of 8 streams with images at token "
        f"{hit.at} of {TOKENS}",
        1,
        f"every stream ended with its {TOKENS} tokens and the fault-free text, the last "
        f"{hit.ended_s:.1f} s after the kill",
    )


@pytest.mark.parametrize("served", EVERY_SCENARIO, indirect=True)
def test_sigstop_mid_stream_every_stream_ends_as_without_the_fault(
    served: Served, trial: Trial
) -> None:
    cut = random.Random(f"{served.pattern}-stop").randint(5, 40)
    hit = asyncio.run(faulted(served, "stop", cut))
    check(served, hit.answers)
    served.deployment.processes[hit.victim].send_signal(signal.SIGCONT)

    async def idle() -> bool:
        return await asyncio.to_thread(served.active, hit.victim) == 0

    # Running again, it hears that its callers left: nothing keeps generating there.
    asyncio.run(wait_until_async(idle, BOUND_S, f"{hit.victim} idle again", 0.1))
    trial(
        f"{served.pattern}: SIGSTOP the worker serving most of 8 streams with images at token "
        f"{hit.at} of {TOKENS}, past the idle timeout",
        1,
        f"every stream ended with its {TOKENS} tokens and the fault-free text, the last "
        f"{hit.ended_s:.1f} s after the stop; running again, the frozen worker dropped the "
        "calls its callers had left",
    )


@pytest.mark.parametrize("served", EVERY_SCENARIO, indirect=True)
def test_rolling_restart_under_load_fails_no_request(served: Served, trial: Trial) -> None:
    language = served.spec.language or served.spec.streaming
    stop = asyncio.Event()
    answered: list[tuple[int, Answer]] = []

    async def client_loop(client: openai.AsyncOpenAI, first: int) -> None:
        i = first
        while not stop.is_set():
            answered.append((i, await answer(client, served, i)))
            i = (i + 4) % served.streams

    async def run() -> list[int]:
        codes = []
        async with served.client() as client:
            load = [asyncio.ensure_future(client_loop(client, first)) for first in range(4)]
            try:
                for name in language:
                    # Under load: answers come since the last restart (a failure ends a client).
                    since = len(answered)

                    def loaded(since: int = since) -> bool:
                        return len(answered) > since or any(task.done() for task in load)

                    await wait_until_async(loaded, BOUND_S, "answers under load")
                    if any(task.done() for task in load):
                        break
                    process = served.deployment.processes[name]
                    process.send_signal(signal.SIGTERM)
                    codes.append(await asyncio.to_thread(process.wait, BOUND_S))
                    await asyncio.to_thread(restart_worker, served.deployment, name)
            finally:
                stop.set()
                await asyncio.gather(*load)
        return codes

    codes = asyncio.run(run())
    assert codes == [0] * len(language)
    for i, found in answered:
        assert found.completion_tokens == TOKENS and found.text == served.references[i], i
    trial(
        f"{served.pattern}: rolling restart of {', '.join(language)} under 4 clients' streams",
        len(answered),
        f"{len(answered)} requests, none failed, each the fault-free answer; every drained "
        "worker exited 0",
    )
