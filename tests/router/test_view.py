"""The routing view of a request plan: media runs overwritten with pad values, per-block media
lists, and the block hashes Dynamo computes for the same view."""

from __future__ import annotations

import pytest
from dynamo.llm import compute_block_hash_for_seq

from mmserve.kv.pad import PadScheme, pad_value
from mmserve.kv.view import routing_view
from mmserve.protocol import PlannedMedia

IMAGE_PAD = 151655  # Qwen2-VL <|image_pad|>
A, B = 0xAAAA_0000_0000_0001, 0xBBBB_0000_0000_0002


def item(mm_hash: int, offset: int, length: int) -> PlannedMedia:
    return PlannedMedia(mm_hash=mm_hash, offset=offset, length=length, grid_thw=(1, 2, 2 * length))


def test_media_runs_become_pad_runs() -> None:
    ids = [1, 2, *[IMAGE_PAD] * 5, 3, *[IMAGE_PAD] * 3, 4]
    view = routing_view(ids, [item(A, 2, 5), item(B, 8, 3)])
    pa, pb = pad_value(A), pad_value(B)
    assert view.ids.tolist() == [1, 2, *[pa] * 5, 3, *[pb] * 3, 4]
    assert view.media_spans == ((A, 2, 7), (B, 8, 11))
    # 12 tokens in blocks of 4: A spans [2, 7) -> blocks 0, 1; B spans [8, 11) -> block 2.
    assert view.block_mm_infos(4) == [(A,), (A,), (B,)]


def test_the_view_reads_the_plan_not_the_token_ids() -> None:
    # Whatever ids the run holds, the plan's placement decides what is media.
    planned = [item(A, 1, 3)]
    assert (
        routing_view([9, IMAGE_PAD, IMAGE_PAD, IMAGE_PAD, 9], planned).ids.tolist()
        == routing_view([9, 5, 6, 7, 9], planned).ids.tolist()
    )


def test_block_touched_by_two_items_lists_both() -> None:
    view = routing_view([IMAGE_PAD] * 6, [item(A, 0, 3), item(B, 3, 3)])
    # A at [0, 3), B at [3, 6): block 0 holds both, block 1 only B.
    assert view.block_mm_infos(4) == [(A, B), (B,)]


def test_hashes_equal_dynamo_on_the_same_view() -> None:
    ids = [7] * 20 + [IMAGE_PAD] * 64 + [8] * 30
    view = routing_view(ids, [item(A, 20, 64)])
    dynamo_infos = [
        {"mm_objects": [{"mm_hash": h, "offsets": []} for h in hashes]} if hashes else None
        for hashes in view.block_mm_infos(16)
    ]
    expected = compute_block_hash_for_seq(view.ids.tolist(), 16, dynamo_infos)
    assert view.block_hashes(16) == expected
    assert len(expected) == (20 + 64 + 30) // 16


def test_same_text_different_image_changes_the_image_blocks() -> None:
    ids = [5] * 32 + [IMAGE_PAD] * 32 + [6] * 16
    hashes_a = routing_view(ids, [item(A, 32, 32)]).block_hashes()
    hashes_b = routing_view(ids, [item(B, 32, 32)]).block_hashes()
    # Blocks 0-1 are text, 2-3 the image, 4 text again. Local hashes are not chained, so the
    # last block is equal; the index matches by position and stops at the first difference.
    assert hashes_a[:2] == hashes_b[:2]
    assert hashes_a[2] != hashes_b[2] and hashes_a[3] != hashes_b[3]
    assert hashes_a[4] == hashes_b[4]


def test_wide_scheme_changes_the_view() -> None:
    ids = [IMAGE_PAD] * 8
    dynamo = routing_view(ids, [item(A, 0, 8)])
    wide = routing_view(ids, [item(A, 0, 8)], scheme=PadScheme.SGLANG_WIDE)
    assert len(set(wide.ids.tolist())) == 4
    assert dynamo.ids.tolist() != wide.ids.tolist()


@pytest.mark.parametrize("offset, length", [(1, 4), (-1, 1), (3, 1)])
def test_runs_must_fit_in_the_prompt(offset: int, length: int) -> None:
    with pytest.raises(ValueError, match="does not fit"):
        routing_view([1, 2, 3], [item(A, offset, length)])


