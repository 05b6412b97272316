"""What the engines and the router share about KV caches: pad values for media, Dynamo-compatible
block hashes, the routing view of a request plan, and KV event publishing."""
