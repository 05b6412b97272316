"""The routing view: placeholder expansion, in-place overwrite and per-block media lists."""

from __future__ import annotations

import pytest
from dynamo.llm import compute_block_hash_for_seq

from mmserve.router.pad import PadScheme, pad_value
from mmserve.router.view import RoutingMedia, routing_view

IMAGE_PAD = 151655  # Qwen2-VL <|image_pad|>
A, B = 0xAAAA_0000_0000_0001, 0xBBBB_0000_0000_0002


def test_placeholders_expand_to_pad_runs() -> None:
    ids = [1, 2, IMAGE_PAD, 3, IMAGE_PAD, 4]
    view = routing_view(
        ids,
        [RoutingMedia(A, 5), RoutingMedia(B, 3)],
        placeholder_id=IMAGE_PAD,
    )
    pa, pb = pad_value(A), pad_value(B)
    assert view.ids.tolist() == [1, 2, *[pa] * 5, 3, *[pb] * 3, 4]
    assert view.media_spans == ((A, 2, 7), (B, 8, 11))
    # 12 tokens in blocks of 4: A spans [2, 7) -> blocks 0, 1; B spans [8, 11) -> block 2.
    assert view.block_mm_infos(4) == [(A,), (A,), (B,)]


def test_expanded_ids_are_overwritten_at_offsets() -> None:
    expanded = [1, 2, *[IMAGE_PAD] * 5, 3, *[IMAGE_PAD] * 3, 4]
    from_offsets = routing_view(
        expanded, [RoutingMedia(A, 5, offset=2), RoutingMedia(B, 3, offset=8)]
    )
    from_placeholders = routing_view(
        [1, 2, IMAGE_PAD, 3, IMAGE_PAD, 4],
        [RoutingMedia(A, 5), RoutingMedia(B, 3)],
        placeholder_id=IMAGE_PAD,
    )
    assert from_offsets.ids.tolist() == from_placeholders.ids.tolist()
    assert from_offsets.media_spans == from_placeholders.media_spans


def test_block_touched_by_two_items_lists_both() -> None:
    view = routing_view(
        [IMAGE_PAD, IMAGE_PAD], [RoutingMedia(A, 3), RoutingMedia(B, 3)], placeholder_id=IMAGE_PAD
    )
    # A at [0, 3), B at [3, 6): block 0 holds both, block 1 only B.
    assert view.block_mm_infos(4) == [(A, B), (B,)]


def test_hashes_equal_dynamo_on_the_same_view() -> None:
    ids = [7] * 20 + [IMAGE_PAD] + [8] * 30
    view = routing_view(ids, [RoutingMedia(A, 64)], placeholder_id=IMAGE_PAD)
    dynamo_infos = [
        {"mm_objects": [{"mm_hash": h, "offsets": []} for h in hashes]} if hashes else None
        for hashes in view.block_mm_infos(16)
    ]
    expected = compute_block_hash_for_seq(view.ids.tolist(), 16, dynamo_infos)
    assert view.block_hashes(16) == expected
    assert len(expected) == (20 + 64 + 30) // 16


def test_same_text_different_image_changes_the_image_blocks() -> None:
    ids = [5] * 32 + [IMAGE_PAD] + [6] * 16
    view_a = routing_view(ids, [RoutingMedia(A, 32)], placeholder_id=IMAGE_PAD)
    view_b = routing_view(ids, [RoutingMedia(B, 32)], placeholder_id=IMAGE_PAD)
    hashes_a, hashes_b = view_a.block_hashes(), view_b.block_hashes()
    # Blocks 0-1 are text, 2-3 the image, 4 text again. Local hashes are not chained, so the
    # last block is equal; the index matches by position and stops at the first difference.
    assert hashes_a[:2] == hashes_b[:2]
    assert hashes_a[2] != hashes_b[2] and hashes_a[3] != hashes_b[3]
    assert hashes_a[4] == hashes_b[4]


def test_wide_scheme_changes_the_view() -> None:
    ids = [IMAGE_PAD]
    dynamo = routing_view(ids, [RoutingMedia(A, 8)], placeholder_id=IMAGE_PAD)
    wide = routing_view(
        ids, [RoutingMedia(A, 8)], placeholder_id=IMAGE_PAD, scheme=PadScheme.SGLANG_WIDE
    )
    assert len(set(wide.ids.tolist())) == 4
    assert dynamo.ids.tolist() != wide.ids.tolist()


def test_placeholder_count_must_match_items() -> None:
    with pytest.raises(ValueError, match="2 placeholder tokens"):
        routing_view([IMAGE_PAD, IMAGE_PAD], [RoutingMedia(A, 4)], placeholder_id=IMAGE_PAD)


def test_offsets_must_fit_and_not_be_mixed() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        routing_view([1, 2, 3], [RoutingMedia(A, 4, offset=1)])
    with pytest.raises(ValueError, match="every media item"):
        routing_view(
            [IMAGE_PAD, 1, 2],
            [RoutingMedia(A, 1, offset=1), RoutingMedia(B, 1)],
            placeholder_id=IMAGE_PAD,
        )
    with pytest.raises(ValueError, match="placeholder token id"):
        routing_view([IMAGE_PAD], [RoutingMedia(A, 1)])


def test_text_only_prompt_is_unchanged() -> None:
    view = routing_view(list(range(40)), [], placeholder_id=IMAGE_PAD)
    assert view.ids.tolist() == list(range(40))
    assert view.media_spans == ()
    assert view.block_mm_infos(16) == [(), (), ()]
