"""The sglang engine: SGLang 0.5.x runs the model stages on GPUs behind mmserve's interface.

- Encode: SGLang's `MMEncoder` (`sglang.srt.disaggregation.encoder.server`) loads the vision
  model through SGLang (weights, TP, kernels). Its `encode(mm_items, modality, req_id, ...)`
  fetches and preprocesses raw media itself, so it cannot take the Rust core's pixels; the
  engine calls the loaded model's `get_image_feature` with the items `_encode_missing` builds
  (`MultimodalDataItem` of `feature` = pixel_values and `image_grid_thw`). An encode worker
  (`--encoder-only`) holds only the encoder; a worker that encodes beside its language model
  makes one on its first image.
- Prefill / decode / aggregated: `sglang.Engine.async_generate` with the expanded `input_ids`,
  the embeddings as one `processor_output` image item (`precomputed_embeddings`,
  `image_grid_thw`, `modality`; SGLang takes exactly one such dict per request) and
  `mm_hashes` (16-digit hex), so SGLang's pad values, radix cache and KV events use the
  router's item identities.
- P/D: SGLang moves the KV itself. The prefill engine's `bootstrap_info` picks a bootstrap room
  (host: `--host`, or this machine's address when that is a loopback or wildcard one), which
  prefill answers decode in a `protocol.BootstrapInfo` before it runs the request in the
  background; `export_kv` hands decode the prompt and the embeddings for the decode-side
  request, and decode's `async_generate` joins the same room
  (`--disaggregation-mode prefill|decode`, `--disaggregation-transfer-backend nixl`). The first
  token arrives in decode's stream; the handle's `first_token` is -1 on both sides.
- KV events: SGLang's ZMQ publisher (`--kv-events-config`; on loopback by default), bridged
  by `SglangKvEventBridge`.

Start-up checks (`check_sglang`): the installed SGLang accepts `mm_hashes`, and the pad values
it derives from an item hash equal `router.pad.pad_values` under the configured scheme; a
mismatch stops the worker with the scheme that would match. Everything from `sglang` is
imported lazily, so this module imports without it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import inspect
import json
import logging
import secrets
import socket
import threading
import types
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from mmserve.engines.base import (
    Engine,
    EngineError,
    EngineOverloaded,
    EngineRequest,
    ItemEmbedding,
    KvEventSink,
    KvHandle,
    MediaInput,
)
from mmserve.engines.sglang_kv_events import SglangKvEventBridge, zmq_reader
from mmserve.kv.pad import PadScheme, pad_values
from mmserve.protocol import (
    BootstrapInfo,
    FinishReason,
    SamplingParams,
    StopConditions,
    TokenChunk,
    Usage,
)

log = logging.getLogger(__name__)

PAD_PROBE_HASH = 0x0123_4567_89AB_CDEF
"""The item hash whose pad values are compared with SGLang's at start-up."""

GENERATE_FIELDS = (
    "input_ids",
    "sampling_params",
    "image_data",
    "mm_hashes",
    "stream",
    "rid",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
)
"""Every argument the engine passes to `sglang.Engine.async_generate`."""

_UNROUTABLE_HOSTS = ("127.0.0.1", "0.0.0.0", "localhost", "::", "::1")

ROLE_SGLANG_ARGS: dict[str, tuple[tuple[str, ...], ...]] = {
    "prefill": (
        ("--disaggregation-mode", "prefill"),
        ("--disaggregation-transfer-backend", "nixl"),
    ),
    "decode": (("--disaggregation-mode", "decode"), ("--disaggregation-transfer-backend", "nixl")),
    "encode": (("--encoder-only",),),
}
"""SGLang flags a worker role implies, each left out where the user gave that flag."""


class SglangStartupError(RuntimeError):
    """The installed SGLang does not fit the configuration."""


_U64 = 0xFFFF_FFFF_FFFF_FFFF


def mm_hash_hex(mm_hash: int) -> str:
    """An item hash as SGLang's `mm_hashes` take it (parsed with `int(value, 16)`)."""
    return f"{mm_hash & _U64:016x}"


def _as_i64(value: int) -> int:
    """A u64 as the int64 a torch tensor holds (`& _U64` turns it back)."""
    value &= _U64
    return value - (1 << 64) if value >> 63 else value


