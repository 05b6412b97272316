"""The project's main correctness test: every deployment pattern gives the same greedy tokens
as the aggregated one, for each tiny model family, with 0, 1 and 3 images, videos, precomputed
embeddings and media ids.

A family's deployments (one per pattern) start once, for every test here that names the
family: `deployed` is module-scoped and parametrized indirectly, so pytest runs a family's
tests together and starts the next family's deployments after stopping these."""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from mmserve.models.family import resolve_model_spec
from mmserve.tiny.checkpoints import TINY_FAMILIES, build_tiny_model
from tests.support.deployment import Deployment, all_running
from tests.support.embeds import embeds_part, vision_tower_safetensors
from tests.support.images import file_data_url
from tests.support.waiting import wait_until

FAMILIES = list(TINY_FAMILIES)
PATTERNS = ["agg", "ep_d", "e_pd", "e_p_d"]
# Qwen3-VL-MoE is Qwen3-VL with an MoE language model, Qwen3.5-MoE is Qwen3.5 with one: the
# aggregated worker and the pattern with every hop apart (embeddings to prefill, its KV and
# linear-attention states to decode) cover what differs; Qwen3-VL and Qwen3.5 go through all
# four.
FAMILY_PATTERNS = {"qwen3_vl_moe": ["agg", "e_p_d"], "qwen3_5_moe": ["agg", "e_p_d"]}
MAX_TOKENS = 10


def _requests(image_server: str, image_dir: Path) -> list[list[dict[str, Any]]]:
    return [
        [{"role": "user", "content": "Say something about the weather."}],
        [
            {"role": "system", "content": "You describe pictures."},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"{image_server}/photo.jpg"}},
                    {"type": "text", "text": "What is in this picture?"},
                ],
            },
        ],
        [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare these:"},
                    {"type": "image_url", "image_url": {"url": f"{image_server}/tall.png"}},
                    {
                        "type": "image_url",
                        "image_url": {"url": file_data_url(image_dir / "small.png")},
                    },
                    {"type": "image_url", "image_url": {"url": f"{image_server}/photo.jpg"}},
                ],
            }
        ],
    ]


def _complete(client: openai.OpenAI, model: str, messages: list[dict[str, Any]]) -> tuple:
    response = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,  # type: ignore[arg-type]
    )
    usage = response.usage
    assert usage is not None
    return (
        response.choices[0].message.content,
        response.choices[0].finish_reason,
        usage.prompt_tokens,
        usage.completion_tokens,
    )


def _stream(client: openai.OpenAI, model: str, messages: list[dict[str, Any]]) -> str:
    stream = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def _image_urls(requests: list, image_server: str) -> Counter[str]:
    """Paths of the images and videos the requests name on the image server, with their
    counts."""
    paths: Counter[str] = Counter()
    for messages in requests:
        for message in messages:
            for part in message["content"] if isinstance(message["content"], list) else []:
                media = part.get(part["type"])
                url = media.get("url", "") if isinstance(media, dict) else ""
                if url.startswith(image_server):
                    paths[url.removeprefix(image_server)] += 1
    return paths


def _scored(client: openai.OpenAI, model: str) -> tuple[str, list]:
    """A text completion with the prompt's log-probabilities (echo): its text, and each
    token's logprob and most likely tokens."""
    response = client.completions.create(
        model=model,
        prompt="A text prompt that the model scores token by token, then continues",
        echo=True,
        logprobs=2,
        max_tokens=3,
        temperature=0,
    )
    choice = response.choices[0]
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert choice.logprobs.top_logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None
    pairs = zip(choice.logprobs.token_logprobs[1:], choice.logprobs.top_logprobs[1:], strict=True)
    return choice.text, list(pairs)


def _logged(deployment: Deployment, process: str, request_id: str) -> bool:
    return request_id in deployment.log(process)


@pytest.fixture(scope="module")
def deployed(
    request: pytest.FixtureRequest, nats_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Deployment]]:
    """The family `request.param`'s running deployments by pattern: every pattern, or those
    FAMILY_PATTERNS names. E/P/D moves embeddings and KV caches over NIXL, the others over
    shared memory; the frontends take precomputed embeddings (--enable-mm-embeds)."""
    family = request.param
    model_path = build_tiny_model(family)
    log_dir = tmp_path_factory.mktemp(f"patterns-{family}")
    deployments = [
        Deployment(
            p,
            model_path,
            nats_url,
            log_dir,
            transfer="nixl" if p == "e_p_d" else "shm",
            frontend_flags=["--enable-mm-embeds"],
        )
        for p in FAMILY_PATTERNS.get(family, PATTERNS)
    ]
    with all_running(deployments):
        yield {deployment.pattern: deployment for deployment in deployments}


