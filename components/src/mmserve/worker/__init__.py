"""mmserve's NATS workers: each role's core (`mmserve.roles`) served on the NATS runtime
(`endpoints`), with their options and the services a worker process holds (`options`), the
cache-event publishers (`publishers`) and the command line (`cli`)."""
