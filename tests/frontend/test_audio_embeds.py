"""`audio_embeds` parts read against the tiny Qwen2-Audio: a clip's rows are planned as the
shortest clip that makes them, and every malformed embedding is refused naming the part; the
core plans a clip from its grid (embeddings, media ids) only within what a clip makes."""

from __future__ import annotations

import base64
import io
import pickle

import numpy as np
import pytest
import torch
from safetensors.torch import save

from mmserve import media
from mmserve._mm import MediaError
from mmserve.frontend.embeds import EmbedsBudget, load_audio_embeds
from mmserve.frontend.errors import ApiError
from mmserve.media import MediaPolicy
from mmserve.models.family import ModelSpec, resolve_model_spec
from mmserve.protocol import AudioEmbedsPart
from mmserve.tiny.checkpoints import build_tiny_model

PARAM = "messages[0].content[0].audio_embeds"
AUDIO_BOS, AUDIO_EOS = 151647, 151648


@pytest.fixture(scope="module")
def spec() -> ModelSpec:
    return resolve_model_spec(build_tiny_model("qwen2_audio"))


async def _load(spec: ModelSpec, data: bytes) -> tuple[int, tuple[int, int, int], torch.Tensor]:
    part = AudioEmbedsPart(audio_embeds=base64.b64encode(data).decode())
    loaded = await load_audio_embeds(part, spec, MediaPolicy(), PARAM, EmbedsBudget())
    return loaded.mm_hash, loaded.grid_thw, loaded.embeddings


def _npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


async def test_rows_are_planned_as_the_shortest_clip_that_makes_them(spec: ModelSpec) -> None:
    rows = torch.randn(5, spec.hidden_size)
    mm_hash, grid, embeddings = await _load(spec, save({"audio_embeds": rows}))
    # Qwen2-Audio: 19 to 22 valid frames make 5 tokens.
    assert grid == (1, 1, 19) and spec.core.audio_tokens(18) == 4
    assert spec.core.audio_tokens(19) == 5 == spec.core.audio_tokens(22)
    assert torch.equal(embeddings, rows)
    # The same rows as a .npy array of vLLM's [1, tokens, hidden] are the same item.
    assert (await _load(spec, _npy(rows[None].numpy())))[:2] == (mm_hash, grid)
    longest = torch.zeros(spec.core.audio_tokens(3000), spec.hidden_size)
    assert (await _load(spec, save({"audio_embeds": longest})))[1] == (1, 1, 2999)


@pytest.mark.parametrize(
    ("tensors", "code"),
    [
        ({"audio_embeds": torch.randn(5, 65)}, "embeds.shape"),
        ({"audio_embeds": torch.randn(0, 64)}, "embeds.shape"),
        ({"audio_embeds": torch.randn(751, 64)}, "embeds.shape"),
        ({"audio_embeds": torch.randn(64)}, "embeds.shape"),
        ({"audio_embeds": torch.tensor([[float("nan")] * 64])}, "embeds.values"),
        ({"audio_embeds": torch.ones(5, 64, dtype=torch.int32)}, "embeds.dtype"),
        ({"other": torch.randn(5, 64), "more": torch.randn(5, 64)}, "embeds.missing"),
    ],
)
async def test_each_malformed_embedding_is_refused_naming_the_part(
    spec: ModelSpec, tensors: dict[str, torch.Tensor], code: str
) -> None:
    with pytest.raises(ApiError) as caught:
        await _load(spec, save(tensors))
    assert (caught.value.code, caught.value.param) == (code, PARAM)


async def test_pickle_is_refused(spec: ModelSpec) -> None:
    with pytest.raises(ApiError) as caught:
        await _load(spec, pickle.dumps(torch.randn(5, 64)))
    assert caught.value.code == "embeds.format"


def test_a_clip_is_planned_from_its_grid_within_what_a_clip_makes(spec: ModelSpec) -> None:
    """The core plans a clip named by its identity and grid (a media id, an embedding): the
    run its frames make; a grid no clip of the model has is refused."""
    audio = spec.core.audio_token_id
    assert audio is not None
    ids = [1, AUDIO_BOS, audio, AUDIO_EOS, 2]

    def plan(grid: tuple[int, int, int]) -> list[int]:
        planned = media.plan_request_here(
            spec.core, ids, [(7, grid)], MediaPolicy(), count_only=True, modalities=["audio"]
        )
        (item,) = planned.plan.media
        assert (item.mm_hash, item.modality, item.grid_thw) == (7, "audio", grid)
        return planned.plan.token_ids

    assert plan((1, 1, 19)) == [1, AUDIO_BOS, *[audio] * 5, AUDIO_EOS, 2]
    assert len(plan((1, 1, 3000))) == 4 + 750
    for grid in [(1, 1, 2), (1, 1, 3001), (1, 2, 19), (2, 1, 19)]:
        with pytest.raises(MediaError) as caught:
            plan(grid)
        assert caught.value.args[0] == "process.grid", grid
