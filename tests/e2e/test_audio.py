"""Audio end to end on the tiny Qwen2-Audio: the aggregated worker and encode / prefill /
decode apart give transformers' greedy tokens on its processor's inputs, through the official
openai client, streamed and not, for one clip and two (OpenAI's `input_audio` and vLLM's
`audio_url`); every refusal is a 4xx naming the part, from the frontend, and the next request
is served; a repeated clip hits the prefix cache; concurrent clips keep their answers; a clip
named by its uuid alone, and a clip's precomputed embedding (`audio_embeds`), answer as the
clip. One pair of deployments for the module."""

from __future__ import annotations

import base64
import functools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import torch
from safetensors.torch import save

from mmserve.tiny.checkpoints import build_tiny_model
from tests.support.audio import Encoding, encode_one, signal, torchcodec_samples, wav_bytes
from tests.support.deployment import CountingFileServer, Deployment, all_running, serve_directory
from tests.support.embeds import audio_tower_safetensors

MAX_TOKENS = 8
MAX_AUDIO_DURATION_S = 20
AUDIO_LIMIT = 2
# EP/D and E/PD differ from these only in which hop encodes: they run in one process
# (tests/worker/test_audio_patterns.py); aggregated and every hop apart cover what audio adds.
PATTERNS = ("agg", "e_p_d")


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("clips")
    rng = np.random.default_rng(7)
    (root / "speech.wav").write_bytes(
        wav_bytes(signal("speech_like", 16000, 2.3, 1, rng), 16000, "s16")
    )
    mp3 = Encoding("mp3", "mp3", ("-c:a", "libmp3lame", "-b:a", "64k"))
    (root / "tone.mp3").write_bytes(encode_one(signal("tone", 44100, 1.7, 2, rng), 44100, mp3))
    return root


@pytest.fixture(scope="module")
def clip_file_server(clip_dir: Path) -> Iterator[tuple[str, CountingFileServer]]:
    """A loopback HTTP server over `clip_dir`: its base URL, and the server counting GETs."""
    with serve_directory(clip_dir) as served:
        yield served


@pytest.fixture(scope="module")
def clip_server(clip_file_server: tuple[str, CountingFileServer]) -> str:
    return clip_file_server[0]


@pytest.fixture(scope="module")
def model_path() -> Path:
    return build_tiny_model("qwen2_audio")


@pytest.fixture(scope="module")
def clients(
    model_path: Path, nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, openai.OpenAI]]:
    """An openai client of each pattern's frontend, both deployments running."""
    log_dir = tmp_path_factory.mktemp("audio-logs")
    flags = [
        "--max-audio-duration",
        str(MAX_AUDIO_DURATION_S),
        "--limit-mm-per-prompt",
        f'{{"audio": {AUDIO_LIMIT}}}',
        "--enable-mm-embeds",
    ]
    # E/P/D's frontend decodes images itself: a clip's bytes still travel to the encoder.
    extra = {"e_p_d": ["--frontend-decoding"]}
    deployments = [
        Deployment(p, model_path, nats_url, log_dir, frontend_flags=flags + extra.get(p, []))
        for p in PATTERNS
    ]
    with all_running(deployments):
        yield {
            d.pattern: openai.OpenAI(base_url=f"{d.base_url}/v1", api_key="unused", max_retries=0)
            for d in deployments
        }


def input_audio(data: bytes, fmt: str) -> dict[str, Any]:
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt},
    }


def audio_url(url: str) -> dict[str, Any]:
    return {"type": "audio_url", "audio_url": {"url": url}}


def _user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


@functools.lru_cache(maxsize=1)  # a processor's tokenizer holds 120 MB
def _reference_model(model_path: Path) -> tuple[Any, Any]:
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(model_path)
    model = transformers.Qwen2AudioForConditionalGeneration.from_pretrained(model_path)
    return processor, model.eval()


