"""A real uvicorn server running the frontend on a free loopback port, in front of an in-process
test double of the pipeline (`EchoDispatcher`)."""

from __future__ import annotations

import argparse
import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import uvicorn
import uvloop

from mmserve.engines.detokenize import IncrementalDetokenizer
from mmserve.frontend.app import FrontendApp
from mmserve.frontend.chat import ServedModel
from mmserve.frontend.cli import add_arguments, build_app, load_model
from mmserve.models.tokenizer import shared_tokenizer
from mmserve.protocol import PreprocessedRequest, TensorHandle, TokenChunk, Usage
from mmserve.runtime.errors import RemoteError
from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.local_media import MediaServer, media_server_over


def _tokenizer() -> Any:
    return shared_tokenizer(build_tiny_model("qwen2_vl")).backend_tokenizer


@dataclass
class EchoDispatcher:
    """Test double of the pipeline: streams the prompt's own token ids back, one per chunk, up
    to max_tokens. `hold_first_token` makes it wait forever before the first token (deadline and
    disconnect tests); `failure` is raised after `fail_after` tokens; `cancelled` is set when the
    frontend abandons a generation. `reset_prefix_cache` counts its calls in `resets` and raises
    `reset_failure` when one is set."""

    is_ready: bool = True
    hold_first_token: bool = False
    failure: RemoteError | None = None
    fail_after: int = 0
    requests: list[PreprocessedRequest] = field(default_factory=list)
    cancelled: threading.Event = field(default_factory=threading.Event)
    resets: int = 0
    reset_failure: RemoteError | None = None
    tokenizer: Any = None  # the served model's (tokenizers'), else the tiny Qwen2-VL's

    def ready(self) -> bool:
        return self.is_ready

    async def reset_prefix_cache(self) -> int:
        if self.reset_failure is not None:
            raise self.reset_failure
        self.resets += 1
        return 1

    async def generate(self, request: PreprocessedRequest) -> AsyncIterator[TokenChunk]:
        self.requests.append(request)
        try:
            if self.hold_first_token:
                await asyncio.Event().wait()
            choices = request.sampling.n
            for choice in range(choices):
                async for chunk in self._echo(request, choice, last_choice=choice == choices - 1):
                    yield chunk
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled.set()
            raise

    async def _echo(
        self, request: PreprocessedRequest, choice: int, last_choice: bool
    ) -> AsyncIterator[TokenChunk]:
        """One choice: the prompt's ids (text as an engine makes it: the ids decoded once,
        cut at a stop string); the stream's last chunk carries the usage of all choices."""
        detokenizer = IncrementalDetokenizer(
            self.tokenizer or _tokenizer(), request.stop.stop, request.stop.min_tokens
        )
        echoed = request.plan.token_ids[: request.stop.max_tokens]
        for index, token_id in enumerate(echoed):
            if self.failure is not None and index == self.fail_after:
                raise self.failure
            text = detokenizer.push([token_id])
            last = index == len(echoed) - 1 or detokenizer.stopped
            finish = None
            if detokenizer.stopped:
                finish = "stop"
            elif last:
                finish = "length" if len(echoed) < len(request.plan.token_ids) else "stop"
                text += detokenizer.flush()
                finish = "stop" if detokenizer.stopped else finish
            yield TokenChunk(
                request_id=request.request_id,
                token_ids=[token_id],
                text=text,
                finish_reason=finish,
                index=choice,
                usage=Usage(
                    prompt_tokens=len(request.plan.token_ids),
                    completion_tokens=(index + 1) * request.sampling.n,
                )
                if last and last_choice
                else None,
            )
            if last:
                return


@dataclass
class InlineTensorSink:
    """Test double of the transfer layer for frontend decoding and precomputed embeddings:
    ships each array with the `inline` backend (the descriptor is the tensor's bytes) and
    keeps what it shipped."""

    shipped: list[tuple[str, np.ndarray | torch.Tensor]] = field(default_factory=list)

    async def __call__(self, request_id: str, array: np.ndarray | torch.Tensor) -> TensorHandle:
        self.shipped.append((request_id, array))
        tensor = torch.from_numpy(array) if isinstance(array, np.ndarray) else array
        return TensorHandle(
            shape=tuple(tensor.shape),
            dtype=str(tensor.dtype).removeprefix("torch."),
            backend="inline",
            descriptor=tensor.contiguous().view(torch.uint8).numpy().tobytes(),
        )


@dataclass
class RunningFrontend:
    url: str
    app: FrontendApp
    dispatcher: EchoDispatcher
    tensor_sink: InlineTensorSink

    @property
    def model(self) -> str:
        return self.app.preprocessor.model.name


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    return build_tiny_model("qwen2_vl")


def parse_frontend_args(model_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model-path", str(model_path), "--http-port", "0", *extra])


@pytest.fixture(scope="session")
def start_frontend(tiny_model_path: Path) -> Iterator[Callable[..., RunningFrontend]]:
    """Starts a frontend per distinct set of flags (kept for the session, stopped at its end);
    `--model-path` among them serves that checkpoint instead of the tiny Qwen2-VL."""
    models: dict[str, ServedModel] = {}
    running: dict[tuple[str, ...], RunningFrontend] = {}
    stops: list[Callable[[], None]] = []

    def start(*extra: str) -> RunningFrontend:
        if extra in running:
            frontend = running[extra]
            frontend.dispatcher.is_ready = True
            frontend.dispatcher.hold_first_token = False
            frontend.dispatcher.failure = None
            frontend.dispatcher.fail_after = 0
            frontend.dispatcher.cancelled.clear()
            frontend.dispatcher.requests.clear()
            frontend.dispatcher.reset_failure = None
            return frontend
        args = parse_frontend_args(tiny_model_path, *extra)
        if args.model_path not in models:
            models[args.model_path] = load_model(args)
        model = models[args.model_path]
        dispatcher = EchoDispatcher(tokenizer=model.tokenizer.backend_tokenizer)
        tensor_sink = InlineTensorSink()
        ships = args.frontend_decoding or args.enable_mm_embeds
        app = build_app(args, model, dispatcher, tensor_sink if ships else None)
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="off", log_level="warning")
        )
        thread = threading.Thread(target=uvloop.run, args=(server.serve(),), daemon=True)
        thread.start()
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            threading.Event().wait(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]

        def stop() -> None:
            server.should_exit = True
            thread.join(timeout=10)

        stops.append(stop)
        running[extra] = RunningFrontend(f"http://127.0.0.1:{port}", app, dispatcher, tensor_sink)
        return running[extra]

    yield start
    for stop in stops:
        stop()


@pytest.fixture(scope="session")
def media_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MediaServer]:
    with media_server_over(tmp_path_factory.mktemp("media")) as server:
        yield server


@pytest.fixture
def frontend(start_frontend: Callable[..., RunningFrontend]) -> RunningFrontend:
    return start_frontend()


@pytest.fixture
def allowed_frontend(
    start_frontend: Callable[..., RunningFrontend], media_server: MediaServer
) -> RunningFrontend:
    """A frontend that may fetch from the loopback media server and read files under its
    `allowed/` directory."""
    allowed_root = media_server.root / "allowed"
    allowed_root.mkdir(exist_ok=True)
    return start_frontend(
        "--allowed-media-domains", "127.0.0.1", "--allowed-local-media-path", str(allowed_root)
    )