def image_item(embeddings: Sequence[ItemEmbedding]) -> dict[str, Any]:
    """The request's images as one SGLang `processor_output` item."""
    return {
        "format": "processor_output",
        "modality": "IMAGE",
        "precomputed_embeddings": torch.cat([item.embeddings for item in embeddings]),
        "image_grid_thw": torch.tensor([item.grid_thw for item in embeddings], dtype=torch.long),
    }


def encoder_item(item: MediaInput, device: torch.device | str = "cpu") -> Any:
    """The Rust core's pixels as the `MultimodalDataItem` SGLang's encoder hands its model
    (`MMEncoder._build_model_mm_items`: `from_dict` of modality and feature, then the grid)."""
    from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem

    mm_item = MultimodalDataItem.from_dict(
        {"modality": Modality.IMAGE, "feature": item.pixel_values.to(device)}
    )
    mm_item.set("image_grid_thw", torch.tensor([item.grid_thw], dtype=torch.long))
    return mm_item


def sampling_params(sampling: SamplingParams, stop: StopConditions) -> dict[str, Any]:
    """mmserve's sampling and stop rules as SGLang's `sampling_params` dict."""
    params: dict[str, Any] = {
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else -1,
        "max_new_tokens": stop.max_tokens,
        "stop_token_ids": list(stop.stop_token_ids),
        "ignore_eos": stop.ignore_eos,
        "no_stop_trim": False,
    }
    if stop.stop:
        params["stop"] = list(stop.stop)
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    return params


def generate_kwargs(
    request: EngineRequest,
    embeddings: Sequence[ItemEmbedding],
    bootstrap: BootstrapInfo | None,
    *,
    splits_images: bool = True,
) -> dict[str, Any]:
    """The keyword arguments of one `async_generate` call (keys: `GENERATE_FIELDS`).

    `mm_hashes` go with one image, or with several where SGLang splits the item per image
    (`sglang_splits_images`); otherwise SGLang would drop them with a warning anyway."""
    kwargs: dict[str, Any] = {
        "input_ids": list(request.token_ids),
        "sampling_params": sampling_params(request.sampling, request.stop),
        "stream": True,
        "rid": request.request_id,
    }
    if embeddings:
        kwargs["image_data"] = [image_item(embeddings)]
        if len(embeddings) == 1 or splits_images:
            kwargs["mm_hashes"] = [mm_hash_hex(item.mm_hash) for item in embeddings]
    if bootstrap is not None:
        kwargs["bootstrap_host"] = bootstrap.host
        kwargs["bootstrap_port"] = bootstrap.port
        kwargs["bootstrap_room"] = bootstrap.room
    return kwargs


def kv_events_config(port: int) -> str:
    """SGLang's `--kv-events-config` for a ZMQ publisher on loopback `port`, which the engine
    reads (set when the user gave none, on engines that cache prompts)."""
    return json.dumps(
        {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}", "bind": True, "topic": ""}
    )


def sglang_argv(model_path: Path, role: str, argv: Sequence[str]) -> list[str]:
    """SGLang's command line for a worker: the model, the role's flags, the user's flags."""
    user = list(argv[1:] if argv[:1] == ["--"] else argv)
    given = {arg.split("=", 1)[0] for arg in user}
    implied = [
        arg for flag in ROLE_SGLANG_ARGS.get(role, ()) if flag[0] not in given for arg in flag
    ]
    return ["--model-path", str(model_path), *implied, *user]