def _run_patterns(
    deployments: list[Deployment],
    requests: list,
    image_gets: Counter[str],
    scored: dict[str, tuple[str, list]] | None = None,
) -> tuple[dict, dict, dict]:
    """Each running pattern's completions, streamed texts, and the image GETs it made; into
    `scored`, where given, its scored text completion (`_scored`)."""
    results: dict[str, list[tuple]] = {}
    streamed: dict[str, list[str]] = {}
    gets: dict[str, Counter[str]] = {}
    for deployment in deployments:
        client = openai.OpenAI(base_url=f"{deployment.base_url}/v1", api_key="unused")
        name = deployment.model_path.name
        before = Counter(image_gets)
        results[deployment.pattern] = [_complete(client, name, m) for m in requests]
        streamed[deployment.pattern] = [_stream(client, name, m) for m in requests]
        gets[deployment.pattern] = Counter(image_gets) - before
        if scored is not None:
            scored[deployment.pattern] = _scored(client, name)
    return results, streamed, gets


@pytest.mark.parametrize("deployed", FAMILIES, indirect=True)
def test_every_pattern_gives_the_aggregated_tokens(
    deployed: dict[str, Deployment],
    image_server: str,
    image_dir: Path,
    image_gets: Counter[str],
) -> None:
    requests = _requests(image_server, image_dir)
    scored: dict[str, tuple[str, list]] = {}
    results, streamed, gets = _run_patterns(list(deployed.values()), requests, image_gets, scored)
    aggregated = results["agg"]
    text_only, one_image, three_images = aggregated
    assert all(text for text, *_ in aggregated)
    assert all(completion == MAX_TOKENS for *_, completion in aggregated)
    # Images expand into many prompt tokens.
    assert one_image[2] > text_only[2] + 16
    assert three_images[2] > one_image[2]
    for pattern, outputs in results.items():
        assert outputs == aggregated, f"{pattern} differs from agg"
        assert streamed[pattern] == [text for text, *_ in aggregated], f"{pattern} streamed"
        # Each request fetches each of its images once, whichever process needs the pixels:
        # twice per image reference (the requests run unstreamed, then streamed).
        twice = Counter({path: 2 * n for path, n in _image_urls(requests, image_server).items()})
        assert gets[pattern] == twice, f"{pattern} fetched {dict(gets[pattern])}"
        # A text completion's prompt log-probabilities (the prefill's, handed to decode).
        text, entries = scored["agg"]
        assert scored[pattern][0] == text, f"{pattern} scored text"
        for (value, top), (other, other_top) in zip(entries, scored[pattern][1], strict=True):
            assert other == pytest.approx(value, abs=1e-4), f"{pattern} prompt logprobs"
            assert other_top.keys() == top.keys(), f"{pattern} top logprobs"


@pytest.mark.parametrize("deployed", ["qwen2_5_vl", "qwen2_vl", "qwen3_vl"], indirect=True)
def test_every_pattern_gives_the_aggregated_tokens_for_videos(
    deployed: dict[str, Deployment],
    image_server: str,
    image_dir: Path,
    image_gets: Counter[str],
) -> None:
    """A video by URL, and a video by data URL between two images, sampled as the request
    asks: every pattern answers what the aggregated worker answers, fetching each item once.
    Qwen2-VL, Qwen2.5-VL, whose video positions are spaced by time, and Qwen3-VL, whose
    timestamp text goes before each temporal group."""
    video = {"type": "video_url", "video_url": {"url": f"{image_server}/clip.mp4"}}
    requests = [
        [{"role": "user", "content": [video, {"type": "text", "text": "What happens?"}]}],
        [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": f"{image_server}/photo.jpg"}},
                    {
                        "type": "video_url",
                        "video_url": {"url": file_data_url(image_dir / "clip.mp4")},
                    },
                    {
                        "type": "image_url",
                        "image_url": {"url": file_data_url(image_dir / "small.png")},
                    },
                    {"type": "text", "text": "Compare them."},
                ],
            }
        ],
    ]
    results, streamed, gets = _run_patterns(list(deployed.values()), requests, image_gets)
    aggregated = results["agg"]
    (_, _, video_prompt, _), (_, _, mixed_prompt, _) = aggregated
    # 4 frames sampled at 2 fps from the 112x84 clip: 2 temporal patches of 12 tokens each
    # (Qwen3-VL: 2 groups, each after its timestamp text).
    assert video_prompt > 24 and mixed_prompt > video_prompt + 24
    for pattern, outputs in results.items():
        assert outputs == aggregated, f"{pattern} differs from agg"
        assert streamed[pattern] == [text for text, *_ in aggregated], f"{pattern} streamed"
        twice = Counter({path: 2 * n for path, n in _image_urls(requests, image_server).items()})
        assert gets[pattern] == twice, f"{pattern} fetched {dict(gets[pattern])}"


