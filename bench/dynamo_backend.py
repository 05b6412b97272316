"""Both frontends in front of the same kind of worker: mmserve's frontend before `mmserve worker
--encode`, and Dynamo's frontend (from `$VENV/dynamo`) before `python -m mmserve.dynamo`, both
with the hf engine on the trained tiny Qwen2-VL. Per frontend and images per request (0, 1):
TTFT median and min over `--requests` sequential streamed requests (after two warm-up ones),
and the frontend process's CPU time per request (from /proc; its workers' CPU not counted, and
mmserve's frontend fetches the image where Dynamo's worker does).

    .venv/bin/python -m bench.dynamo_backend --requests 10
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from mmserve.runtime.nats_server import nats_url_from_env_or_private
from mmserve.tiny import scenes
from mmserve.tiny.trained import build_trained_model
from tests.support.deployment import Deployment
from tests.support.dynamo import DynamoDeployment, dynamo_missing
from tests.support.images import png_data_url


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ttft_ms(base_url: str, model: str, seed: int, images: int) -> float:
    question = scenes.question("colour", seed)
    image = {"type": "image_url", "image_url": {"url": png_data_url(question.images[0])}}
    content = [image] * images + [{"type": "text", "text": question.text}]
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    started = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if first is None and line.startswith("data:") and '"content"' in line:
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError(f"{base_url}: a stream without content")
    return first * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10)
    args = parser.parse_args()
    if (missing := dynamo_missing()) is not None:
        raise SystemExit(missing)
    model = build_trained_model()
    with nats_url_from_env_or_private() as nats_url, tempfile.TemporaryDirectory() as logs:
        ours = Deployment("agg", model, nats_url, Path(logs))
        theirs = DynamoDeployment(model, nats_url, Path(logs))
        try:
            ours.start()
            theirs.start()
            ours.wait_ready()
            theirs.wait_ready()
            for images in (0, 1):
                for name, base_url, frontend in (
                    ("mmserve", ours.base_url, ours.processes["frontend"].pid),
                    ("dynamo", theirs.base_url, theirs.processes["frontend"].pid),
                ):
                    for seed in (0, 1):  # warm-up
                        ttft_ms(base_url, model.name, seed, images)
                    cpu = cpu_seconds(frontend)
                    ttfts = [
                        ttft_ms(base_url, model.name, 100 + i, images) for i in range(args.requests)
                    ]
                    per_request = (cpu_seconds(frontend) - cpu) / args.requests * 1000
                    print(
                        f"{name:8s} {images} image(s): ttft median {statistics.median(ttfts):7.1f}"
                        f" ms, min {min(ttfts):6.1f} ms; frontend CPU {per_request:5.1f} "
                        "ms/request",
                        flush=True,
                    )
        finally:
            theirs.stop()
            ours.stop()


if __name__ == "__main__":
    main()