def test_text_only_prompt_is_unchanged() -> None:
    view = routing_view(list(range(40)))
    assert view.ids.tolist() == list(range(40))
    assert view.media_spans == ()
    assert view.block_mm_infos(16) == [(), (), ()]


def test_a_gemma3_plan_pads_only_its_soft_tokens_and_hashes_as_dynamo() -> None:
    """Gemma 3's plan keeps `<start_of_image>`/`<end_of_image>` as text around each run of 256
    soft tokens: only the run is padded, with values above Gemma's 262,208-row vocabulary, and
    the block hashes over that view are Dynamo's."""
    import json

    from mmserve import _mm

    boi, eoi, soft = 255_999, 256_000, 262_144
    config = {
        "model_type": "gemma3",
        "mm_tokens_per_image": 256,
        "boi_token_index": boi,
        "eoi_token_index": eoi,
        "image_token_index": soft,
        "vision_config": {"image_size": 448, "patch_size": 14},
    }
    preprocessor = {"size": {"height": 448, "width": 448}, "resample": 2}
    spec = _mm.spec_from_hf_configs(json.dumps(preprocessor), json.dumps(config))
    ids = [2, 105, 7, 108, boi, 108, 9, 108, boi, 108, 106]
    hashes = (A, B)
    plan = _mm.process(spec, ids, [(h, (1, 32, 32)) for h in hashes], count_only=True)
    expanded = list(plan.input_ids)
    media = [
        item(mm_hash, start, end - start)
        for mm_hash, (start, end) in zip(hashes, plan.offsets, strict=True)
    ]
    view = routing_view(expanded, media).ids.tolist()
    for (start, end), mm_hash in zip(plan.offsets, hashes, strict=True):
        assert (expanded[start - 1], expanded[end]) == (boi, eoi) and end - start == 256
        assert view[start:end] == [pad_value(mm_hash)] * 256
        assert pad_value(mm_hash) >= 262_208
    text = [i for i in range(len(view)) if not any(s <= i < e for s, e in plan.offsets)]
    assert [view[i] for i in text] == [expanded[i] for i in text]
    infos = [
        {"mm_objects": [{"mm_hash": h, "offsets": []} for h in block]} if block else None
        for block in routing_view(expanded, media).block_mm_infos(16)
    ]
    expected = compute_block_hash_for_seq(view, 16, infos)
    assert routing_view(expanded, media).block_hashes(16) == expected


def test_a_qwen3_5_plan_pads_its_image_runs_above_its_vocabulary_and_hashes_as_dynamo() -> None:
    """Qwen3.5's plan expands `<|image_pad|>` (248056) between its vision start and end
    (248053, 248054), as Qwen3-VL's does at Qwen2's ids: only the run is padded, with values
    above its 248,320-row vocabulary, and the block hashes over that view are Dynamo's."""
    import json

    from mmserve import _mm

    start, end, image = 248_053, 248_054, 248_056
    config = {
        "model_type": "qwen3_5",
        "image_token_id": image,
        "video_token_id": 248_057,
        "vision_start_token_id": start,
        "vision_end_token_id": end,
        "vision_config": {"patch_size": 16, "spatial_merge_size": 2},
    }
    preprocessor = {"patch_size": 16, "merge_size": 2, "min_pixels": 65536}
    spec = _mm.spec_from_hf_configs(json.dumps(preprocessor), json.dumps(config))
    ids = [248_045, 7, start, image, end, 9, start, image, end, 248_046]
    hashes = (A, B)
    grids = [(1, 16, 24), (1, 32, 16)]
    plan = _mm.process(spec, ids, list(zip(hashes, grids, strict=True)), count_only=True)
    expanded = list(plan.input_ids)
    media = [
        item(mm_hash, offset, stop - offset)
        for mm_hash, (offset, stop) in zip(hashes, plan.offsets, strict=True)
    ]
    view = routing_view(expanded, media)
    for (offset, stop), mm_hash in zip(plan.offsets, hashes, strict=True):
        assert (expanded[offset - 1], expanded[stop]) == (start, end)
        assert view.ids.tolist()[offset:stop] == [pad_value(mm_hash)] * (stop - offset)
        assert pad_value(mm_hash) >= 248_320
    infos = [
        {"mm_objects": [{"mm_hash": h, "offsets": []} for h in block]} if block else None
        for block in view.block_mm_infos(16)
    ]
    assert view.block_hashes(16) == compute_block_hash_for_seq(view.ids.tolist(), 16, infos)