def reference(model_path: Path, messages: list[dict[str, Any]], clips: list[bytes]) -> tuple:
    """transformers' greedy completion on the processor's inputs (each clip loaded as
    transformers loads audio): its text and prompt length."""
    import torch

    processor, model = _reference_model(model_path)
    template = [
        {
            "role": m["role"],
            "content": [{"type": "audio"} if p["type"] != "text" else p for p in m["content"]],
        }
        for m in messages
    ]
    text = processor.apply_chat_template(template, add_generation_prompt=True, tokenize=False)
    audio = [torchcodec_samples(clip, 16000) for clip in clips]
    inputs = processor(text=text, audio=audio, sampling_rate=16000, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    prompt = inputs["input_ids"].shape[1]
    return processor.tokenizer.decode(out[0, prompt:], skip_special_tokens=True), prompt


def _complete(client: openai.OpenAI, model: str, messages: list[dict[str, Any]]) -> tuple:
    response = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert response.usage is not None
    return response.choices[0].message.content, response.usage.prompt_tokens


def _stream(client: openai.OpenAI, model: str, messages: list[dict[str, Any]]) -> str:
    stream = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    assert isinstance(stream, openai.Stream)
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def test_each_pattern_gives_transformers_tokens(
    clients: dict[str, openai.OpenAI],
    model_path: Path,
    clip_dir: Path,
    clip_file_server: tuple[str, CountingFileServer],
) -> None:
    clip_server, server = clip_file_server
    speech = (clip_dir / "speech.wav").read_bytes()
    tone = (clip_dir / "tone.mp3").read_bytes()
    one = _user(input_audio(speech, "wav"), {"type": "text", "text": "What is this sound?"})
    two = _user(
        {"type": "text", "text": "Compare:"},
        audio_url(f"{clip_server}/tone.mp3"),
        input_audio(speech, "wav"),
    )
    expected = {
        "one": reference(model_path, one, [speech]),
        "two": reference(model_path, two, [tone, speech]),
    }
    # The clip moves the tokens: a served prompt that lost it would not pass.
    other = _user(input_audio(tone, "mp3"), {"type": "text", "text": "What is this sound?"})
    assert reference(model_path, other, [tone])[0] != expected["one"][0]
    name = model_path.name
    for pattern, client in clients.items():
        assert _complete(client, name, one) == expected["one"], pattern
        assert _stream(client, name, one) == expected["one"][0], pattern
        before = server.gets["/tone.mp3"]
        assert _complete(client, name, two) == expected["two"], pattern
        # Fetched once, by the frontend; the encoder reads the bytes it shipped.
        assert server.gets["/tone.mp3"] == before + 1, pattern


def _refusal(client: openai.OpenAI, model: str, messages: list[dict[str, Any]]) -> tuple:
    with pytest.raises(openai.APIStatusError) as caught:
        _complete(client, model, messages)
    error = caught.value
    return error.status_code, error.code, error.param


def test_bad_audio_is_refused_by_the_frontend_naming_the_part(
    clients: dict[str, openai.OpenAI], model_path: Path, clip_dir: Path, clip_server: str
) -> None:
    client, name = clients["e_p_d"], model_path.name
    speech = (clip_dir / "speech.wav").read_bytes()
    tone = (clip_dir / "tone.mp3").read_bytes()
    rng = np.random.default_rng(3)
    aiff = Encoding("aiff", "aiff", ("-c:a", "pcm_s16be"))
    too_long = wav_bytes(np.zeros((16000 * (MAX_AUDIO_DURATION_S + 1), 1)), 16000, "s16")
    question = {"type": "text", "text": "What is this sound?"}
    part = "messages[0].content[0]"
    cases = [
        (input_audio(b"not audio at all " * 64, "wav"), 400, "audio.unknown_format"),
        (input_audio(tone, "wav"), 400, "audio.format_mismatch"),
        (input_audio(speech, "aiff"), 400, "audio.unknown_format_name"),
        (
            input_audio(encode_one(signal("tone", 16000, 0.5, 1, rng), 16000, aiff), "wav"),
            400,
            "audio.unsupported_container",
        ),
        (input_audio(wav_bytes(np.zeros((0, 1)), 16000, "s16"), "wav"), 400, "audio.empty"),
        # Float samples far past full scale: features float32 cannot hold (found by fuzzing).
        (
            input_audio(wav_bytes(rng.standard_normal((8000, 1)) * 1e30, 16000, "f32"), "wav"),
            400,
            "audio.corrupt",
        ),
        (input_audio(too_long, "wav"), 413, "audio.too_long"),
        (
            {"type": "input_audio", "input_audio": {"data": "!!not base64!!", "format": "wav"}},
            400,
            "fetch.bad_data_url",
        ),
        (audio_url("http://10.0.0.1/speech.wav"), 400, "fetch.forbidden_address"),
        (
            {"type": "image_url", "image_url": {"url": f"{clip_server}/speech.wav"}},
            400,
            "process.modality_unsupported",
        ),
    ]
    good = _user(input_audio(speech, "wav"), question)
    expected = _complete(client, name, good)
    for bad, status, code in cases:
        field = bad["type"]
        assert _refusal(client, name, _user(bad, question)) == (
            status,
            code,
            f"{part}.{field}",
        ), code
        assert _complete(client, name, good) == expected, f"after {code}"
    many = _user(*[input_audio(speech, "wav")] * (AUDIO_LIMIT + 1), question)
    assert _refusal(client, name, many) == (400, "request.too_many_items", "messages")


def test_a_repeated_clip_hits_the_prefix_cache_and_concurrent_clips_keep_their_answers(
    clients: dict[str, openai.OpenAI], model_path: Path
) -> None:
    name = model_path.name
    rng = np.random.default_rng(11)
    clips = [
        wav_bytes(signal("speech_like", 16000, 0.8 + 0.3 * i, 1, rng), 16000, "s16")
        for i in range(8)
    ]
    requests = [
        _user(input_audio(clip, "wav"), {"type": "text", "text": "Which?"}) for clip in clips
    ]
    agg = clients["agg"]
    first = agg.chat.completions.create(model=name, messages=requests[0], max_tokens=2)  # type: ignore[arg-type]
    again = agg.chat.completions.create(model=name, messages=requests[0], max_tokens=2)  # type: ignore[arg-type]
    assert first.usage is not None and again.usage is not None
    assert again.usage.prompt_tokens_details is not None
    # Every whole block of the prompt, the clip's tokens among them, comes from the cache.
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and cached >= first.usage.prompt_tokens - 16
    alone = [_complete(agg, name, messages) for messages in requests]
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(functools.partial(_complete, clients["e_p_d"], name), requests))
    assert together == alone
    assert len({prompt for _, prompt in alone}) == len(clips)


