"""The inference engines behind one contract (`base.Engine`): `hf` (transformers), `mock` (no
model, simulated timing) and `sglang`; with what they share: the prefix and encoder caches,
sampling, detokenizing and the defaults."""
