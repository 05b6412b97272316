"""`mmserve frontend`: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import resource
import ssl
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from mmserve.frontend.migration import DEFAULT_MIGRATION_LIMIT
from mmserve.frontend.mm_options import (
    VideoCaps,
    parse_limit_mm_per_prompt,
    parse_media_io_kwargs,
    parse_mm_processor_kwargs,
)
from mmserve.frontend.token_cache import DEFAULT_TOKEN_CACHE_MIB
from mmserve.frontend.tool_parsers import TOOL_CALL_PARSERS
from mmserve.grammar.defaults import add_grammar_arguments
from mmserve.media.calls import DEFAULT_MAX_AUDIO_DURATION_S
from mmserve.media.policy import MediaPolicy
from mmserve.protocol.openai import DEFAULT_MAX_N
from mmserve.reasoning import REASONING_PARSER_ALIASES, REASONING_PARSERS
from mmserve.router.settings import RouterSettings
from mmserve.runtime.allocator import loaded_allocator
from mmserve.runtime.heap import freeze_startup_heap
from mmserve.runtime.lifetime import add_drain_timeout_argument, exit_without_teardown
from mmserve.transfer.options import add_transfer_arguments

if TYPE_CHECKING:
    import uvicorn

    from mmserve.frontend.app import FrontendApp
    from mmserve.frontend.chat import ServedModel
    from mmserve.frontend.dispatch import Dispatcher, Pipeline, TensorSink

log = logging.getLogger("mmserve.frontend")

# Longer than the idle expiry of clients' connection pools (httpx 5 s, aiohttp 15 s) and of
# load balancers (often 60 s), so the client side closes an idle connection first: a server
# closing it first races the next request the client sends on it (a connection error).
DEFAULT_HTTP_KEEP_ALIVE_S = 75.0
OPEN_FILES = 65536

# Connects to the pipeline for the parsed arguments; entered inside the server's event loop
# (after the model loaded) and left when the server stops.
PipelineFactory = Callable[[argparse.Namespace], contextlib.AbstractAsyncContextManager["Pipeline"]]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "frontend",
        help="OpenAI-compatible HTTP server",
        description="Serve /v1/chat/completions for a vision-language model and hand each "
        "request to the first worker of the deployed pipeline. The command re-executes itself "
        "with mimalloc preloaded in place of glibc's malloc (jemalloc when mimalloc is not "
        "installed); MMSERVE_FRONTEND_MALLOC=system|mimalloc|jemalloc|tcmalloc|PATH chooses.",
    )
    add_arguments(parser)
    parser.set_defaults(handler=_handle)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model-path",
        help="checkpoint dir of the model (default: the trained tiny Qwen2-VL, built if missing)",
    )
    parser.add_argument(
        "--served-model-name", help="model name clients send (default: the dir's name)"
    )
    parser.add_argument("--http-host", default="127.0.0.1", help="default: 127.0.0.1")
    parser.add_argument("--http-port", type=int, default=8000, help="default: 8000")
    parser.add_argument(
        "--ssl-certfile", help="serve HTTPS with this certificate (PEM; with --ssl-keyfile)"
    )
    parser.add_argument("--ssl-keyfile", help="the certificate's private key (PEM)")
    parser.add_argument(
        "--ssl-ca-certs", help="require client certificates signed by this CA (PEM)"
    )
    parser.add_argument(
        "--http-keep-alive",
        type=float,
        default=DEFAULT_HTTP_KEEP_ALIVE_S,
        metavar="SECONDS",
        help="close a client's idle keep-alive connection after this long; keep it above "
        f"the clients' own idle expiry (default: {DEFAULT_HTTP_KEEP_ALIVE_S:g})",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("MMSERVE_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1 routes (default: $MMSERVE_API_KEY; "
        "none when unset)",
    )
    parser.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log one line for every request (id, status, outcome, time); without it only "
        "requests that failed are logged",
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="deadline of a request, from arrival to the last token (default: 300)",
    )
    parser.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=64 * 1024 * 1024,
        metavar="BYTES",
        help="largest accepted request body, inline images included (default: 64 MiB)",
    )
    parser.add_argument(
        "--default-max-tokens",
        type=int,
        default=1024,
        metavar="N",
        help="completion length when the request gives no max_tokens (default: 1024)",
    )
    parser.add_argument(
        "--token-cache-mib",
        type=_non_negative_int,
        default=DEFAULT_TOKEN_CACHE_MIB,
        metavar="MIB",
        help="memory for the token ids of rendered prompts already seen, so a prompt sent "
        f"again skips the tokenizer; 0 turns it off (default: {DEFAULT_TOKEN_CACHE_MIB})",
    )
    parser.add_argument(
        "--context-length",
        type=int,
        default=None,
        metavar="N",
        help="longest prompt plus completion, in tokens; longer requests get 400 "
        "context_length_exceeded (default: the model's max_position_embeddings)",
    )
    parser.add_argument(
        "--frontend-decoding",
        action="store_true",
        help="fetch, decode and preprocess images here and ship pixel_values to the encoder",
    )
    parser.add_argument(
        "--limit-mm-per-prompt",
        type=parse_limit_mm_per_prompt,
        default={},
        metavar="LIMITS",
        help='most media items per prompt by modality, as JSON (\'{"image": 4, "video": 1, '
        '"audio": 2}\', '
        'with optional size hints \'{"image": {"count": 4, "width": 512, "height": 512}}\') '
        "or image=4,video=1,audio=2; past it a request gets 400 request.too_many_items "
        "(default: only --max-media-items)",
    )
    parser.add_argument(
        "--mm-processor-kwargs",
        type=parse_mm_processor_kwargs,
        default=None,
        metavar="JSON",
        help='pixel bounds images are resized under, \'{"min_pixels": N, "max_pixels": M}\', '
        "inside the model's preprocessor_config; requests may narrow them with "
        "mm_processor_kwargs (default: the model's); and how videos are sampled, fps or "
        "num_frames, min_frames, max_frames (default: the checkpoint's video processor "
        "config, else fps 2)",
    )
    parser.add_argument(
        "--media-io-kwargs",
        type=parse_media_io_kwargs,
        default=None,
        metavar="JSON",
        help='frames read from each video, \'{"video": {"fps": F}}\' or '
        '\'{"video": {"num_frames": N}}\' (the same as --mm-processor-kwargs\' fps and '
        "num_frames); requests may set their own with media_io_kwargs",
    )
    parser.add_argument(
        "--max-n",
        type=_positive_int,
        default=DEFAULT_MAX_N,
        metavar="N",
        help=f"the most completions one request may ask for with n (default {DEFAULT_MAX_N}); "
        "all of a request's completions run on one worker from one prefill",
    )
    parser.add_argument(
        "--enable-mm-embeds",
        action="store_true",
        help="accept image_embeds and audio_embeds parts (precomputed vision-tower or "
        "audio-tower output, safetensors or .npy only); they skip the encoder",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=(*TOOL_CALL_PARSERS, "none"),
        default=None,
        help="how tool calls are read from what the model writes under tool_choice auto: "
        "hermes (<tool_call>{json}</tool_call>: Qwen2.5, Qwen3-VL) or qwen3_coder "
        "(<tool_call><function=...>: Qwen3.5); none refuses tool_choice auto (default: the "
        "format the model's chat template writes calls in, if one of these). tool_choice "
        "required and named tools constrain decoding and need no parser",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=(*REASONING_PARSERS, *REASONING_PARSER_ALIASES),
        default=None,
        help="split a thinking model's <think>...</think> section into reasoning_content: "
        "qwen3 (Qwen3.5, Qwen3-VL-Thinking: reasoning when the prompt or the completion opens "
        "<think>) or deepseek_r1 (reasoning until </think>); with it a grammar (tool_choice "
        "required or named) applies after the reasoning (default: no split)",
    )
    parser.add_argument(
        "--namespace",
        default=os.environ.get("MMSERVE_NAMESPACE", "mmserve"),
        help="deployment namespace on NATS (default: $MMSERVE_NAMESPACE or mmserve)",
    )
    parser.add_argument(
        "--migration-limit",
        type=_non_negative_int,
        default=DEFAULT_MIGRATION_LIMIT,
        metavar="N",
        help="how often a request may move to another worker when the one serving it is lost "
        "mid-stream (crashed, silent, or stopped at its drain deadline): it goes on from the "
        "tokens the client already has, in the same words for greedy and seeded requests; 0 "
        "turns it off, the client then gets the error (default: %(default)s)",
    )
    add_drain_timeout_argument(parser, "requests in flight (/health answers 503 meanwhile)")
    add_grammar_arguments(parser, "a request whose grammar takes checking")
    MediaPolicy.add_cli_args(parser)
    VideoCaps.add_cli_args(parser)
    parser.add_argument(
        "--max-audio-duration",
        type=float,
        default=DEFAULT_MAX_AUDIO_DURATION_S,
        metavar="SECONDS",
        help="longest audio clip accepted, by its headers before it is decoded; longer gets "
        "413 audio.too_long (a clip longer than the model's chunk, 30 s for Qwen2-Audio, is "
        f"cut to it as its processor cuts it) (default: {DEFAULT_MAX_AUDIO_DURATION_S:g})",
    )
    add_transfer_arguments(parser)
    RouterSettings.add_cli_args(parser)


def load_model(args: argparse.Namespace) -> ServedModel:
    """The served model's tokenizer, chat template and media spec, from `--model-path`."""
    from mmserve.frontend.chat import ServedModel

    model_path = args.model_path
    if model_path is None:
        from mmserve.tiny.checkpoints import default_model_path

        model_path = default_model_path()
    return ServedModel.load(model_path, args.served_model_name)


