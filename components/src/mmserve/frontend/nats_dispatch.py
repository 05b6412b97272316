"""The frontend's pipeline over NATS: discovers which workers are deployed, routes each request
and sends it to its first hop (`topology.next_hop`): an encode worker when there is one and an
item is left to encode once the items the routed worker's prefix cache holds are skipped
(`protocol.ItemState`), else the language hop.

Within a role the router (`--router-mode`, `mmserve.router`) picks the instance of every hop
that holds a KV cache: the aggregated worker (agg, E/PD) by the longest cached prefix of the
prompt, images included (and, where it encodes, the embeddings its encoder cache holds), weighed
against load; in E/P/D the prefill worker the same way and the
decode worker by load alone. The encode worker is picked by `--encode-router-mode`
(`router.encode_scheduler`): by the image tokens its encoder cache already holds, weighed
against the encode work sent to it. The chosen ids travel in `PreprocessedRequest.route`, so
the encode worker and decode address those instances. The routers learn the workers' caches
from their KV and embedding-cache events and forget a worker as soon as discovery drops it. A
call to an instance that is gone (or overloaded) before it answered is routed again to another
one (`runtime.retry`).

A request whose instance is lost mid-stream migrates to another (`frontend.migration`,
`--migration-limit`): it is routed again among the instances left, with its media offered again
(`TransferTensorSink` keeps what it offered for the request's life).

`reset_prefix_cache` calls `<role>.reset_prefix_cache` on every instance discovery knows, one
call each, so every instance answers for itself.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Collection, Sequence
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from mmserve import protocol
from mmserve.frontend.dispatch import Pipeline
from mmserve.frontend.migration import DEFAULT_MIGRATION_LIMIT, Migrator
from mmserve.kv.view import items_in_cached_prefix
from mmserve.observability import metrics, nvtx
from mmserve.protocol import (
    CachesCleared,
    EmbeddingsHandle,
    ItemState,
    PreprocessedRequest,
    ResetCachesRequest,
    TensorHandle,
    TokenChunk,
)
from mmserve.router.encode_scheduler import EncodeRouter, EncodeRouterMode, encode_items
from mmserve.router.encoder_index import EncoderEventSubscriber
from mmserve.router.kv_events import KvEventSubscriber, follow_discovery
from mmserve.router.scheduler import NoWorkersError, Router, RouteRequest, RouterMode
from mmserve.router.settings import RouterSettings
from mmserve.runtime import InstanceWatcher, RemoteError, Runtime, Unavailable
from mmserve.runtime.retry import stream_with_retry
from mmserve.topology import (
    GENERATE,
    KV_CACHING_ROLES,
    RESET_PREFIX_CACHE,
    Role,
    kv_roles,
    language_hop,
    missing_language_hop_message,
    next_hop,
)
from mmserve.transfer import TransferAgent, create_transfer_agent

log = logging.getLogger(__name__)

RESET_TIMEOUT_S = 30.0
"""How long each instance has to clear its caches (an hf engine first finishes the model call
it is running)."""

ROLES_MEMORY = 1024
"""Instances routed to or gone lately whose role the dispatcher names (a migration's metric and
log: by the time a call fails for a lost instance, discovery may have dropped it)."""


class NatsDispatcher:
    def __init__(
        self,
        runtime: Runtime,
        watchers: dict[Role, InstanceWatcher],
        settings: RouterSettings | None = None,
        *,
        media: TransferTensorSink | None = None,
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
    ) -> None:
        self.runtime = runtime
        self._watchers = watchers
        self._media = media
        self._roles: collections.OrderedDict[str, Role] = collections.OrderedDict()
        self.migrator = Migrator(self._attempt, self._offered_again, self.role_of, migration_limit)
        self._clients = {role: runtime.client(role.value, GENERATE) for role in Role}
        self._reset_clients = {
            role: runtime.client(role.value, RESET_PREFIX_CACHE) for role in Role
        }
        settings = settings if settings is not None else RouterSettings()
        self.routers: dict[Role, Router] = {
            role: settings.build_router() for role in (Role.WORKER, Role.PREFILL, Role.DECODE)
        }
        self.encode_router = settings.build_encode_router()
        self.skip_cached_encode = settings.skip_cached_encode
        self._subscribers: dict[Role, KvEventSubscriber] = {}
        self._encoder_subscriber: EncoderEventSubscriber | None = None
        # Per KV-caching role, the embedding-cache events of its instances that encode.
        self._worker_encoder_subscribers: dict[Role, EncoderEventSubscriber] = {}
        self._tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def start(
        cls,
        runtime: Runtime,
        settings: RouterSettings | None = None,
        *,
        media: TransferTensorSink | None = None,
        migration_limit: int = DEFAULT_MIGRATION_LIMIT,
    ) -> NatsDispatcher:
        """Watch the deployment; in kv mode, follow the KV events of the caching workers."""
        watchers = {role: await runtime.watch(role.value, GENERATE) for role in Role}
        dispatcher = cls(runtime, watchers, settings, media=media, migration_limit=migration_limit)
        for role, router in dispatcher.routers.items():
            if router.mode is RouterMode.KV and role in KV_CACHING_ROLES:
                subscriber = await KvEventSubscriber(runtime, router.indexer, role.value).start()
                subscriber.catch_up(watchers[role].instance_ids())
                dispatcher._subscribers[role] = subscriber
                # Not caught up: an instance that does not encode would never answer a dump;
                # one that does is followed from its next event.
                encoders = EncoderEventSubscriber(runtime, router.encoder_index, role.value)
                dispatcher._worker_encoder_subscribers[role] = await encoders.start()
        if dispatcher.encode_router.mode.follows_caches:
            encoders = EncoderEventSubscriber(
                runtime, dispatcher.encode_router.index, Role.ENCODE.value
            )
            dispatcher._encoder_subscriber = await encoders.start()
            encoders.catch_up(watchers[Role.ENCODE].instance_ids())
        for role in Role:
            forget = functools.partial(dispatcher._forget, role)
            dispatcher._tasks.append(
                asyncio.create_task(
                    follow_discovery(watchers[role], forget), name=f"mmserve-follow-{role}"
                )
            )
        return dispatcher

    def _forget(self, role: Role, instance_id: str) -> None:
        """Discovery dropped an instance: no request goes there, its blocks (or embeddings)
        leave the index."""
        self._remember(instance_id, role)
        if role is Role.ENCODE:
            entries = self.encode_router.index.num_entries(instance_id)
            if self._encoder_subscriber is not None:
                self._encoder_subscriber.on_instance_removed(instance_id)
            self.encode_router.remove_worker(instance_id)
            metrics.forget_encoder(instance_id)
            log.info(
                "encode %s left: %d cached embeddings dropped from the index", instance_id, entries
            )
            return
        router = self.routers[role]
        blocks = router.indexer.num_blocks(instance_id)
        subscriber = self._subscribers.get(role)
        if subscriber is not None:
            subscriber.on_instance_removed(instance_id)
        encoders = self._worker_encoder_subscribers.get(role)
        if encoders is not None:
            encoders.on_instance_removed(instance_id)
        router.remove_worker(instance_id)
        log.info("%s %s left: %d cached blocks dropped from the index", role, instance_id, blocks)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for subscriber in self._subscribers.values():
            await subscriber.stop()
        for encoders in self._worker_encoder_subscribers.values():
            await encoders.stop()
        if self._encoder_subscriber is not None:
            await self._encoder_subscriber.stop()

    def _deployed(self, role: Role) -> bool:
        return bool(self._watchers[role].instances())

    def _remember(self, instance_id: str, role: Role) -> None:
        self._roles[instance_id] = role
        self._roles.move_to_end(instance_id)
        while len(self._roles) > ROLES_MEMORY:
            self._roles.popitem(last=False)

    def role_of(self, instance_id: str) -> str:
        """The role of an instance routed to or gone lately, or that discovery lists
        ("unknown" otherwise)."""
        role = self._roles.get(instance_id)
        if role is not None:
            return role.value
        for role, watcher in self._watchers.items():
            if instance_id in watcher.instance_ids():
                return role.value
        return "unknown"

    def ready(self) -> bool:
        return language_hop(self._deployed) is not None

    async def reset_prefix_cache(self, timeout: float = RESET_TIMEOUT_S) -> int:
        """Every known instance clears its caches; raises `cache_reset_failed` naming the
        instances that did not (their error, or the timeout), after all have answered."""
        targets = [
            (role, instance_id)
            for role in Role
            for instance_id in sorted(self._watchers[role].instance_ids())
        ]
        if not targets:
            raise Unavailable(None, "no instance is deployed: there is no cache to clear")
        results = await asyncio.gather(
            *(
                self._reset_clients[role].call(
                    ResetCachesRequest(), CachesCleared, instance_id=instance_id, timeout=timeout
                )
                for role, instance_id in targets
            ),
            return_exceptions=True,
        )
        failures = []
        for (role, instance_id), result in zip(targets, results, strict=True):
            if isinstance(result, CachesCleared):
                log.info(
                    "%s %s cleared %d prefix blocks, %d encoder entries",
                    role,
                    instance_id,
                    result.prefix_blocks,
                    result.encoder_items,
                )
            elif isinstance(result, RemoteError):
                failures.append(f"{role} {instance_id}: [{result.code}] {result.message}")
            elif isinstance(result, Exception):
                failures.append(f"{role} {instance_id}: {type(result).__name__}: {result}")
            else:  # CancelledError and the like: not a failure of the instance
                raise result
        if failures:
            raise RemoteError(
                protocol.ERROR_CACHE_RESET_FAILED,
                f"{len(failures)} of {len(targets)} instances did not clear their caches: "
                + "; ".join(failures),
            )
        return len(targets)

    def route(
        self,
        request: PreprocessedRequest,
        language: Role,
        exclude: Sequence[str] = (),
        *,
        skip: Collection[int] | None = None,
    ) -> PreprocessedRequest:
        """The request with its route: the instances of the hops that hold the KV cache, each
        router booking the request until `_release`. The items whose every token the
        prefilling instance holds, as its router's index says, are marked skipped
        (`PreprocessedRequest.skipping`; `skip` names them instead)."""
        roles = kv_roles(language)
        by_prompt = self.routers[Role.WORKER].request_for(
            request.request_id, request.plan, lora_name=request.lora_name
        )
        route: dict[str, str] = {}
        covered: Collection[int] = () if skip is None else skip
        try:
            for role in roles:
                workers = sorted(self._watchers[role].instance_ids() - set(exclude))
                routed = by_prompt
                if role is Role.DECODE:  # by load: the KV comes from the prefill worker
                    routed = RouteRequest(request.request_id, num_blocks=by_prompt.num_blocks)
                decision = self.routers[role].select(routed, workers)
                route[role.value] = decision.worker_id
                self._remember(decision.worker_id, role)
                if role is not Role.DECODE and self.skip_cached_encode and skip is None:
                    covered = self._cached_items(request, decision.overlap_blocks, role)
                log.debug(
                    "request %s -> %s %s (%d/%d blocks cached)",
                    request.request_id,
                    role,
                    decision.worker_id,
                    decision.overlap_blocks,
                    decision.request_blocks,
                )
        except NoWorkersError:
            self._release(request.request_id, route)
            names = " or ".join(role.value for role in roles)
            raise Unavailable(None, f"no {names} worker is available") from None
        return msgspec.structs.replace(request.skipping(covered), route=route)

    def _cached_items(
        self, request: PreprocessedRequest, cached_blocks: int, role: Role
    ) -> list[int]:
        """The items whose every token lies in the `cached_blocks` the chosen `role` instance
        holds."""
        plan = request.plan
        block_size = self.routers[role].block_size
        return items_in_cached_prefix(len(plan.token_ids), plan.media, cached_blocks, block_size)

    def _with_encoder(
        self, request: PreprocessedRequest, exclude: Sequence[str]
    ) -> PreprocessedRequest:
        """The routed `request` with the encode worker it goes through, and in peer-pull mode
        the peers it may pull from; on failure its route is released."""
        workers = sorted(self._watchers[Role.ENCODE].instance_ids() - set(exclude))
        try:
            decision = self.encode_router.select(request.request_id, encode_items(request), workers)
        except NoWorkersError:
            self._release(request.request_id, request.route)
            raise Unavailable(None, "no encode worker is available") from None
        routed = metrics.ENCODE_ROUTED_TOKENS
        routed.labels(decision.worker_id, "held").inc(decision.held_tokens)
        routed.labels(decision.worker_id, "new").inc(decision.request_tokens - decision.held_tokens)
        log.debug(
            "request %s -> encode %s (%d/%d image tokens cached)",
            request.request_id,
            decision.worker_id,
            decision.held_tokens,
            decision.request_tokens,
        )
        self._remember(decision.worker_id, Role.ENCODE)
        route = request.route | {Role.ENCODE.value: decision.worker_id}
        peers = self._encode_peers(request, decision.worker_id, workers)
        return msgspec.structs.replace(request, route=route, peers=peers)

    def _encode_peers(
        self, request: PreprocessedRequest, chosen: str, workers: Sequence[str]
    ) -> dict[int, str]:
        """In peer-pull mode, per media item the `chosen` encoder lacks, a peer encoder holding
        it (`PreprocessedRequest.peers`)."""
        if self.encode_router.mode is not EncodeRouterMode.PEER_PULL:
            return {}
        indices = request.items_to_encode()
        items = encode_items(request)
        holders = self.encode_router.peer_holders(request.request_id, items, chosen, workers)
        return {
            index: holders[key]
            for index, (key, _) in zip(indices, items, strict=True)
            if key in holders
        }

    def _router(self, component: str) -> Router | EncodeRouter:
        role = Role(component)
        return self.encode_router if role is Role.ENCODE else self.routers[role]

    def _release(self, request_id: str, route: dict[str, str]) -> None:
        for component in route:
            self._router(component).on_finish(request_id)

    async def generate(self, request: PreprocessedRequest) -> AsyncGenerator[TokenChunk, None]:
        """The request's chunks, migrated to other instances when one is lost mid-stream."""
        try:
            async with contextlib.aclosing(self.migrator.generate(request)) as chunks:
                async for chunk in chunks:
                    yield chunk
        finally:
            if self._media is not None:
                self._media.forget(request.request_id)

    async def _offered_again(
        self, request: PreprocessedRequest, client_request_id: str
    ) -> PreprocessedRequest:
        if self._media is None:
            return request
        return await self._media.offer_again(request, client_request_id)

    async def _attempt(
        self, request: PreprocessedRequest, lost: Sequence[str]
    ) -> AsyncGenerator[TokenChunk, None]:
        """Route the request among the instances not `lost`, then send it to its first hop:
        an encode worker while an item is left to encode once the items the routed language
        worker's prefix cache holds are skipped, else straight to the language hop. A retry
        after an instance refused routes again; on to the language hop, it keeps the first
        routing's skipped items (a worker whose cache lacks one encodes it after all,
        `roles.base`)."""
        language = language_hop(self._deployed)
        if language is None:
            raise Unavailable(None, missing_language_hop_message())
        with nvtx.nvtx_range(nvtx.FE_ROUTE):
            first = self.route(request, language, lost)
        route = first.route
        hop = next_hop(self._deployed, needs_encode=bool(first.items_to_encode()))
        if hop is None:
            self._release(request.request_id, route)
            raise Unavailable(None, missing_language_hop_message())
        skipped = None if hop is Role.ENCODE else first.items(ItemState.SKIPPED)

        def attempt(gone: Sequence[str]) -> tuple[PreprocessedRequest, str | None]:
            nonlocal route
            routed = first
            if gone:
                self._release(request.request_id, route)
                route = {}  # released: a failed routing below must not release it twice
                with nvtx.nvtx_range(nvtx.FE_ROUTE):
                    routed = self.route(request, language, [*lost, *gone], skip=skipped)
                route = routed.route
            if hop is Role.ENCODE:
                route = {}  # `_with_encoder` releases the route when it fails
                routed = self._with_encoder(routed, [*lost, *gone])
                route = routed.route
            return routed, route.get(hop.value)

        replies: AsyncGenerator[TokenChunk, None] = stream_with_retry(
            self._clients[hop],
            TokenChunk,
            attempt,
            request_id=request.request_id,
            deadline=request.deadline,
        )
        answered = False
        try:
            async with contextlib.aclosing(replies):
                async for chunk in replies:
                    if not answered:
                        answered = True
                        for component in route:
                            self._router(component).on_first_token(request.request_id)
                    yield chunk
        finally:
            self._release(request.request_id, route)