def parse_sglang_args(argv: Sequence[str]) -> argparse.Namespace:
    """SGLang's own parser over `argv`, built as `prepare_server_args` builds it for
    `sglang serve` (so its abbreviations work too: `--tp` for `--tp-size`)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return parser.parse_args(list(argv))


def sglang_pad_values(item: Any, mm_hash: int) -> tuple[int, ...]:
    """The pad values SGLang gives `item` (an empty `MultimodalDataItem`) for `mm_hash`, as its
    tokenizer manager sets a caller's hash: `set_hash` (0.5.2x: four `padding_values`), else
    the hash field and `set_pad_value` (0.5.1x: one `pad_value`)."""
    if hasattr(item, "set_hash"):
        item.set_hash(mm_hash)
    else:
        item.hash = mm_hash
        item.set_pad_value()
    if hasattr(item, "padding_values"):
        return tuple(item.padding_values())
    return (item.pad_value,)


def sglang_splits_images() -> bool:
    """Whether SGLang turns a two-image `processor_output` item into one item per image, each
    then keyed by its own mm_hash. SGLang 0.5.23 (`get_new_expanded_mm_items`) splits by patch
    counts (t*h*w per grid), which precomputed embeddings (t*h*w / merge^2 rows) do not match,
    so the images stay one item and per-image mm_hashes cannot apply."""
    from sglang.srt.managers.mm_utils import get_new_expanded_mm_items
    from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor

    rows = [ItemEmbedding(n, (1, 4, 4), torch.zeros(4, 1)) for n in (1, 2)]
    tables = types.SimpleNamespace(ATTR_NAME_TO_MODALITY={}, FEATURE_NAMES=[])
    (item,) = BaseMultimodalProcessor.collect_mm_items_from_processor_output(
        tables, image_item(rows)
    )
    item.offsets = [(0, 4), (4, 8)]
    return len(get_new_expanded_mm_items([item])) == 2


def check_sglang(scheme: PadScheme) -> str:
    """Check the installed SGLang against the adapter; return its version."""
    try:
        import sglang
        from sglang.srt.entrypoints.engine import Engine as SglEngine
        from sglang.srt.managers.io_struct import GenerateReqInput
        from sglang.srt.managers.schedule_batch import Modality, MultimodalDataItem
    except ImportError as exc:
        raise SglangStartupError(
            f"cannot import SGLang ({exc}); install it with pip install -e '.[sglang]'"
        ) from exc

    version = sglang.__version__
    accepted = set(inspect.signature(SglEngine.async_generate).parameters)
    fields = {field.name for field in dataclasses.fields(GenerateReqInput)}
    missing = [name for name in GENERATE_FIELDS if name not in accepted or name not in fields]
    if missing:
        raise SglangStartupError(
            f"SGLang {version} does not accept {', '.join(missing)} in async_generate; "
            "the sglang engine needs a release with mm_hashes (0.5.1x or later)"
        )
    theirs = sglang_pad_values(MultimodalDataItem(modality=Modality.IMAGE), PAD_PROBE_HASH)
    if theirs != pad_values(PAD_PROBE_HASH, scheme):
        matching = [s.value for s in PadScheme if pad_values(PAD_PROBE_HASH, s) == theirs]
        hint = f"--pad-scheme {matching[0]}" if matching else "no known --pad-scheme matches"
        raise SglangStartupError(
            f"SGLang {version} pads media with other values than --pad-scheme {scheme.value}: "
            f"routing would miss every cached image; start the frontend, router and workers "
            f"with {hint}"
        )
    return version


class SglangEngine(Engine):
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
        self.max_queue = max_queue
        self.pad_scheme = pad_scheme
        self.bridge = SglangKvEventBridge(block_size, pad_scheme)
        self.mode: str = args.disaggregation_mode
        self.incremental: bool = bool(args.incremental_streaming_output)
        self.splits_images = True
        self.bootstrap_host: str = args.host
        self._llm: Any = None
        self._encoder: Any = None
        self._encoder_lock = threading.Lock()
        self._inflight = 0
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
        block_size: int = 16,
        max_queue: int = 64,
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
        with self._admit():
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
                mm_item = encoder_item(item, self._encoder.device)
                rows = target.get_image_feature([mm_item])
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
        embeddings: Sequence[ItemEmbedding],
        bootstrap: BootstrapInfo | None = None,
    ) -> KvHandle:
        llm = self._language_model()
        self.bridge.remember(item.mm_hash for item in embeddings)
        if self.mode == "prefill":
            if bootstrap is None:
                raise EngineError("a prefill-mode sglang engine prefills into a bootstrap room")
            stream = await llm.async_generate(
                **self._generate_kwargs(request, embeddings, bootstrap)
            )
            task = asyncio.create_task(_drain(stream))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        state: dict[str, Any] = {"bootstrap": bootstrap, "embeddings": tuple(embeddings)}
        return KvHandle(request.request_id, request.token_ids, -1, 0, state)

    def decode(
        self, kv: KvHandle, sampling: SamplingParams, stop: StopConditions
    ) -> AsyncIterator[TokenChunk]:
        request = EngineRequest(kv.request_id, kv.prompt_token_ids, sampling, stop)
        return self._stream(request, kv.state["embeddings"], kv.state["bootstrap"])

    async def generate(
        self, request: EngineRequest, embeddings: Sequence[ItemEmbedding] = ()
    ) -> AsyncIterator[TokenChunk]:
        self.bridge.remember(item.mm_hash for item in embeddings)
        async for chunk in self._stream(request, embeddings, None):
            yield chunk

    async def _stream(
        self,
        request: EngineRequest,
        embeddings: Sequence[ItemEmbedding],
        bootstrap: BootstrapInfo | None,
    ) -> AsyncIterator[TokenChunk]:
        llm = self._language_model()
        with self._admit():
            stream = await llm.async_generate(
                **self._generate_kwargs(request, embeddings, bootstrap)
            )
            sent_ids = 0
            sent_text = ""
            async for out in stream:
                ids = list(out.get("output_ids") or ())
                text = out.get("text") or ""
                meta = out.get("meta_info") or {}
                finish = meta.get("finish_reason")
                if self.incremental:  # --incremental-streaming-output: outputs are deltas
                    chunk_ids, chunk_text = ids, text
                    sent_ids += len(ids)
                else:  # SGLang's default: each output repeats everything so far
                    chunk_ids, chunk_text = ids[sent_ids:], text[len(sent_text) :]
                    sent_ids, sent_text = len(ids), text
                if finish is None:
                    if chunk_ids:
                        yield TokenChunk(request.request_id, chunk_ids, chunk_text)
                    continue
                usage = Usage(
                    prompt_tokens=int(meta.get("prompt_tokens", len(request.token_ids))),
                    completion_tokens=int(meta.get("completion_tokens", sent_ids)),
                    cached_tokens=int(meta.get("cached_tokens", 0)),
                )
                yield TokenChunk(
                    request.request_id, chunk_ids, chunk_text, finish_reason(finish), usage
                )
                return

    async def export_kv(self, kv: KvHandle) -> dict[str, torch.Tensor]:
        if self.mode != "prefill" or kv.state["bootstrap"] is None:
            raise EngineError("only a prefill-mode sglang engine hands its KV cache over")
        # The KV itself moves through the bootstrap room; decode's request needs the prompt and
        # the embeddings beside it.
        embeddings: tuple[ItemEmbedding, ...] = kv.state["embeddings"]
        tensors = {
            "prompt_ids": torch.tensor(kv.prompt_token_ids, dtype=torch.long),
            "mm_hashes": torch.tensor([_as_i64(e.mm_hash) for e in embeddings], dtype=torch.long),
            "grids": torch.tensor([e.grid_thw for e in embeddings], dtype=torch.long).reshape(
                -1, 3
            ),
            "token_counts": torch.tensor([e.num_tokens for e in embeddings], dtype=torch.long),
        }
        if embeddings:
            tensors["embeddings"] = torch.cat([e.embeddings for e in embeddings]).contiguous()
        return tensors

    async def import_kv(
        self,
        request_id: str,
        tensors: dict[str, torch.Tensor],
        bootstrap: BootstrapInfo | None = None,
    ) -> KvHandle:
        if self.mode != "decode" or bootstrap is None:
            raise EngineError("only a decode-mode sglang engine joins a prefill's bootstrap room")
        prompt = tuple(int(t) for t in tensors["prompt_ids"].tolist())
        embeddings = []
        offset = 0
        for mm_hash, grid, count in zip(
            tensors["mm_hashes"].tolist(),
            tensors["grids"].tolist(),
            tensors["token_counts"].tolist(),
            strict=True,
        ):
            rows = tensors["embeddings"][offset : offset + count]
            embeddings.append(ItemEmbedding(mm_hash & _U64, (grid[0], grid[1], grid[2]), rows))
            offset += count
        state = {"bootstrap": bootstrap, "embeddings": tuple(embeddings)}
        return KvHandle(request_id, prompt, -1, 0, state)

    def release(self, kv: KvHandle) -> None:
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

    async def close(self) -> None:
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

    @contextlib.contextmanager
    def _admit(self) -> Iterator[None]:
        """Count a call against `max_queue` for as long as it runs."""
        if self._inflight >= self.max_queue:
            raise EngineOverloaded(f"sglang engine busy ({self.max_queue} requests)")
        self._inflight += 1
        try:
            yield
        finally:
            self._inflight -= 1


def finish_reason(sglang_reason: Any) -> FinishReason:
    """SGLang's `meta_info.finish_reason` (`{"type": "stop"|"length"|"abort", ...}`)."""
    kind = sglang_reason.get("type") if isinstance(sglang_reason, dict) else str(sglang_reason)
    if kind == "length":
        return "length"
    if kind == "abort":
        return "error"
    return "stop"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def _drain(stream: AsyncIterator[dict[str, Any]]) -> None:
    """Run a prefill-mode request to its end (SGLang sends the KV while it runs)."""
    async for _ in stream:
        pass