def build_app(
    args: argparse.Namespace,
    model: ServedModel,
    dispatcher: Dispatcher,
    tensor_sink: TensorSink | None = None,
) -> FrontendApp:
    """The ASGI app for parsed arguments."""
    from mmserve.frontend.app import FrontendApp, HttpOptions
    from mmserve.frontend.chat import ChatOptions, ChatPreprocessor
    from mmserve.frontend.drain import Drain

    options = ChatOptions(
        policy=MediaPolicy.from_args(args),
        default_max_tokens=args.default_max_tokens,
        context_length=args.context_length,
        request_timeout_s=args.request_timeout,
        frontend_decoding=args.frontend_decoding,
        token_cache_bytes=args.token_cache_mib << 20,
        limit_mm_per_prompt=args.limit_mm_per_prompt,
        mm_processor_kwargs=args.mm_processor_kwargs,
        media_io_kwargs=args.media_io_kwargs,
        video_caps=VideoCaps.from_args(args),
        max_audio_duration_s=args.max_audio_duration,
        enable_mm_embeds=args.enable_mm_embeds,
        max_n=args.max_n,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        grammar_compile_timeout_s=args.grammar_compile_timeout,
    )
    return FrontendApp(
        ChatPreprocessor(model, options, tensor_sink),
        dispatcher,
        HttpOptions(
            api_key=args.api_key,
            max_body_bytes=args.max_request_body_bytes,
            log_requests=args.enable_log_requests,
        ),
        Drain(args.drain_timeout),
    )


