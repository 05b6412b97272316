"""`python -m mmserve.dynamo`: mmserve's workers served as endpoints of a Dynamo deployment through
`ai-dynamo-runtime`. By default the aggregated worker (encode, prefill and decode in one process);
or, for E/PD, an encode worker (`--disaggregation-mode encode`) that the workers started with
`--route-to-encoder` call for their images; or, for P/D (E/P/D with `--route-to-encoder`), a prefill
worker and a decode worker (`--disaggregation-mode prefill|decode`) that Dynamo's prefill router
calls in turn, the KV handed over by mmserve's transfer.

The aggregated and decode workers register the model for Dynamo's discovery with a card that
asks Dynamo's frontend for token ids (`ModelInput.Tokens`, chat and completions), so `python -m
dynamo.frontend` routes requests to them, and serve `generate` until SIGINT/SIGTERM. The encode
and prefill workers register cards without an OpenAI surface (`WorkerType.Encode`,
`WorkerType.Prefill`), as Dynamo's own do, so the frontend's readiness gate and prefill router
count them; each card `needs` the workers it serves or calls. The cards of the workers that
answer chat also name the model's tool-call and reasoning formats (`--dyn-tool-call-parser`,
`--dyn-reasoning-parser`, Dynamo's flags): Dynamo's frontend renders tools into the prompt and
reads calls and reasoning out of the text itself, with its own parsers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmserve.media.policy import MediaPolicy
from mmserve.models.tokenizer import shared_tokenizer
from mmserve.reasoning import ReasoningTokens, reasoning_format
from mmserve.topology import GENERATE, Role
from mmserve.worker.options import add_worker_arguments

if TYPE_CHECKING:
    from mmserve.engines.base import Engine
    from mmserve.transfer import TransferAgent

log = logging.getLogger("mmserve.dynamo")

# After the drain's timeout: how long the cut streams have to send their error.
CUT_GRACE_S = 1.0
DEFAULT_MAX_TOKENS = 1024  # mmserve's frontend's default, for a request that gives none
# Dynamo's names of the disaggregation modes, and the role each serves.
AGGREGATED = "agg"
MODES = {
    AGGREGATED: Role.WORKER,
    "encode": Role.ENCODE,
    "prefill": Role.PREFILL,
    "decode": Role.DECODE,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m mmserve.dynamo",
        description="mmserve's aggregated worker as a Dynamo backend (ai-dynamo-runtime)",
    )
    dynamo = parser.add_argument_group("Dynamo")
    dynamo.add_argument(
        "--endpoint",
        default=None,
        help="Dynamo endpoint to serve, dyn://namespace.component.endpoint "
        f"(default: dyn://<--namespace>.{Role.WORKER.value}.{GENERATE})",
    )
    dynamo.add_argument(
        "--served-model-name", help="model name clients send (default: the dir's name)"
    )
    dynamo.add_argument(
        "--discovery-backend",
        choices=["etcd", "file", "mem", "kubernetes"],
        default=os.environ.get("DYN_DISCOVERY_BACKEND", "etcd"),
        help="Dynamo's discovery: etcd (ETCD_ENDPOINTS), file (a directory shared with the "
        "frontend, $DYN_FILE_KV), ... (default: $DYN_DISCOVERY_BACKEND or etcd)",
    )
    dynamo.add_argument(
        "--request-plane",
        choices=["tcp", "nats"],
        default=os.environ.get("DYN_REQUEST_PLANE", "tcp"),
        help="Dynamo's request plane; nats reads $NATS_SERVER (default: $DYN_REQUEST_PLANE or tcp)",
    )
    dynamo.add_argument(
        "--event-plane",
        choices=["nats", "zmq"],
        default=os.environ.get("DYN_EVENT_PLANE"),
        help="Dynamo's event plane (default: $DYN_EVENT_PLANE, else Dynamo's choice)",
    )
    dynamo.add_argument(
        "--disaggregation-mode",
        choices=list(MODES),
        default=AGGREGATED,
        help="agg: the aggregated worker Dynamo's frontend calls; encode: an encode worker "
        f"(dyn://<--namespace>.{Role.ENCODE.value}.{GENERATE}) for workers started with "
        "--route-to-encoder; prefill, decode: the two halves Dynamo's prefill router calls "
        "in turn, the KV handed over by --transfer (default: %(default)s)",
    )
    dynamo.add_argument(
        "--route-to-encoder",
        action="store_true",
        help="have the images of each request planned and encoded by an encode worker "
        "(--disaggregation-mode encode) instead of in this process",
    )
    dynamo.add_argument(
        "--dyn-tool-call-parser",
        default=None,
        help="the parser Dynamo's frontend reads the model's tool calls with (Dynamo's names: "
        "hermes for Qwen2.5-VL and Qwen3-VL, qwen3_coder for Qwen3.5, ...) (default: none, as "
        "Dynamo's own workers: calls stay in the text)",
    )
    dynamo.add_argument(
        "--dyn-reasoning-parser",
        default=None,
        help="the parser Dynamo's frontend splits the reasoning off with (Dynamo's names: "
        "qwen3, deepseek_r1, ...); with qwen3 or deepseek_r1 a grammar Dynamo sends starts "
        "after the reasoning when the prompt opens it (default: none)",
    )
    dynamo.add_argument(
        "--default-max-tokens",
        type=int,
        default=DEFAULT_MAX_TOKENS,
        help="completion length for a request that sets no max_tokens (default: %(default)s)",
    )
    MediaPolicy.add_cli_args(parser)
    add_worker_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    from mmserve.observability.logging import configure_logging
    from mmserve.runtime import run_component

    args = build_parser().parse_args(argv)
    args.role = MODES[args.disaggregation_mode]
    if args.route_to_encoder and args.role in (Role.ENCODE, Role.DECODE):
        print(
            "mmserve.dynamo: cannot start: --route-to-encoder is for agg and prefill workers, "
            f"not --disaggregation-mode {args.disaggregation_mode}",
            file=sys.stderr,
        )
        return 2
    if args.transfer is None and args.role is Role.WORKER and not args.route_to_encoder:
        # Images reach this process as bytes and never leave it: no transfer backend is needed.
        args.transfer = "inline"
    if args.engine == "sglang":
        print(
            "mmserve.dynamo: cannot start: --engine sglang is not served here yet; use "
            "Dynamo's own SGLang backend (python -m dynamo.sglang)",
            file=sys.stderr,
        )
        return 2
    configure_logging()
    return run_component("mmserve.dynamo", _serve(args))


async def _serve(args: argparse.Namespace) -> int:
    from dynamo.llm import ModelInput, register_model
    from dynamo.runtime import DistributedRuntime

    from mmserve.dynamo.handler import dynamo_endpoint, ended_when_cut
    from mmserve.observability.metrics import serve_metrics
    from mmserve.transfer import create_transfer_agent
    from mmserve.worker.options import load_engine, resolve_model_path

    model_path = resolve_model_path(args)
    engine = await load_engine(args, model_path)
    transfer = create_transfer_agent(args)
    try:
        loop = asyncio.get_running_loop()
        runtime = DistributedRuntime(
            loop, args.discovery_backend, args.request_plane, event_plane=args.event_plane
        )
        path = args.endpoint or f"{args.namespace}.{args.role.value}.{GENERATE}"
        endpoint = runtime.endpoint(path)
        name = args.served_model_name or model_path.name
        serve_metrics(args.metrics_port)
        generate, model_type, card = await _role_endpoint(
            args, runtime, endpoint, engine, transfer, model_path, name
        )
        cut = asyncio.Event()
        serving = asyncio.ensure_future(
            endpoint.serve_endpoint(
                ended_when_cut(dynamo_endpoint(generate), cut), graceful_shutdown=True
            )
        )
        stopping = asyncio.Event()

        def on_signal() -> None:
            if stopping.is_set():  # a second signal: stop at once
                serving.cancel()
                return
            stopping.set()
            log.info("stopping: leaving discovery, draining for up to %g s", args.drain_timeout)
            runtime.shutdown()  # Dynamo's: deregister, take no new request, finish the rest

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        await register_model(ModelInput.Tokens, model_type, endpoint, str(model_path), name, **card)
        log.info(
            "%s ready: instance %x, model %s, endpoint %s",
            args.role.value,
            endpoint.connection_id(),
            name,
            path,
        )
        await _serve_until_drained(serving, stopping, cut, args.drain_timeout)
        log.info("%s shutting down", args.role.value)
    finally:
        await engine.close()
        await transfer.close()
    return 0


async def _role_endpoint(
    args: argparse.Namespace,
    runtime: Any,
    endpoint: Any,
    engine: Engine,
    transfer: TransferAgent,
    model_path: Path,
    name: str,
) -> tuple[Any, Any, dict[str, Any]]:
    """The role's core behind its Dynamo adapter: the endpoint's handler, the model type and
    the card its registration carries."""
    from dynamo.llm import KvEventPublisher, ModelType, WorkerType

    from mmserve.dynamo.handler import ADAPTERS, Translator
    from mmserve.dynamo.images import Images, LocalImages, RemoteImages
    from mmserve.dynamo.kv_events import DynamoKvEvents
    from mmserve.encode.stage import EncodeStage
    from mmserve.kv.pad import PadScheme
    from mmserve.roles import build_core

    role: Role = args.role
    instance_id = f"{endpoint.connection_id():x}"
    card: dict[str, Any] = {"kv_cache_block_size": args.block_size}
    chat_card = {**card, "runtime_config": _parsers(args)}
    reasoning = await asyncio.to_thread(_reasoning_tags, args.dyn_reasoning_parser, model_path)
    if role is Role.DECODE:
        # It plans and encodes nothing: the prompt comes as the prefill worker's KV.
        core = build_core(role, engine, transfer, None, instance_id=instance_id)
        card = chat_card | {"worker_type": WorkerType.Decode, "needs": [[WorkerType.Prefill]]}
        translator = Translator(name, args.default_max_tokens, reasoning=reasoning)
        generate = ADAPTERS[role](core, translator).generate
        return generate, ModelType.Chat | ModelType.Completions, card
    stage = EncodeStage(engine, transfer, model_path, role.value)
    core = build_core(role, engine, transfer, stage, instance_id=instance_id)
    local = LocalImages(stage.spec, MediaPolicy.from_args(args), name)
    if role is Role.ENCODE:
        # It serves the workers that run prompts: aggregated ones or prefill ones.
        card = {
            "worker_type": WorkerType.Encode,
            "needs": [[WorkerType.Aggregated], [WorkerType.Prefill]],
        }
        generate = ADAPTERS[role](core, Translator(name, args.default_max_tokens, local)).generate
        return generate, ModelType.Empty, card
    kv_events = DynamoKvEvents(
        KvEventPublisher(endpoint, kv_block_size=args.block_size),
        args.block_size,
        PadScheme(args.pad_scheme),
    )
    engine.subscribe_kv_events(kv_events.sink)
    images: Images = local
    encoders = []
    if args.route_to_encoder:
        encoder = runtime.endpoint(f"{args.namespace}.{Role.ENCODE.value}.{GENERATE}")
        images = RemoteImages(await encoder.client(), local)
        encoders = [WorkerType.Encode]
    translator = Translator(name, args.default_max_tokens, images, kv_events, reasoning)
    generate = ADAPTERS[role](core, translator).generate
    if role is Role.PREFILL:
        # Dynamo's marker of a prefill worker's card, as its SGLang prefill sets.
        card |= {"worker_type": WorkerType.Prefill, "needs": [[WorkerType.Decode, *encoders]]}
        return generate, ModelType.Prefill, card
    card = chat_card | {
        "worker_type": WorkerType.Aggregated,
        "needs": [encoders] if encoders else None,
    }
    return generate, ModelType.Chat | ModelType.Completions, card


def _reasoning_tags(parser: str | None, model_path: Path) -> ReasoningTokens | None:
    """The reasoning tags of the model under Dynamo's reasoning parser, when it is one mmserve
    knows (qwen3, deepseek_r1): a grammar Dynamo sends (tool_choice required or named,
    response_format) then starts after the reasoning, so the JSON is in the answer Dynamo's
    parser reads, not in its reasoning."""
    if parser is None or reasoning_format(parser) is None:
        return None
    return ReasoningTokens.of(parser, shared_tokenizer(model_path))


def _parsers(args: argparse.Namespace) -> Any:
    """The runtime config naming the model's tool-call and reasoning parsers for Dynamo's
    frontend."""
    from dynamo.llm import ModelRuntimeConfig

    config = ModelRuntimeConfig()
    config.tool_call_parser = args.dyn_tool_call_parser
    config.reasoning_parser = args.dyn_reasoning_parser
    return config


async def _serve_until_drained(
    serving: asyncio.Future[Any], stopping: asyncio.Event, cut: asyncio.Event, drain_timeout: float
) -> None:
    """Serve until Dynamo's graceful shutdown has finished the requests in flight, or for
    `drain_timeout` seconds after the first signal: then `cut` ends what is left with an error
    at its next token, and what is still running a second later is cancelled."""
    stopped = asyncio.ensure_future(stopping.wait())
    await asyncio.wait([serving, stopped], return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not serving.done():
        await asyncio.wait([serving], timeout=drain_timeout)
    if not serving.done():
        log.warning("drain timeout (%g s) reached: ending what is in flight", drain_timeout)
        cut.set()
        await asyncio.wait([serving], timeout=CUT_GRACE_S)
    if not serving.done():
        serving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await serving
