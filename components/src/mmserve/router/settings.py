"""The router's command-line options, for the components that route (the frontend)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from mmserve.kv.hashing import DEFAULT_BLOCK_SIZE, add_block_size_argument
from mmserve.kv.pad import PadScheme, add_pad_scheme_argument
from mmserve.router.encode_scheduler import EncodeRouter, EncodeRouterMode
from mmserve.router.scheduler import KvCostConfig, Router, RouterMode


@dataclass(frozen=True, slots=True)
class RouterSettings:
    mode: RouterMode = RouterMode.KV
    block_size: int = DEFAULT_BLOCK_SIZE  # must equal the workers' KV block size
    pad_scheme: PadScheme = PadScheme.DYNAMO  # must equal the engines' scheme
    cost: KvCostConfig = field(default_factory=KvCostConfig)
    encode_mode: EncodeRouterMode = EncodeRouterMode.EMBEDDING_CACHE
    # Leave out of encoding the items the routed worker's prefix cache holds (`ItemState.SKIPPED`),
    # and send a request left with nothing to encode straight to the language hop.
    skip_cached_encode: bool = True

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group("routing")
        group.add_argument(
            "--router-mode",
            choices=[mode.value for mode in RouterMode],
            default=RouterMode.KV.value,
            help="how a worker is picked for each request: kv (longest cached prefix, images "
            "included, weighed against load), round-robin or random (default: kv)",
        )
        group.add_argument(
            "--encode-router-mode",
            choices=[mode.value for mode in EncodeRouterMode],
            default=EncodeRouterMode.EMBEDDING_CACHE.value,
            help="how an encode worker is picked for each request with media: embedding-cache "
            "(the one whose encoder cache holds the most of its image tokens, weighed against "
            "the encode work already sent to it), peer-pull (the same, and the chosen encoder "
            "pulls the embeddings another encoder holds instead of encoding them), round-robin "
            "or random (default: embedding-cache)",
        )
        group.add_argument(
            "--skip-cached-encode",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="send a media item unencoded when the KV index says the worker the prompt is "
            "routed to holds all its tokens (the worker encodes it after all if its cache "
            "dropped them since); off for engines that read no prefix cache for media, such "
            "as sglang here (default: on)",
        )
        add_block_size_argument(group, deprecated_alias="--kv-block-size")
        add_pad_scheme_argument(group)
        group.add_argument(
            "--kv-overlap-weight",
            type=float,
            default=1.0,
            metavar="W",
            help="weight of the uncached prefill blocks against the active decode blocks in "
            "kv mode (default: 1.0)",
        )
        group.add_argument(
            "--router-queue-weight",
            type=float,
            default=0.0,
            metavar="W",
            help="cost in blocks of each request still waiting for its first token on a "
            "worker (default: 0)",
        )
        group.add_argument(
            "--router-temperature",
            type=float,
            default=0.0,
            metavar="T",
            help="softmax temperature over the normalised costs; 0 picks the cheapest (default: 0)",
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RouterSettings:
        if args.block_size <= 0:
            raise SystemExit(f"--block-size must be positive, got {args.block_size}")
        try:
            cost = KvCostConfig(
                overlap_weight=args.kv_overlap_weight,
                queue_weight=args.router_queue_weight,
                temperature=args.router_temperature,
            )
        except ValueError as exc:
            raise SystemExit(f"router options: {exc}") from exc
        return cls(
            mode=RouterMode(args.router_mode),
            block_size=args.block_size,
            pad_scheme=PadScheme(args.pad_scheme),
            cost=cost,
            encode_mode=EncodeRouterMode(args.encode_router_mode),
            skip_cached_encode=args.skip_cached_encode,
        )

    def build_router(self) -> Router:
        return Router(
            self.mode, cost=self.cost, block_size=self.block_size, pad_scheme=self.pad_scheme
        )

    def build_encode_router(self) -> EncodeRouter:
        """The encode hop's router; it shares the KV cost's queue weight and temperature."""
        cost = KvCostConfig(queue_weight=self.cost.queue_weight, temperature=self.cost.temperature)
        return EncodeRouter(self.encode_mode, cost=cost)
