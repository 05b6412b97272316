"""What the engines and the router share about their caches, engine- and transport-neutral:
pad values for media, Dynamo-compatible block hashes, the routing view of a request plan, and
the KV and embedding-cache events (their data, topics and dumps; the workers publish them,
`worker.publishers`). Nothing here imports the runtime."""