def test_a_clip_named_by_its_id_gives_the_clips_tokens(
    clients: dict[str, openai.OpenAI],
    model_path: Path,
    clip_file_server: tuple[str, CountingFileServer],
) -> None:
    """In each pattern an `audio_url` or `input_audio` part carrying only the uuid of a clip
    sent before answers as the clip did, with nothing fetched; another API key cannot use the
    id; a part with neither its clip nor a uuid is named."""
    clip_server, server = clip_file_server
    name = model_path.name
    question = {"type": "text", "text": "What is this sound?"}
    named = _user(audio_url(f"{clip_server}/tone.mp3") | {"uuid": "tone-1"}, question)
    for pattern, client in clients.items():
        sent = _complete(client, name, named)
        before = server.gets["/tone.mp3"]
        by_url = _user({"type": "audio_url", "uuid": "tone-1"}, question)
        assert _complete(client, name, by_url) == sent, pattern
        by_input = _user({"type": "input_audio", "uuid": "tone-1"}, question)
        assert _stream(client, name, by_input) == sent[0], pattern
        assert server.gets["/tone.mp3"] == before, "the clip was fetched again"
        other = openai.OpenAI(base_url=client.base_url, api_key="another key", max_retries=0)
        assert _refusal(other, name, by_url)[:2] == (400, "media_id.unknown")
    empty = _user({"type": "input_audio"}, question)
    assert _refusal(clients["agg"], name, empty) == (
        400,
        "invalid_value",
        "messages[0].content[0].input_audio",
    )


def test_a_clips_precomputed_embedding_gives_the_clips_tokens(
    clients: dict[str, openai.OpenAI], model_path: Path, clip_dir: Path
) -> None:
    """An `audio_embeds` part holding transformers' audio tower and projector output for a
    clip answers as the clip does, in each pattern (it skips the encoder); one of another
    hidden size is refused naming the part."""
    name = model_path.name
    speech = (clip_dir / "speech.wav").read_bytes()
    question = {"type": "text", "text": "What is this sound?"}
    expected = _complete(clients["agg"], name, _user(input_audio(speech, "wav"), question))
    data = base64.b64encode(audio_tower_safetensors(model_path, speech)).decode()
    embeds = _user({"type": "audio_embeds", "audio_embeds": data}, question)
    for pattern, client in clients.items():
        assert _complete(client, name, embeds) == expected, pattern
    wide = base64.b64encode(save({"audio_embeds": torch.zeros(5, 65)})).decode()
    assert _refusal(
        clients["agg"], name, _user({"type": "audio_embeds", "audio_embeds": wide})
    ) == (
        400,
        "embeds.shape",
        "messages[0].content[0].audio_embeds",
    )
