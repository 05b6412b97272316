"""The catalogue of error codes: every code a component answers with, its HTTP status, and what
it means. Media codes are the Rust core's own (`<stage>.<kind>`, `MediaError.args[0]`), kept as
they are; `tests/test_protocol.py` checks that every code the core can raise is listed here.

A client's mistake is a 4xx; a fault of the deployment (a worker's bug, a broken config, a lost
peer) is a 5xx, never blamed on the client. A code missing from the catalogue is a 500.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmserve.protocol.wire import WireMessage


@dataclass(frozen=True)
class ErrorCode:
    code: str
    status: int
    meaning: str


def _catalogue(*codes: ErrorCode) -> dict[str, ErrorCode]:
    return {entry.code: entry for entry in codes}


ERROR_BAD_REQUEST = "bad_request"
ERROR_PAYLOAD_TOO_LARGE = "payload_too_large"
ERROR_UNAVAILABLE = "unavailable"
ERROR_DEADLINE_EXCEEDED = "deadline_exceeded"
ERROR_CANCELLED = "cancelled"
ERROR_DISCONNECTED = "disconnected"
ERROR_SLOW_CONSUMER = "slow_consumer"
ERROR_PROTOCOL = "protocol"
ERROR_INTERNAL = "internal"
ERROR_CACHE_RESET_FAILED = "cache_reset_failed"

CATALOGUE: dict[str, ErrorCode] = _catalogue(
    # Between components.
    ErrorCode(ERROR_BAD_REQUEST, 400, "the request cannot be served as given"),
    ErrorCode(ERROR_PAYLOAD_TOO_LARGE, 413, "a message is over the NATS payload limit"),
    ErrorCode(ERROR_UNAVAILABLE, 503, "no instance can take the request now (none deployed, "
              "overloaded, or gone); retry later"),
    ErrorCode(ERROR_DEADLINE_EXCEEDED, 504, "the request's deadline passed"),
    ErrorCode(ERROR_CANCELLED, 499, "the caller gave up on the request"),
    ErrorCode(ERROR_DISCONNECTED, 503, "the connection to NATS or to the instance was lost"),
    ErrorCode(ERROR_SLOW_CONSUMER, 500, "a reader fell too far behind its stream"),
    ErrorCode(ERROR_PROTOCOL, 500, "a peer sent a message this side cannot read"),
    ErrorCode(ERROR_INTERNAL, 500, "a fault of the serving side; see its log"),
    # The HTTP edge.
    ErrorCode("invalid_json", 400, "the request body is not valid JSON"),
    ErrorCode("invalid_value", 400, "a request field has a wrong type or value"),
    ErrorCode("unsupported_option", 400, "an OpenAI option mmserve does not implement is set"),
    ErrorCode("context_length_exceeded", 400, "the prompt and completion exceed the context"),
    ErrorCode("min_tokens_over_max_tokens", 400, "min_tokens is greater than max_tokens"),
    ErrorCode("min_pixels_over_max_pixels", 400, "mm_processor_kwargs: min_pixels is greater "
              "than max_pixels"),
    ErrorCode("chat_template", 400, "the model's chat template rejected the messages"),
    ErrorCode("invalid_api_key", 401, "the API key is missing or wrong"),
    ErrorCode("model_not_found", 404, "the request names a model this server does not serve"),
    ErrorCode("not_found", 404, "no such path"),
    ErrorCode("method_not_allowed", 405, "the HTTP method is not allowed on this path"),
    ErrorCode("body_too_large", 413, "the request body is over --max-request-body-bytes"),
    ErrorCode("incomplete", 502, "the worker ended its stream without finishing"),
    ErrorCode("no_worker", 503, "no worker is reachable for the model; retry later"),
    ErrorCode(ERROR_CACHE_RESET_FAILED, 503, "some instances did not clear their caches (busy, "
              "failed, gone or timed out); the message names each"),
    # Media ids (a part's uuid).
    ErrorCode("media_id.unknown", 400, "no media was sent under this uuid with this API key; "
              "send the image with its uuid"),
    ErrorCode("media_id.gone", 400, "the deployment no longer holds the media of this uuid; "
              "send the image again with its uuid"),
    # Precomputed embeddings (image_embeds parts).
    ErrorCode("embeds.disabled", 400, "image_embeds parts need a server started with "
              "--enable-mm-embeds"),
    ErrorCode("embeds.format", 400, "the embedding is not a readable safetensors file or .npy "
              "array (pickled tensors are refused)"),
    ErrorCode("embeds.missing", 400, "a tensor the part needs (image_embeds, image_grid_thw) "
              "is not in it"),
    ErrorCode("embeds.dtype", 400, "the embedding's dtype is not float32, float16 or bfloat16"),
    ErrorCode("embeds.shape", 400, "the embedding's shape does not fit the model's hidden size "
              "or the grid's token count"),
    ErrorCode("embeds.values", 400, "the embedding holds NaN or infinite values"),
    # The Rust core: fetching media.
    ErrorCode("fetch.bad_data_url", 400, "a data: URL is malformed"),
    ErrorCode("fetch.bad_base64", 400, "an item that is neither a URL nor a path is not valid "
              "base64"),
    ErrorCode("base64.invalid", 400, "the base64 text has a character outside its alphabet"),
    ErrorCode("base64.mixed_alphabets", 400, "the base64 text mixes the standard and URL-safe "
              "alphabets"),
    ErrorCode("fetch.bad_url", 400, "the media URL cannot be parsed"),
    ErrorCode("fetch.unsupported_scheme", 400, "the media URL's scheme is not data, file or "
              "http(s)"),
    ErrorCode("fetch.forbidden_address", 400, "the media host is private or loopback and not in "
              "--allowed-media-domains"),
    ErrorCode("fetch.local_path_not_allowed", 400, "the local path is outside "
              "--allowed-local-media-path"),
    ErrorCode("fetch.local_io", 400, "the local media file cannot be read"),
    ErrorCode("fetch.resolve", 400, "the media host name does not resolve"),
    ErrorCode("fetch.http", 400, "the media server cannot be reached"),
    ErrorCode("fetch.http_status", 400, "the media server answered with an error status"),
    ErrorCode("fetch.timeout", 400, "fetching the media took longer than --media-fetch-timeout"),
    ErrorCode("fetch.too_large", 413, "a media item is over 64 MiB"),
    ErrorCode("fetch.too_many_redirects", 400, "the media URL redirects too often"),
    ErrorCode("fetch.bad_redirect", 400, "the media URL redirects somewhere unusable"),
    ErrorCode("fetch.bad_proxy", 500, "the operator's HTTP(S)_PROXY setting is unusable"),
    # The Rust core: a request's media as a whole.
    ErrorCode("request.too_many_items", 400, "the request has more media items than allowed"),
    ErrorCode("request.too_many_bytes", 413, "the request's media add up to more than 256 MiB"),
    # The Rust core: decoding an image.
    ErrorCode("decode.unknown_format", 400, "the item is not an image of a supported format"),
    ErrorCode("decode.corrupt", 400, "the image data is corrupt or truncated"),
    ErrorCode("decode.unsupported", 400, "the image uses a feature the decoder does not support"),
    ErrorCode("decode.unsupported_bit_depth", 400, "the image has samples deeper than 8 bits"),
    ErrorCode("decode.empty_image", 400, "the image has no pixels"),
    ErrorCode("decode.too_many_pixels", 413, "the image has more pixels than the decoder allows"),
    ErrorCode("decode.out_of_memory", 413, "the image needs more memory than can be allocated"),
    # The Rust core: demuxing, decoding and sampling a video.
    ErrorCode("video.unknown_container", 400, "the item is not a video in a known container"),
    ErrorCode("video.unsupported_container", 400, "the video's container is not mp4, mov, "
              "webm or mkv"),
    ErrorCode("video.no_video_stream", 400, "the file has no video stream"),
    ErrorCode("video.unsupported_codec", 400, "the video's codec is not H.264, HEVC, VP8, VP9, "
              "AV1 or MPEG-4"),
    ErrorCode("video.unsupported_pixel_format", 400, "the video is not 8-bit YUV (10-bit and "
              "other formats are refused)"),
    ErrorCode("video.corrupt", 400, "the video data is corrupt or truncated"),
    ErrorCode("video.no_frame_rate", 400, "the video's frame rate is unknown"),
    ErrorCode("video.no_frames", 400, "the video has no frames"),
    ErrorCode("video.too_few_frames", 400, "the video has fewer frames than the sampling asks "
              "for"),
    ErrorCode("video.bad_sampling", 400, "the video sampling options are invalid"),
    ErrorCode("video.too_long", 413, "the video lasts longer than allowed"),
    ErrorCode("video.too_many_frames", 413, "the video has more frames than allowed"),
    ErrorCode("video.too_many_pixels", 413, "the video's frames have more pixels than allowed"),
    ErrorCode("video.too_many_tokens", 413, "the video would take more prompt tokens than "
              "allowed"),
    ErrorCode("video.too_many_streams", 400, "the file has more streams than allowed"),
    ErrorCode("video.frame_size_changed", 400, "the video's frame size changes mid-stream"),
    ErrorCode("video.deadline", 400, "decoding the video took longer than allowed"),
    ErrorCode("video.unavailable", 500, "this deployment's core cannot read video (built "
              "without it, or called without the video options)"),
    ErrorCode("transform.frame_count", 500, "a temporal patch got the wrong number of frames"),
    # The Rust core: preprocessing and the prompt's layout.
    ErrorCode("process.aspect_ratio", 400, "the image is more than 200 times wider than tall, "
              "or taller than wide"),
    ErrorCode("process.empty_image", 400, "the image has no pixels"),
    ErrorCode("process.placeholder_context", 400, "the prompt's text spells the model's media "
              "placeholder token"),
    ErrorCode("process.placeholder_count", 400, "the prompt holds another number of media "
              "placeholders than the request has items"),
    ErrorCode("process.placeholder_modality", 400, "the prompt's text spells a media "
              "placeholder of another modality than the item at its place"),
    ErrorCode("process.video_unsupported", 400, "the served model family does not take video "
              "(yet)"),
    ErrorCode("process.grid", 400, "a precomputed item's grid is not one the model's vision "
              "tower produces"),
    ErrorCode("process.offsets", 500, "the prompt layout and the items' grids disagree"),
    ErrorCode("process.tensor_shape", 500, "a preprocessed tensor has the wrong shape"),
    ErrorCode("process.pixel_buffer", 500, "a pixel buffer has the wrong size"),
    ErrorCode("process.pan_and_scan", 500, "pan-and-scan planned without the prompt or "
              "texts it needs"),
    ErrorCode("resize.empty_image", 400, "the image has no pixels"),
    ErrorCode("resize.empty_target", 500, "a resize was asked for an empty target"),
    ErrorCode("resize.target_too_large", 500, "a resize target is over the allowed size"),
    ErrorCode("resize.buffer_size", 500, "a resize buffer has the wrong size"),
    ErrorCode("resize.unknown_backend", 500, "the resize backend is not known"),
    ErrorCode("resize.unknown_filter", 500, "the resize filter is not known"),
    ErrorCode("transform.bad_geometry", 500, "the patch geometry does not fit the image"),
    ErrorCode("transform.bad_std", 500, "the normalization std has a zero"),
    ErrorCode("transform.image_buffer_size", 500, "an image buffer has the wrong size"),
    ErrorCode("transform.not_divisible", 500, "the image does not divide into patches"),
    ErrorCode("transform.output_size", 500, "the output buffer has the wrong size"),
    ErrorCode("transform.unknown_convention", 500, "the normalization convention is not known"),
    # The Rust core: the model's spec and the KV index (the deployment's, never a request's).
    ErrorCode("spec.invalid", 500, "the model's preprocessing spec is invalid"),
    ErrorCode("spec.inconsistent", 500, "the model's config files disagree"),
    ErrorCode("spec.missing", 500, "the model's config files lack a needed value"),
    ErrorCode("spec.json", 500, "a model config file is not valid JSON"),
    ErrorCode("spec.unknown_family", 500, "the model family is not supported"),
    ErrorCode("kv_index.bad_media_span", 500, "a media span does not fit its prompt"),
    ErrorCode("kv_index.unknown_parent", 500, "a KV event names a parent block not indexed"),
    ErrorCode("kv_index.zero_block_size", 500, "the KV block size is zero"),
)  # fmt: skip


def http_status_for(code: str) -> int:
    """The HTTP status of an error code (500 for a code the catalogue does not list)."""
    entry = CATALOGUE.get(code)
    return entry.status if entry is not None else 500


class ErrorMessage(WireMessage, frozen=True):
    """A failure reported by the serving side; the caller raises it as `RemoteError`."""

    code: str
    message: str
    status: int = 500
    request_id: str = ""
