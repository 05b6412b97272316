"""A caller run as its own process: `python tests/runtime/caller.py URL NAMESPACE INSTANCE_ID
REQUEST_ID` streams a long `svc.count` call from that instance, prints "streaming" once the
first reply arrived, and reads on until killed."""

from __future__ import annotations

import sys

from mmserve import protocol as p
from mmserve.runtime import Runtime, run


async def main(url: str, namespace: str, instance_id: str, request_id: str) -> None:
    runtime = await Runtime.connect(url, namespace)
    long_stream = p.TokenChunk(
        request_id="", token_ids=[1_000_000], usage=p.Usage(prompt_tokens=20)
    )
    replies = runtime.client("svc", "count").stream(
        long_stream, p.TokenChunk, instance_id=instance_id, request_id=request_id
    )
    async for reply in replies:
        if reply.token_ids == [0]:
            print("streaming", flush=True)


if __name__ == "__main__":
    run(main(*sys.argv[1:5]))
