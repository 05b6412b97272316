"""Migration on the hf engine (aggregated, two workers, the tiny Qwen2-VL): the worker serving
most of 4 streams with images, 1 greedy and 3 seeded, is SIGKILLed at a random token between
the 5th and the 40th of 48; every stream ends with the fault-free text, which for the seeded
ones only a continuation of the very draws (the next token index of the same seed) gives.
A token costs some 40 ms of CPU on two cores: 4 streams."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

from .conftest import Trial
from .migration import TOKENS, check, deployed, faulted, image_server


def test_sigkill_mid_stream_seeded_streams_go_on_with_the_same_draws(
    nats_url: str, tmp_path: Path, trial: Trial
) -> None:
    cut = random.Random("hf").randint(5, 40)
    with (
        image_server(tmp_path) as images,
        deployed("agg", [], 4, nats_url, images, tmp_path) as hf,
    ):
        hit = asyncio.run(faulted(hf, "kill", cut))
        check(hf, hit.answers)
    trial(
        f"agg, hf engine: SIGKILL the worker serving most of 4 streams with images (3 seeded) "
        f"at token {hit.at} of {TOKENS}",
        1,
        f"every stream ended with its {TOKENS} tokens and the fault-free text, the last "
        f"{hit.ended_s:.1f} s after the kill",
    )