def open_pipeline(args: argparse.Namespace) -> contextlib.AbstractAsyncContextManager[Pipeline]:
    """The pipeline behind the frontend, discovered over NATS."""
    from mmserve.frontend.nats_dispatch import open_nats_pipeline

    return open_nats_pipeline(args)


def server_config(args: argparse.Namespace, app: FrontendApp) -> uvicorn.Config:
    """The HTTP server's settings for parsed arguments."""
    import uvicorn

    from mmserve.frontend.http_protocol import BoundedHttpToolsProtocol

    return uvicorn.Config(
        app,
        host=args.http_host,
        port=args.http_port,
        lifespan="off",
        http=BoundedHttpToolsProtocol,
        access_log=False,
        # The app reads neither the client address nor the scheme, which uvicorn's proxy
        # headers middleware rewrites from X-Forwarded-* at a cost per request.
        proxy_headers=False,
        log_level="info",
        # After the drain (`frontend/drain.py`): the last chunks of what it cut short.
        timeout_graceful_shutdown=1,
        timeout_keep_alive=args.http_keep_alive,
        ssl_certfile=args.ssl_certfile,
        ssl_keyfile=args.ssl_keyfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=ssl.CERT_REQUIRED if args.ssl_ca_certs else ssl.CERT_NONE,
    )


def raise_open_file_limit() -> int:
    """Raise this process's soft limit of open files towards `OPEN_FILES` (each client
    connection is one; a common default soft limit is 1024) within the hard limit; returns
    the soft limit in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return soft
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return target


async def serve(
    args: argparse.Namespace,
    pipeline_factory: PipelineFactory = open_pipeline,
    *,
    exit_when_stopped: bool = False,
) -> None:
    """Serve until stopped (drained on a signal). With `exit_when_stopped` (the command), the
    process exits as soon as the pipeline is closed."""
    from mmserve.frontend.drain import DrainingServer

    open_files = raise_open_file_limit()
    model = await asyncio.to_thread(load_model, args)
    async with pipeline_factory(args) as pipeline:
        app = build_app(args, model, pipeline.dispatcher, pipeline.tensor_sink)
        server = DrainingServer(server_config(args, app), app.drain)
        frozen = freeze_startup_heap()
        log.info(
            "serving %s on %s://%s:%d/v1 (up to %d open files, %d start-up objects frozen, "
            "malloc: %s)",
            app.preprocessor.model.name, "https" if args.ssl_certfile else "http",
            args.http_host, args.http_port, open_files, frozen, loaded_allocator(),
        )  # fmt: skip
        await server.serve()
        if not server.started:
            raise RuntimeError(f"cannot listen on {args.http_host}:{args.http_port}")
    if exit_when_stopped:
        # Everything of ours is closed. Returning would free the model, the app and the router
        # object by object: 0.1 to 0.2 s of every Ctrl-C, for memory the exit gives back at once.
        exit_without_teardown(0)


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _handle(args: argparse.Namespace) -> int:
    import uvloop

    from mmserve.observability.logging import configure_logging

    configure_logging()
    try:
        uvloop.run(serve(args, exit_when_stopped=True))
    except Exception as err:
        print(f"mmserve frontend: {err}", file=sys.stderr)
        return 1
    return 0