@dataclass
class _Kept:
    expires: float  # time.monotonic()
    tensors: dict[TensorHandle, torch.Tensor]


class TransferTensorSink:
    """Offers a request's arrays by transfer (pixel_values with frontend decoding, else the
    encoded bytes of inline images; precomputed embeddings); the next hop reads them. Each
    lease gives its buffer back once read (or when it times out). The arrays are kept until
    the request ends (`forget`; at the latest `keep_s` after the offer, a request's deadline),
    so that a request migrated to other instances can offer them again (`offer_again`)."""

    def __init__(self, transfer: TransferAgent, keep_s: float) -> None:
        self.transfer = transfer
        self.keep_s = keep_s
        self._kept: collections.OrderedDict[str, _Kept] = collections.OrderedDict()

    async def __call__(self, request_id: str, array: np.ndarray | torch.Tensor) -> TensorHandle:
        tensor = torch.from_numpy(array) if isinstance(array, np.ndarray) else array
        handle, _lease = await self.transfer.offer(tensor)
        self._expire()
        kept = self._kept.get(request_id)
        if kept is None:
            kept = self._kept[request_id] = _Kept(time.monotonic() + self.keep_s, {})
        kept.tensors[handle] = tensor
        return handle

    def forget(self, request_id: str) -> None:
        self._kept.pop(request_id, None)

    def _expire(self) -> None:
        """Drop what requests that never reached the pipeline (refused, or their client gone
        before) left here."""
        now = time.monotonic()
        while self._kept and next(iter(self._kept.values())).expires <= now:
            self._kept.popitem(last=False)

    async def offer_again(
        self, request: PreprocessedRequest, client_request_id: str
    ) -> PreprocessedRequest:
        """`request` with each array this sink offered for client request
        `client_request_id` offered again."""
        kept = self._kept.get(client_request_id)
        if kept is None:
            return request
        tensors = kept.tensors

        async def again(handle: TensorHandle | None) -> TensorHandle | None:
            if handle is None or handle not in tensors:
                return handle
            offered, _lease = await self.transfer.offer(tensors[handle])
            return offered

        payloads = []
        for payload in request.payloads:
            embeddings = payload.embeddings
            if embeddings is not None:
                aux = {name: await again(handle) for name, handle in embeddings.aux.items()}
                embeddings = EmbeddingsHandle(
                    embeddings=await again(embeddings.embeddings) or embeddings.embeddings,
                    aux={name: handle for name, handle in aux.items() if handle is not None},
                )
            payloads.append(
                msgspec.structs.replace(
                    payload,
                    encoded=await again(payload.encoded),
                    pixel_values=await again(payload.pixel_values),
                    embeddings=embeddings,
                )
            )
        return msgspec.structs.replace(request, payloads=payloads)


@contextlib.asynccontextmanager
async def open_nats_pipeline(args: argparse.Namespace) -> AsyncIterator[Pipeline]:
    """The deployment of `--namespace` on NATS, with a transfer agent for the arrays the
    frontend ships to the encoders."""
    async with contextlib.AsyncExitStack() as stack:
        settings = RouterSettings.from_args(args)
        runtime = await Runtime.connect(namespace=args.namespace)
        stack.push_async_callback(runtime.shutdown)
        transfer = create_transfer_agent(args)
        stack.push_async_callback(transfer.close)
        media = TransferTensorSink(transfer, keep_s=args.request_timeout)
        dispatcher = await NatsDispatcher.start(
            runtime, settings, media=media, migration_limit=args.migration_limit
        )
        stack.push_async_callback(dispatcher.stop)
        yield Pipeline(dispatcher, media)
