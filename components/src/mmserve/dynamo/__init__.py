"""mmserve's workers (aggregated, encode, prefill, decode) as backends of NVIDIA Dynamo
(`python -m mmserve.dynamo`).

Dynamo's frontend (HTTP, chat template, tokenizer, router) sends its preprocessed requests -
token ids with one image placeholder per image, and the images' URLs - through
`ai-dynamo-runtime`'s request plane; this worker plans them with mmserve's Rust driver, runs the
encode stage and the engine, and streams Dynamo's output dicts back.

- `requests`: Dynamo's request and response dicts to and from mmserve's types;
- `handler`: each role's core (`mmserve.roles`) behind an adapter that translates Dynamo's
  requests, replies and errors;
- `images`: a request's images planned here, or by an encode worker;
- `stopping`: Dynamo stopping a request, and the steps and streams that end when it does;
- `kv_events`: the engine's prefix-cache changes as Dynamo's KV events;
- `cli`: the process: arguments, the runtime, the model card.
"""
