"""SGLang's command line for a worker: the role's flags, the user's, and SGLang's own parser
over them; the KV event publisher the engine reads; the fields of every generate call."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

GENERATE_FIELDS = (
    "input_ids",
    "sampling_params",
    "image_data",
    "video_data",
    "audio_data",
    "mm_hashes",
    "stream",
    "rid",
    "bootstrap_host",
    "bootstrap_port",
    "bootstrap_room",
    "return_logprob",
    "top_logprobs_num",
    "logprob_start_len",
    "token_ids_logprob",
    "require_reasoning",
)
"""Every argument the engine passes to `sglang.Engine.async_generate` (the four before the last
where a request asks for log-probabilities: `convert.logprob_kwargs`; the last for a grammar
after a reasoning section)."""

RAW_LOGPROBS_ENV = ("SGLANG_RETURN_ORIGINAL_LOGPROB", "1")
"""Set for SGLang's processes unless the user set it: SGLang's logprobs are then those of the
logits before temperature (`Sampler.forward`), as the hf engine's `raw_logprobs` and vLLM's
default; SGLang's own default divides by the temperature first. (Its logits already carry
`logit_bias` and the penalties, which the hf engine's raw logprobs do not.)"""

ROLE_SGLANG_ARGS: dict[str, tuple[tuple[str, ...], ...]] = {
    "prefill": (
        ("--disaggregation-mode", "prefill"),
        ("--disaggregation-transfer-backend", "nixl"),
    ),
    "decode": (("--disaggregation-mode", "decode"), ("--disaggregation-transfer-backend", "nixl")),
    "encode": (("--encoder-only",),),
}
"""SGLang flags a worker role implies, each left out where the user gave that flag."""


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
