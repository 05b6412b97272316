"""Engine defaults, importable without torch (the command line shows them)."""

DEFAULT_MAX_QUEUE = 64
"""Requests an engine admits at once (encode, prefill, live decode streams); more get 503."""

# The mock engine's simulated costs and cache budget.
DEFAULT_PREFILL_US_PER_TOKEN = 100.0
DEFAULT_DECODE_MS_PER_TOKEN = 10.0
DEFAULT_ENCODE_US_PER_TOKEN = 0.0
DEFAULT_CACHE_BLOCKS = 65536

DEFAULT_ENCODER_CACHE_BYTES = 256 << 20
"""Budget of an engine's encoder cache (vision-tower outputs by item)."""
