"""A request with videos and images, planned once by the driver as the frontend runs it (each
video from its headers only): the expanded ids equal transformers' Qwen2-VL, Qwen2.5-VL and
Qwen3-VL processors' for the frames the plan samples (decoded by `decode_video`; Qwen3-VL's
timestamp text before each temporal group, each group an item of its own), the positions
equal the model's `get_rope_index` (Qwen2.5-VL's `second_per_grid_ts` from the processor), and
a video's identity covers its sampling."""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec
import numpy as np
import pytest

from mmserve import _mm
from mmserve.frontend.mm_options import VideoRange
from mmserve.kv.pad import pad_value
from mmserve.kv.view import BlockKeys, prompt_block_keys, routing_view
from mmserve.media import MediaPolicy, VideoSettings, plan_request_here
from mmserve.media.text_pieces import TIMESTAMP_PIECES, text_pieces, timestamp_tokens
from mmserve.media.video import video_options
from mmserve.protocol import MMProcessorKwargs, PlannedMedia
from tests.support.images import encode_image
from tests.support.video import FFMPEG, IMAGE, VIDEO, checkpoint, hf_reference, make_video

pytestmark = pytest.mark.skipif(FFMPEG is None, reason="needs the ffmpeg program (make setup)")


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    root = tmp_path_factory.mktemp("clips")
    return {
        "h264": make_video(root / "a.mp4", size="96x64", rate="24", seconds=2.0),
        "vp9": make_video(
            root / "b.webm", size="50x90", rate="25", seconds=1.2, codec="libvpx-vp9"
        ),
        "long": make_video(root / "c.mkv", size="64x48", rate="30", seconds=4.0),
    }


# The families whose processor writes each temporal group after its timestamp text.
QWEN3 = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5")

CASES = [
    # (media in prompt order, request options)
    (["h264"], {}),
    (["h264", "image", "image"], {}),
    (["image", "vp9", "image", "long"], {"fps": 3.0}),
    (["long", "image"], {"num_frames": 8, "max_pixels": 50176}),
    (["vp9", "h264"], {"fps": 1.0, "min_frames": 2}),
]


