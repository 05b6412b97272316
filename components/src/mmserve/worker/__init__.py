"""The NATS workers, one module per role: encode, aggregated (prefill + decode), prefill and
decode, on the shared `base`, with their options (`options`), the cache-event publishers
(`publishers`) and the KV handover (`handover`)."""
