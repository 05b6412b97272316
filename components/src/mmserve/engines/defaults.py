"""Engine defaults, importable without torch (the command line shows them)."""

from typing import Literal

LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]
"""Whose log-probabilities a request gets (vLLM's `--logprobs-mode`): the model's own
distribution, or the one the token was drawn from (after `logit_bias`, the penalties,
temperature, `min_p`, `top_k` and `top_p`; an id those rule out reads `logits.UNLIKELY`)."""
LOGPROBS_MODES: tuple[LogprobsMode, ...] = ("raw_logprobs", "processed_logprobs")

DEFAULT_MAX_QUEUE = 64
"""Requests an engine admits at once (encode, prefill, live decode streams); more get 503."""

# The mock engine's simulated costs and cache budget.
DEFAULT_PREFILL_US_PER_TOKEN = 100.0
DEFAULT_DECODE_MS_PER_TOKEN = 10.0
DEFAULT_ENCODE_US_PER_TOKEN = 0.0
DEFAULT_CACHE_BLOCKS = 65536

DEFAULT_ENCODER_CACHE_BYTES = 256 << 20
"""Budget of an engine's encoder cache (vision-tower outputs by item)."""