@pytest.mark.parametrize(
    "family, names, asked",
    [(family, *case) for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl") for case in CASES]
    # Qwen3-VL-MoE and Qwen3.5 plan as Qwen3-VL does: a video, and a video between images,
    # suffice.
    + [(family, *case) for family in ("qwen3_vl_moe", "qwen3_5") for case in CASES[:2]],
)
def test_plan_equals_the_processor_and_get_rope_index(
    family: str, names: list[str], asked: dict[str, Any], clips: dict[str, bytes]
) -> None:
    spec, processor, _ = checkpoint(family)
    if family in QWEN3 and "max_pixels" in asked:
        # Qwen3-VL's bound counts the whole clip, and starts higher.
        asked = {**asked, "max_pixels": 4 * asked["max_pixels"]}
    sizes = iter([(64, 48), (40, 90)])
    media = [
        ("image", encode_image(*next(sizes))) if name == "image" else ("video", clips[name])
        for name in names
    ]
    # Text right before a part, a digit last: the special tokens keep it apart.
    text = "<|im_start|>user\nclip 3" + "then ".join(
        IMAGE if kind == "image" else VIDEO for kind, _ in media
    )
    text += "what happens?<|im_end|>\n<|im_start|>assistant\n"
    settings = VideoRange.of(spec).settings(MMProcessorKwargs(**asked), None)
    planned = plan_request_here(
        spec.core,
        processor.tokenizer(text)["input_ids"],
        [data for _, data in media],
        MediaPolicy(),
        count_only=True,
        keep_bytes=True,
        modalities=[kind for kind, _ in media],
        video=settings,
        text_pieces=text_pieces(processor.tokenizer, spec),
    )
    ids, positions, delta = hf_reference(family, text, media, settings)
    plan = planned.plan
    assert plan.token_ids == ids
    assert plan.positions is not None
    assert np.array_equal(np.array(plan.positions.rows).reshape(3, -1), positions)
    assert plan.positions.delta == delta
    for item, source in zip(plan.media, planned.sources, strict=True):
        kind, data = media[source]
        assert item.modality == kind
        pad = spec.video_token_id if kind == "video" else spec.image_token_id
        assert ids[item.offset : item.end] == [pad] * item.length
        if kind == "video":
            assert item.video == settings.sampling
            own = _mm.plan_video(data, video_options(settings.base, settings.sampling))
            if family not in QWEN3:
                assert item.temporal_group is None
                assert (item.mm_hash, item.grid_thw) == (own["mm_hash"], own["grid_thw"])
                continue
            # One item per temporal group, each with its own identity.
            t, h, w = own["grid_thw"]
            group = item.temporal_group
            assert group is not None and group < t and item.grid_thw == (1, h, w)
            assert item.mm_hash == own["group_mm_hashes"][group] != own["mm_hash"]
            assert planned.sources[plan.media.index(item) - group] == source
    groups = Counter(planned.sources)
    videos = [own_groups(family, data, settings) for kind, data in media if kind == "video"]
    assert [groups[i] for i, (kind, _) in enumerate(media) if kind == "video"] == videos
    # The bytes travel on as fetched, each with its item's first planned item.
    first = [planned.sources.index(i) for i in range(len(media))]
    assert [bytes(planned.data[i] or b"") for i in first] == [data for _, data in media]
    assert all(d is None for i, d in enumerate(planned.data) if i not in first)


def own_groups(family: str, data: bytes, settings: VideoSettings) -> int:
    """The planned items of a video: one per temporal group for Qwen3-VL(-MoE), else one."""
    if family not in QWEN3:
        return 1
    plan = _mm.plan_video(data, video_options(settings.base, settings.sampling))
    return int(plan["grid_thw"][0])


def test_the_same_video_sampled_otherwise_is_another_item(clips: dict[str, bytes]) -> None:
    spec = checkpoint("qwen2_vl")[0]
    video_range = VideoRange.of(spec)
    ids = [1, spec.vision_start_token_id, spec.video_token_id, spec.vision_end_token_id]

    def plan(**asked: Any) -> tuple[int, tuple[int, int, int]]:
        settings = video_range.settings(MMProcessorKwargs(**asked), None)
        planned = plan_request_here(
            spec.core,
            ids,
            [clips["long"]],
            MediaPolicy(),
            count_only=True,
            modalities=["video"],
            video=settings,
        )
        (item,) = planned.plan.media
        return item.mm_hash, item.grid_thw

    base = plan()
    assert plan() == base
    for asked in ({"fps": 1.0}, {"num_frames": 6}, {"max_pixels": 50176}, {"max_frames": 4}):
        assert plan(**asked)[0] != base[0], asked
    # The default's own values, asked for explicitly, are the same item.
    default = msgspec.structs.asdict(video_range.default)
    assert plan(fps=default["fps"], max_frames=default["max_frames"]) == base


def test_routing_keys_follow_the_video_identity(clips: dict[str, bytes]) -> None:
    """The routing view pads a video's run with its identity's pad value, as an image's: the
    same bytes under options that change no grid (min_frames, when fps sampling keeps more
    frames anyway) are another prefix."""
    spec = checkpoint("qwen2_vl")[0]
    video_range = VideoRange.of(spec)
    ids = [1, spec.vision_start_token_id, spec.video_token_id, spec.vision_end_token_id, 2]

    def plan(**asked: Any) -> tuple[PlannedMedia, BlockKeys]:
        settings = video_range.settings(MMProcessorKwargs(**asked), None)
        planned = plan_request_here(
            spec.core, ids, [clips["long"]], MediaPolicy(), count_only=True,
            modalities=["video"], video=settings,
        )  # fmt: skip
        (item,) = planned.plan.media
        view = routing_view(planned.plan.token_ids, planned.plan.media)
        assert set(view.ids[item.offset : item.end].tolist()) == {pad_value(item.mm_hash)}
        return item, prompt_block_keys(planned.plan.token_ids, planned.plan.media, block_size=4)

    item, keys = plan()
    again, same = plan(min_frames=4)
    other, changed = plan(min_frames=2)
    assert item == again and keys == same
    assert other.grid_thw == item.grid_thw and other.mm_hash != item.mm_hash
    # Every block holds some of the video's tokens, so every key changes.
    assert all(a != b for a, b in zip(keys.local_hashes, changed.local_hashes, strict=True))


def test_timestamp_tokens_are_checked_against_the_tokenizer() -> None:
    """The pieces' ids spell each timestamp text as the tokenizer writes it; a tokenizer that
    writes a text otherwise (here one with "12" as a token of its own) is refused."""
    from transformers import AutoTokenizer

    spec = checkpoint("qwen3_vl")[0]
    tokenizer = AutoTokenizer.from_pretrained(spec.path)
    pieces = timestamp_tokens(tokenizer, spec.vision_start_token_id)
    assert set(pieces) == set(TIMESTAMP_PIECES)
    assert all(len(pieces[digit]) == 1 for digit in "0123456789")
    tokenizer.add_tokens(["12"])
    with pytest.raises(ValueError, match="cannot be planned"):
        timestamp_tokens(tokenizer, spec.vision_start_token_id)
