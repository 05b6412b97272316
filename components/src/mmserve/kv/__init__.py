"""What the engines and the router share about their caches: pad values for media,
Dynamo-compatible block hashes, the routing view of a request plan, KV event publishing, and
the encoder cache's embedding events."""
