"""The sglang engine: SGLang 0.5.x runs the model stages on GPUs behind mmserve's interface.

`engine` (`SglangEngine`: encode, prefill, decode, P/D through SGLang's bootstrap rooms),
`outputs` (SGLang's streamed outputs as `TokenChunk`s: choices, log-probabilities, usage),
`checks` (the installed SGLang against the adapter: its request fields, `mm_hashes`, its pad
values; `check_sglang`, `SglangStartupError`), `args` (SGLang's command line for a worker and
its parser), `convert` (mmserve's requests and items as SGLang's arguments), `kv_events` (SGLang's
KV events as mmserve's). See docs/sglang.md.

Everything from `sglang` is imported lazily, so this package imports without it; the names
below are imported on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "GENERATE_FIELDS": "args",
    "RAW_LOGPROBS_ENV": "args",
    "ROLE_SGLANG_ARGS": "args",
    "kv_events_config": "args",
    "parse_sglang_args": "args",
    "sglang_argv": "args",
    "PAD_PROBE_HASH": "checks",
    "SglangStartupError": "checks",
    "check_sglang": "checks",
    "sglang_pad_values": "checks",
    "sglang_splits_images": "checks",
    "encoder_item": "convert",
    "check_disaggregated": "convert",
    "finish_reason": "convert",
    "generate_calls": "convert",
    "generate_kwargs": "convert",
    "logprob_kwargs": "convert",
    "media_item": "convert",
    "sampling_params": "convert",
    "SglangEngine": "engine",
    "SglangStream": "outputs",
    "SglangKvEventBridge": "kv_events",
    "zmq_reader": "kv_events",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mmserve.engines.sglang' has no attribute {name!r}")
    return getattr(importlib.import_module(f"mmserve.engines.sglang.{_EXPORTS[name]}"), name)
