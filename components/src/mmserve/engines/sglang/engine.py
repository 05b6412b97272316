"""`SglangEngine`: mmserve's engine interface over one `sglang.Engine` or one `MMEncoder`.

- Encode: SGLang's `MMEncoder` (`sglang.srt.disaggregation.encoder.server`) loads the vision
  model through SGLang (weights, TP, kernels). Its `encode(mm_items, modality, req_id, ...)`
  fetches and preprocesses raw media itself, so it cannot take the Rust core's pixels; the
  engine calls the loaded model's `get_image_feature` (a video's: `get_video_feature`) with
  the items `_encode` builds (`convert.encoder_item`: a `MultimodalDataItem` of `feature` =
  pixel_values and `image_grid_thw`, or `pixel_values_videos` and `video_grid_thw`); a
  clip's log-mel features go through the loaded audio tower and projector with the clip's
  frame mask (`audio_tower.audio_rows`, transformers' rows). An
  encode worker (`--encoder-only`) holds only the encoder; a worker that encodes beside its
  language model makes one on its first item.
- Prefill / decode / aggregated: `sglang.Engine.async_generate` with the arguments
  `convert.generate_kwargs` builds (the expanded `input_ids`, one item of embeddings per
  modality, `mm_hashes`).
- P/D: SGLang moves the KV itself. The prefill engine's `bootstrap_info` picks a bootstrap room
  (host: `--host`, or this machine's address when that is a loopback or wildcard one), which
  prefill answers decode in a `protocol.BootstrapInfo` before it runs the request in the
  background; `export_kv` hands decode the embeddings (as SGLang took them) for the
  decode-side request, which decode's `import_kv` builds from its own request (the prompt, its
  items, positions), and decode's `async_generate` joins the same room
  (`--disaggregation-mode prefill|decode`, `--disaggregation-transfer-backend nixl`). The first
  token arrives in decode's stream; the handle's `first_token` is -1 on both sides.
- KV events: SGLang's ZMQ publisher (`--kv-events-config`; on loopback by default), bridged
  by `kv_events.SglangKvEventBridge`.
- Clearing the caches: the tokenizer manager's `flush_cache` (what `sglang.Engine.flush_cache`
  and SGLang's `/flush_cache` call) resets the radix cache, which publishes
  `AllBlocksCleared` (a `KvCleared` through the bridge), and the multimodal preprocessing
  cache. SGLang refuses while requests run or wait.

`load` checks the installed SGLang first (`checks.check_sglang`, `checks.check_sglang_padding`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import socket
import threading
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mmserve.engines.audio_tower import audio_rows
from mmserve.engines.base import (
    Admission,
    Embeddings,
    Engine,
    EngineError,
    EngineOverloaded,
    EngineRequest,
    ItemEmbedding,
    KvEventSink,
    KvHandle,
    MediaInput,
)
from mmserve.engines.defaults import DEFAULT_MAX_QUEUE
from mmserve.engines.sampling import check_sampling
from mmserve.engines.sglang.args import (
    RAW_LOGPROBS_ENV,
    kv_events_config,
    parse_sglang_args,
    sglang_argv,
)
from mmserve.engines.sglang.checks import (
    SglangStartupError,
    check_sglang,
    check_sglang_padding,
    sglang_splits_images,
)
from mmserve.engines.sglang.convert import (
    check_disaggregated,
    encoder_item,
    generate_calls,
    generate_kwargs,
    sglang_rows,
)
from mmserve.engines.sglang.kv_events import SglangKvEventBridge, zmq_reader
from mmserve.engines.sglang.outputs import SglangStream
from mmserve.kv.hashing import DEFAULT_BLOCK_SIZE
from mmserve.kv.pad import PadScheme
from mmserve.protocol import (
    BootstrapInfo,
    CachesCleared,
    FirstToken,
    PrefillDone,
    SamplingParams,
    StopConditions,
    TokenChunk,
)

log = logging.getLogger(__name__)

_UNROUTABLE_HOSTS = ("127.0.0.1", "0.0.0.0", "localhost", "::", "::1")


@dataclass(frozen=True)
class SglangKv:
    """What decode's `async_generate` sends beside its sampling: the request (prompt, items,
    positions), the embeddings of its items, and the prefill's bootstrap room (None for a
    handle that decode never joins to a prefill: an aggregated one)."""

    request: EngineRequest
    embeddings: tuple[ItemEmbedding, ...]
    bootstrap: BootstrapInfo | None


class SglangEngine(Engine[SglangKv]):
    """mmserve's engine interface over SGLang (one `sglang.Engine` or one `MMEncoder`)."""

    def __init__(
        self,
        args: argparse.Namespace,
        *,
        block_size: int,
        max_queue: int,
        pad_scheme: PadScheme,
    ) -> None:
        self.args = args
        self.admission = Admission(max_queue)
        self.pad_scheme = pad_scheme
        self.bridge = SglangKvEventBridge(block_size, pad_scheme)
        self.mode: str = args.disaggregation_mode
        self.incremental: bool = bool(args.incremental_streaming_output)
        self.splits_images = True
        self.bootstrap_host: str = args.host
        self._llm: Any = None
        self._encoder: Any = None
        self._encoder_lock = threading.Lock()
        self._background: set[asyncio.Task[None]] = set()
        self._stop_events = threading.Event()
        self._event_threads: list[threading.Thread] = []

    @classmethod
    async def load(
        cls,
        model_path: Path,
        *,
        role: str,
        sglang_args: Sequence[str] = (),
        block_size: int = DEFAULT_BLOCK_SIZE,
        max_queue: int = DEFAULT_MAX_QUEUE,
        pad_scheme: PadScheme = PadScheme.DYNAMO,
    ) -> SglangEngine:
        """Check SGLang, parse its flags and start it (in a thread: loading takes minutes)."""
        version = check_sglang(pad_scheme)
        args = parse_sglang_args(sglang_argv(model_path, role, sglang_args))
        if args.page_size not in (None, block_size):
            raise SglangStartupError(
                f"--page-size {args.page_size} differs from --block-size {block_size}: "
                "SGLang's KV events would not line up with the router's blocks"
            )
        args.page_size = block_size
        if (
            not args.kv_events_config
            and not args.encoder_only
            and args.disaggregation_mode != "decode"
        ):
            args.kv_events_config = kv_events_config(_free_port())
        if not args.encoder_only:
            # SGLang's model registry imports every model module: a thread.
            await asyncio.to_thread(check_sglang_padding, model_path)
        engine = cls(args, block_size=block_size, max_queue=max_queue, pad_scheme=pad_scheme)
        engine.splits_images = sglang_splits_images()
        if not engine.splits_images:
            log.warning(
                "sglang %s keeps the images of a multi-image request in one item: such "
                "prompts are cached under SGLang's own hashes, which KV routing cannot "
                "predict (single-image prompts route as usual)",
                version,
            )
        await asyncio.to_thread(engine._start)
        log.info("sglang %s started (%s, pad scheme %s)", version, role, pad_scheme.value)
        return engine

    def _start(self) -> None:
        from sglang.srt.server_args import ServerArgs

        if self.mode == "prefill" and self.bootstrap_host in _UNROUTABLE_HOSTS:
            from sglang.srt.utils.network import get_local_ip_auto

            self.bootstrap_host = get_local_ip_auto()  # decode may run on another machine
        if self.args.encoder_only:
            self._encoder = self._make_encoder()
        else:
            import sglang

            os.environ.setdefault(*RAW_LOGPROBS_ENV)  # read by its spawned scheduler

            self._llm = sglang.Engine(server_args=ServerArgs.from_cli_args(self.args))

    def _make_encoder(self, **overrides: Any) -> Any:
        from sglang.srt.disaggregation.encoder.server import MMEncoder
        from sglang.srt.runtime_context import publish
        from sglang.srt.server_args import ServerArgs

        server_args = ServerArgs.from_cli_args(
            argparse.Namespace(**{**vars(self.args), **overrides})
        )
        publish(server_args, role="encoder")  # MMEncoder asserts its process published it
        # a free port for its (single-rank) process group
        return MMEncoder(server_args, dist_init_method=f"tcp://127.0.0.1:{_free_port()}")

    # -- encode ---------------------------------------------------------------------------

    async def encode(self, items: Sequence[MediaInput]) -> list[ItemEmbedding]:
        with self.admission():
            return await asyncio.to_thread(self._encode, list(items))

    def _encode(self, items: list[MediaInput]) -> list[ItemEmbedding]:
        with self._encoder_lock:
            if self._encoder is None:
                # A worker that encodes beside its language model (agg, EP/D): SGLang's
                # Engine keeps its vision tower inside its scheduler process, so the encoder
                # loads the vision model a second time here.
                self._encoder = self._make_encoder(encoder_only=True, disaggregation_mode="null")

        model = self._encoder.model
        target = model.thinker if hasattr(model, "thinker") else model
        out = []
        with torch.inference_mode():
            for item in items:
                if item.modality == "audio":
                    # Not SGLang's `get_audio_feature`: it runs the tower without the clip's
                    # frame mask, so a clip under 30 s would get other rows than transformers'.
                    tower = target.audio_tower
                    (rows,) = audio_rows(tower, target.multi_modal_projector, [item], tower.dtype)
                else:
                    mm_item = encoder_item(item, self._encoder.device)
                    rows = getattr(target, f"get_{item.modality}_feature")([mm_item])
                rows = rows.reshape(-1, rows.shape[-1]).to("cpu")
                out.append(ItemEmbedding(item.mm_hash, item.grid_thw, rows))
        return out

    # -- prefill / decode -----------------------------------------------------------------

    def bootstrap_info(self) -> BootstrapInfo | None:
        """A fresh room on this prefill engine's bootstrap server (host: `--host`, or this
        machine's address when that is a loopback or wildcard one)."""
        if self.mode != "prefill":
            return None
        return BootstrapInfo(
            host=self.bootstrap_host,
            port=self.args.disaggregation_bootstrap_port,
            room=secrets.randbits(63),
        )

    async def prefill(
        self,
        request: EngineRequest,
        given: Embeddings,
        bootstrap: BootstrapInfo | None = None,
    ) -> KvHandle[SglangKv]:
        check_sampling(request.sampling, request.stop)
        request.check_media(given)
        # SGLang's radix cache is not read from here: every item needs its embedding.
        embeddings = request.live_embeddings(given, 0)
        llm = self._language_model()
        self.bridge.remember(item.mm_hash for item in embeddings)
        if self.mode == "prefill":
            if bootstrap is None:
                raise EngineError("a prefill-mode sglang engine prefills into a bootstrap room")
            check_disaggregated(request.sampling)
            stream = await llm.async_generate(
                **self._generate_kwargs(request, embeddings, bootstrap)
            )
            task = asyncio.create_task(_drain(stream))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        state = SglangKv(request, tuple(embeddings), bootstrap)
        return KvHandle(request.request_id, len(request.token_ids), [FirstToken(-1)], 0, state)

    def decode(
        self, kv: KvHandle[SglangKv], sampling: SamplingParams, stop: StopConditions
    ) -> AsyncIterator[TokenChunk]:
        request = replace(kv.state.request, sampling=sampling, stop=stop)
        return self._stream(request, kv.state.embeddings, kv.state.bootstrap)

    async def generate(
        self, request: EngineRequest, given: Embeddings = ()
    ) -> AsyncIterator[TokenChunk]:
        check_sampling(request.sampling, request.stop)
        request.check_media(given)
        embeddings = request.live_embeddings(given, 0)
        self.bridge.remember(item.mm_hash for item in embeddings)
        async with aclosing(self._stream(request, embeddings, None)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _stream(
        self,
        request: EngineRequest,
        embeddings: Sequence[ItemEmbedding],
        bootstrap: BootstrapInfo | None,
    ) -> AsyncGenerator[TokenChunk, None]:
        llm = self._language_model()
        if bootstrap is not None:
            check_disaggregated(request.sampling)
        calls = generate_calls(request, embeddings, bootstrap, splits_images=self.splits_images)
        # One call per choice (one for a request that only scores its prompt).
        reader = SglangStream(request, len(calls), incremental=self.incremental)
        with self.admission():
            streams = [await llm.async_generate(**kwargs) for kwargs in calls]
            try:
                async with aclosing(_outputs(streams)) as outputs:
                    async for index, out in outputs:
                        chunk = reader.read(index, out)
                        if chunk is not None:
                            yield chunk
                        if reader.done:
                            return
            finally:
                if not reader.done:
                    # The caller left (or a read failed): SGLang aborts an engine request only
                    # when asked, and would otherwise generate it to its end.
                    for kwargs in calls:
                        llm.tokenizer_manager.abort_request(rid=kwargs["rid"])

    async def export_kv(self, kv: KvHandle[SglangKv]) -> dict[str, torch.Tensor]:
        if self.mode != "prefill" or kv.state.bootstrap is None:
            raise EngineError("only a prefill-mode sglang engine hands its KV cache over")
        # The KV itself moves through the bootstrap room; decode's request needs the
        # embeddings beside its own plan, as SGLang took them (deepstack included), so that
        # decode's items equal prefill's.
        embeddings = kv.state.embeddings
        if not embeddings:
            return {}
        return {"embeddings": torch.cat([sglang_rows(e) for e in embeddings]).contiguous()}

    async def import_kv(
        self,
        request: EngineRequest,
        done: PrefillDone,
        tensors: dict[str, torch.Tensor],
        bootstrap: BootstrapInfo | None = None,
    ) -> KvHandle[SglangKv]:
        if self.mode != "decode" or bootstrap is None:
            raise EngineError("only a decode-mode sglang engine joins a prefill's bootstrap room")
        check_disaggregated(request.sampling)
        rows = tensors.get("embeddings", torch.empty(0))
        expected = sum(item.length for item in request.media)
        if rows.shape[0] != expected:
            raise EngineError(
                f"the prefill handed over {rows.shape[0]} embedding rows for the {expected} "
                "media tokens of the plan"
            )
        embeddings = []
        row = 0
        for item in request.media:
            # As prefill sent them: an item's deepstack columns stay beside its rows.
            embeddings.append(
                ItemEmbedding(item.mm_hash, item.grid_thw, rows[row : row + item.length])
            )
            row += item.length
        state = SglangKv(request, tuple(embeddings), bootstrap)
        return KvHandle(request.request_id, done.prompt_tokens, [FirstToken(-1)], 0, state)

    def release(self, kv: KvHandle[SglangKv]) -> None:
        """Nothing to free here: SGLang owns the KV; a prefill room finishes in the
        background once decode has pulled it (or SGLang's bootstrap timeout ends it)."""

    # -- KV events ------------------------------------------------------------------------

    def subscribe_kv_events(self, sink: KvEventSink) -> None:
        config = self.args.kv_events_config
        if not config:
            log.warning("sglang: no KV events (an encoder or decode engine caches no prompts)")
            return
        from sglang.srt.disaggregation.kv_events import KVEventsConfig

        events = KVEventsConfig.from_cli(config)
        endpoint = events.endpoint.replace("*", "127.0.0.1")
        thread = threading.Thread(
            target=zmq_reader,
            args=(endpoint, events.topic, self.bridge, sink, self._stop_events),
            name="sglang-kv-events",
            daemon=True,
        )
        thread.start()
        self._event_threads.append(thread)

    def kv_cache_snapshot(self) -> list[tuple[int, int | None, int]]:
        return self.bridge.snapshot()

    async def clear_caches(self) -> CachesCleared:
        """SGLang's `flush_cache` on the language model (an encoder keeps no cache here): the
        radix cache's `AllBlocksCleared` event reaches the sinks through the bridge."""
        if self._llm is None:
            return CachesCleared()
        blocks = len(self.bridge.snapshot())
        # Awaited here, as `async_generate`'s requests are: the tokenizer manager serves the
        # loop that first called it (`sglang.Engine.flush_cache` is its blocking wrapper).
        result = await self._llm.tokenizer_manager.flush_cache()
        if not result.success:
            raise EngineOverloaded(
                "sglang did not flush its cache: "
                + (result.message or "requests are running or waiting; retry when idle")
            )
        return CachesCleared(prefix_blocks=blocks)

    async def close(self) -> None:
        self.admission.close()
        self._stop_events.set()
        for task in list(self._background):
            task.cancel()
        if self._llm is not None:
            await asyncio.to_thread(self._llm.shutdown)
        for thread in self._event_threads:
            thread.join(timeout=1)

    # -- internals ------------------------------------------------------------------------

    def _generate_kwargs(
        self,
        request: EngineRequest,
        embeddings: Sequence[ItemEmbedding],
        bootstrap: BootstrapInfo | None,
    ) -> dict[str, Any]:
        return generate_kwargs(request, embeddings, bootstrap, splits_images=self.splits_images)

    def _language_model(self) -> Any:
        if self._llm is None:
            raise EngineError("this sglang worker is an encoder (--encoder-only)")
        return self._llm


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _outputs(
    streams: Sequence[AsyncIterator[dict[str, Any]]],
) -> AsyncGenerator[tuple[int, dict[str, Any]], None]:
    """Each output of the request's streams (one per choice) as it comes, with its choice. Every
    stream is closed at the end, and a pending read cancelled, so none is left running
    behind a client that went away (`_stream` then asks SGLang to abort the requests, which
    closing alone does not)."""
    if len(streams) == 1:
        (stream,) = streams
        try:
            async for out in stream:
                yield 0, out
        finally:
            await _close(stream)
        return
    pending = {asyncio.ensure_future(anext(stream)): index for index, stream in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=pending.__getitem__):
                index = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, out
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await _close(stream)


async def _close(stream: AsyncIterator[dict[str, Any]]) -> None:
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


async def _drain(stream: AsyncIterator[dict[str, Any]]) -> None:
    """Run a prefill-mode request to its end (SGLang sends the KV while it runs)."""
    async for _ in stream:
        pass
