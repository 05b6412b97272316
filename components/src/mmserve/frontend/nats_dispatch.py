"""The frontend's pipeline over NATS: discovers which workers are deployed and sends each
request to the right first hop.

| deployed                        | pattern         | first hop of a request with media |
|---------------------------------|-----------------|-----------------------------------|
| worker --encode                 | agg             | worker                            |
| encode + worker                 | E/PD            | encode                            |
| encode + decode + prefill       | E/P/D           | encode                            |
| decode + prefill [--encode]     | EP/D, P/D       | decode                            |

A request without media skips the encode worker.

Within a component the router (`--router-mode`, `mmserve.router`) picks the instance of every
hop that holds a KV cache: the aggregated worker (agg, E/PD) by the longest cached prefix of the
prompt, images included, weighed against load; in E/P/D the prefill worker the same way and the
decode worker by load alone. The chosen ids travel in `PreprocessedRequest.route`, so the encode
worker and decode address those instances. The router learns the workers' caches from their KV
events and forgets a worker as soon as discovery drops it. A direct call to an instance that is
gone (or overloaded) before it answered is routed again to another one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Sequence

import msgspec
import numpy as np
import torch

from mmserve.frontend.dispatch import Pipeline
from mmserve.models.family import resolve_model_spec
from mmserve.protocol import PreprocessedRequest, TensorHandle, TokenChunk
from mmserve.router.kv_events import (
    KV_CACHING_COMPONENTS,
    KvEventSubscriber,
    follow_discovery,
)
from mmserve.router.scheduler import NoWorkersError, Router, RouteRequest, RouterMode
from mmserve.router.settings import RouterSettings
from mmserve.router.view import RoutingMedia
from mmserve.runtime import InstanceWatcher, Runtime, Unavailable
from mmserve.transfer import TransferAgent, create_transfer_agent

log = logging.getLogger(__name__)

GENERATE = "generate"
COMPONENTS = ("encode", "worker", "decode", "prefill")


class NatsDispatcher:
    def __init__(
        self,
        runtime: Runtime,
        watchers: dict[str, InstanceWatcher],
        settings: RouterSettings | None = None,
        placeholder_id: int | None = None,
    ) -> None:
        self.runtime = runtime
        self._watchers = watchers
        self._clients = {name: runtime.client(name, GENERATE) for name in COMPONENTS}
        settings = settings if settings is not None else RouterSettings()
        self.routers: dict[str, Router] = {
            name: settings.build_router() for name in ("worker", "prefill", "decode")
        }
        self._placeholder_id = placeholder_id
        self._subscribers: dict[str, KvEventSubscriber] = {}
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def start(
        cls,
        runtime: Runtime,
        settings: RouterSettings | None = None,
        placeholder_id: int | None = None,
    ) -> NatsDispatcher:
        """Watch the deployment; in kv mode, follow the KV events of the caching workers."""
        watchers = {name: await runtime.watch(name, GENERATE) for name in COMPONENTS}
        dispatcher = cls(runtime, watchers, settings, placeholder_id)
        for name, router in dispatcher.routers.items():
            if router.mode is RouterMode.KV and name in KV_CACHING_COMPONENTS:
                subscriber = await KvEventSubscriber(runtime, router.indexer, name).start()
                subscriber.catch_up(watchers[name].instance_ids())
                dispatcher._subscribers[name] = subscriber
            forget = functools.partial(dispatcher._forget, name)
            dispatcher._tasks.append(
                asyncio.create_task(
                    follow_discovery(watchers[name], forget), name=f"mmserve-follow-{name}"
                )
            )
        return dispatcher

    def _forget(self, component: str, instance_id: str) -> None:
        """Discovery dropped an instance: no request goes there, its blocks leave the index."""
        router = self.routers[component]
        blocks = router.indexer.num_blocks(instance_id)
        subscriber = self._subscribers.get(component)
        if subscriber is not None:
            subscriber.on_instance_removed(instance_id)
        router.remove_worker(instance_id)
        log.info(
            "%s %s left: %d cached blocks dropped from the index", component, instance_id, blocks
        )

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for subscriber in self._subscribers.values():
            await subscriber.stop()

    def _has(self, component: str) -> bool:
        return bool(self._watchers[component].instances())

    def _language_hop(self) -> str | None:
        """Where an encoded (or text-only) request goes."""
        if self._has("decode") and self._has("prefill"):
            return "decode"
        if self._has("worker"):
            return "worker"
        return None

    def first_hop(self, has_media: bool) -> str | None:
        language_hop = self._language_hop()
        if language_hop is None:
            return None
        if has_media and self._has("encode"):
            return "encode"
        return language_hop

    def ready(self) -> bool:
        return self._language_hop() is not None

    def route_request(self, request: PreprocessedRequest) -> RouteRequest:
        """The routing view of a request as the frontend has it (one placeholder per item)."""
        media = [RoutingMedia(item.mm_hash, item.token_count) for item in request.media]
        return self.routers["worker"].request_for(
            request.request_id,
            request.token_ids,
            media,
            placeholder_id=self._placeholder_id,
            lora_name=request.lora_name,
        )

    def route(
        self, request: PreprocessedRequest, language_hop: str, exclude: Sequence[str] = ()
    ) -> dict[str, str]:
        """Pick the instances of the hops that hold the KV cache; each router books the
        request until `_release`."""
        components = ("worker",) if language_hop == "worker" else ("prefill", "decode")
        by_prompt = self.route_request(request)
        route: dict[str, str] = {}
        try:
            for component in components:
                workers = sorted(self._watchers[component].instance_ids() - set(exclude))
                routed = by_prompt
                if component == "decode":  # by load: the KV comes from the prefill worker
                    routed = RouteRequest(request.request_id, num_blocks=by_prompt.num_blocks)
                decision = self.routers[component].select(routed, workers)
                route[component] = decision.worker_id
                log.debug(
                    "request %s -> %s %s (%d/%d blocks cached)",
                    request.request_id,
                    component,
                    decision.worker_id,
                    decision.overlap_blocks,
                    decision.request_blocks,
                )
        except NoWorkersError:
            self._release(request.request_id, route)
            raise Unavailable(None, f"no {' or '.join(components)} worker is available") from None
        return route

    def _release(self, request_id: str, route: dict[str, str]) -> None:
        for component in route:
            self.routers[component].on_finish(request_id)

    async def generate(self, request: PreprocessedRequest) -> AsyncIterator[TokenChunk]:
        hop = self.first_hop(bool(request.media))
        language_hop = self._language_hop()
        if hop is None or language_hop is None:
            raise Unavailable(
                None,
                "no worker is ready: the deployment needs a worker, or a decode and a prefill "
                "worker",
            )
        gone: list[str] = []  # instances that refused the request before answering
        while True:
            route = self.route(request, language_hop, gone)
            routed = msgspec.structs.replace(request, route=route)
            answered = False
            try:
                replies = self._clients[hop].stream(
                    routed,
                    TokenChunk,
                    instance_id=route.get(hop),
                    request_id=request.request_id,
                    deadline=request.deadline,
                )
                async with contextlib.aclosing(replies):
                    async for chunk in replies:
                        if not answered:
                            answered = True
                            for component in route:
                                self.routers[component].on_first_token(request.request_id)
                        yield chunk
                return
            except Unavailable:
                # Only a direct call is routed again; the encode worker falls back itself.
                if answered or hop not in route:
                    raise
                log.warning(
                    "request %s: %s instance %s unavailable; routing again",
                    request.request_id,
                    hop,
                    route[hop],
                )
                gone.append(route[hop])
            finally:
                self._release(request.request_id, route)


class TransferTensorSink:
    """Offers a request's arrays by transfer (pixel_values with frontend decoding, else the
    encoded bytes of inline images); the encoder reads them. Each lease gives its buffer back
    once read (or when it times out)."""

    def __init__(self, transfer: TransferAgent) -> None:
        self.transfer = transfer

    async def __call__(self, request_id: str, array: np.ndarray) -> TensorHandle:
        handle, _lease = await self.transfer.offer(torch.from_numpy(array))
        return handle


@contextlib.asynccontextmanager
async def open_nats_pipeline(args: argparse.Namespace) -> AsyncIterator[Pipeline]:
    """The deployment of `--namespace` on NATS, with a transfer agent for the arrays the
    frontend ships to the encoders."""
    async with contextlib.AsyncExitStack() as stack:
        settings = RouterSettings.from_args(args)
        spec = await asyncio.to_thread(resolve_model_spec, _model_path(args))
        runtime = await Runtime.connect(namespace=args.namespace)
        stack.push_async_callback(runtime.shutdown)
        transfer = create_transfer_agent(args)
        stack.push_async_callback(transfer.close)
        dispatcher = await NatsDispatcher.start(runtime, settings, spec.image_token_id)
        stack.push_async_callback(dispatcher.stop)
        yield Pipeline(dispatcher, TransferTensorSink(transfer))


def _model_path(args: argparse.Namespace) -> str:
    if args.model_path:
        return str(args.model_path)
    from mmserve.models.tiny import default_model_path

    return str(default_model_path())
