"""The OpenAI-compatible HTTP frontend: `mmserve frontend` (see docs/frontend.md)."""