@pytest.mark.parametrize("deployed", ["qwen2_vl"], indirect=True)
def test_frontend_decoding_gives_the_same_tokens(
    deployed: dict[str, Deployment],
    nats_url: str,
    tmp_path: Path,
    image_server: str,
    image_dir: Path,
    image_gets: Counter[str],
) -> None:
    """With --frontend-decoding the frontend preprocesses and ships pixel_values by transfer;
    E/PD and E/P/D answer exactly what the family's aggregated worker answers from URLs."""
    aggregated = deployed["agg"]
    decoding = ["--frontend-decoding", "--transfer", "shm"]
    deployments = [
        Deployment(p, aggregated.model_path, nats_url, tmp_path, frontend_flags=decoding)
        for p in ("e_pd", "e_p_d")
    ]
    requests = _requests(image_server, image_dir)[1:]
    with all_running(deployments):
        results, streamed, gets = _run_patterns([aggregated, *deployments], requests, image_gets)
    twice = Counter({path: 2 * n for path, n in _image_urls(requests, image_server).items()})
    for pattern in ("e_pd", "e_p_d"):
        assert streamed[pattern] == [text for text, *_ in results["agg"]]
        assert results[pattern] == results["agg"], f"{pattern} with frontend decoding"
        assert gets[pattern] == twice, f"{pattern} fetched {dict(gets[pattern])}"


@pytest.mark.parametrize("deployed", ["qwen2_vl", "qwen3_vl", "gemma3"], indirect=True)
def test_precomputed_embeddings_give_the_images_tokens(
    deployed: dict[str, Deployment],
    image_server: str,
    image_dir: Path,
    image_gets: Counter[str],
) -> None:
    """The model's own vision tower output for an image, sent as an `image_embeds` part, gives
    the image's greedy tokens in every pattern: alone (it skips the encoder) and beside an
    image that is encoded (the embedding passes the encoder untouched). Nothing is fetched for
    it, and the same embedding sent again hits the prefix cache. Qwen2-VL goes through every
    pattern; the other families (deepstack rows, a fixed-size tower) through agg and E/P/D,
    which moves the embedding to prefill and the KV cache to decode, the paths where a
    family's rows could go wrong."""
    model_path = deployed["agg"].model_path
    spec = resolve_model_spec(model_path)
    patterns = PATTERNS if spec.family == "qwen2_vl" else ["agg", "e_p_d"]
    # Gemma 3's tower takes one fixed size: no pixel bounds to try.
    resizes = spec.vision_input == "patches"
    photo = image_dir / "photo.jpg"
    embeds = embeds_part(vision_tower_safetensors(model_path, photo.read_bytes()))
    image = {"type": "image_url", "image_url": {"url": f"{image_server}/photo.jpg"}}
    tall = {"type": "image_url", "image_url": {"url": file_data_url(image_dir / "tall.png")}}
    question = {"type": "text", "text": "What is in this picture?"}

    def ask(*parts: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [*parts, question]}]

    pairs = [(ask(image), ask(embeds)), (ask(tall, image), ask(tall, embeds))]
    bounded: dict[str, tuple[str | None, Any]] = {}
    plain_prompt = 0
    for deployment in (deployed[p] for p in patterns):
        client = openai.OpenAI(base_url=f"{deployment.base_url}/v1", api_key="unused")
        name = deployment.model_path.name
        for with_image, with_embeds in pairs:
            expected = _complete(client, name, with_image)
            plain_prompt = plain_prompt or expected[2]
            before = Counter(image_gets)
            assert _complete(client, name, with_embeds) == expected, deployment.pattern
            assert _stream(client, name, with_embeds) == expected[0], deployment.pattern
            assert Counter(image_gets) == before, "an embedding was fetched"
        again = client.chat.completions.create(
            model=name, messages=ask(embeds), max_tokens=1, temperature=0
        )
        details = again.usage.prompt_tokens_details if again.usage else None
        assert details is not None and details.cached_tokens, deployment.pattern
        if "encode" in deployment.processes:
            # Only a request with an image to encode reaches the encode worker: the tall
            # image after the embedding, a prefix no request has cached (in the order sent
            # above, the prefix cache covers it and the encoder is skipped).
            mixed = client.chat.completions.create(
                model=name, messages=ask(embeds, tall), max_tokens=1, temperature=0
            )
            # The encode worker logs a request once its stream has ended, after the answer.
            logged = functools.partial(_logged, deployment, "encode", mixed.id)
            wait_until(logged, what="the mixed request in the encode log")
            assert again.id not in deployment.log("encode")
        if not resizes:
            continue
        # Pixel bounds per request (inside every family's) reach whoever preprocesses.
        small = client.chat.completions.create(
            model=name,
            messages=ask(image),
            max_tokens=MAX_TOKENS,
            temperature=0,
            extra_body={"mm_processor_kwargs": {"max_pixels": 65_536}},
        )
        assert small.usage is not None and small.usage.prompt_tokens < plain_prompt
        bounded[deployment.pattern] = (small.choices[0].message.content, small.usage)
    assert all(result == bounded["agg"] for result in bounded.values()), bounded


