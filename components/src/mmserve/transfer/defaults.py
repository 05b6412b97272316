"""Transfer defaults, importable without torch (the command line needs them)."""

# Below this size a registered-buffer round trip costs more than carrying the bytes in the message.
DEFAULT_INLINE_THRESHOLD = 64 * 1024
# NATS' default max_payload is 1 MiB; inline tensors stay well under it, leaving room for the
# message around them.
MAX_INLINE_BYTES = 512 * 1024
DEFAULT_LEASE_TIMEOUT_S = 30.0
DEFAULT_POOL_BYTES = 1 << 30