@pytest.mark.parametrize("deployed", ["qwen2_vl"], indirect=True)
def test_an_image_named_by_its_id_gives_the_images_tokens(
    deployed: dict[str, Deployment], image_server: str, image_gets: Counter[str]
) -> None:
    """In every pattern a part carrying only the uuid of an image sent before answers as the
    image did, with nothing fetched; another API key cannot use the id, and once the
    deployment's caches are cleared the id is gone (400 media_id.gone: send it again)."""
    url = f"{image_server}/photo.jpg"
    question = {"type": "text", "text": "What is in this picture?"}

    def ask(part: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [part, question]}]

    named = ask({"type": "image_url", "image_url": {"url": url}, "uuid": "photo-1"})
    by_id = ask({"type": "image_url", "uuid": "photo-1"})
    results: dict[str, tuple] = {}
    for deployment in deployed.values():
        base = f"{deployment.base_url}/v1"
        client = openai.OpenAI(base_url=base, api_key="tenant-a", max_retries=0)
        name = deployment.model_path.name
        results[deployment.pattern] = _complete(client, name, named)
        before = Counter(image_gets)
        assert _complete(client, name, by_id) == results[deployment.pattern]
        assert _stream(client, name, by_id) == results[deployment.pattern][0]
        assert Counter(image_gets) == before, "the image was fetched again"
        other = openai.OpenAI(base_url=base, api_key="tenant-b", max_retries=0)
        with pytest.raises(openai.BadRequestError) as unknown:
            _complete(other, name, by_id)
        assert unknown.value.code == "media_id.unknown"
        reset = httpx.post(f"{deployment.base_url}/reset_prefix_cache", timeout=60)
        assert reset.status_code == 200, reset.text
        with pytest.raises(openai.BadRequestError) as gone:
            _complete(client, name, by_id)
        assert gone.value.code == "media_id.gone", deployment.pattern
    assert all(result == results["agg"] for result in results.values()), results


@pytest.mark.parametrize("deployed", ["gemma3"], indirect=True)
def test_pan_and_scan_gives_the_aggregated_tokens(
    deployed: dict[str, Deployment], image_server: str, image_dir: Path
) -> None:
    """Gemma 3 with pan-and-scan asked per request (`mm_processor_kwargs` through the openai
    client): E/P/D, where the encode worker cuts the crops from the bytes it is sent, answers
    what the aggregated worker answers; the crops add their tokens to the prompt; a knob out
    of the server's bounds is a 400."""
    model_path = deployed["agg"].model_path
    # Crops of at least 100 pixels: two of the photo, two of the tall image, none of the
    # small one.
    panned = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 100}
    content = [
        {"type": "image_url", "image_url": {"url": f"{image_server}/photo.jpg"}},
        {"type": "image_url", "image_url": {"url": file_data_url(image_dir / "tall.png")}},
        {"type": "image_url", "image_url": {"url": file_data_url(image_dir / "small.png")}},
        {"type": "text", "text": "Compare them."},
    ]
    messages: Any = [{"role": "user", "content": content}]
    answers: dict[str, list[tuple]] = {}
    for deployment in (deployed["agg"], deployed["e_p_d"]):
        client = openai.OpenAI(base_url=f"{deployment.base_url}/v1", api_key="unused")

        def ask(kwargs: dict[str, Any] | None, client: openai.OpenAI = client) -> tuple:
            response = client.chat.completions.create(
                model=model_path.name,
                messages=messages,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body=None if kwargs is None else {"mm_processor_kwargs": kwargs},
            )
            assert response.usage is not None
            return response.choices[0].message.content, response.usage.prompt_tokens

        answers[deployment.pattern] = [ask(panned), ask(panned), ask(None)]
        with pytest.raises(openai.BadRequestError) as refused:
            ask({"do_pan_and_scan": True, "pan_and_scan_max_num_crops": 5})
        assert refused.value.code == "invalid_value"
    (text, prompt), again, (_, plain_prompt) = answers["agg"]
    assert text and again == (text, prompt)
    # Four crops of 256 soft tokens between their begin and end of image, and the texts.
    assert prompt > plain_prompt + 4 * 258
    assert answers["e_p_d"] == answers["agg"]
