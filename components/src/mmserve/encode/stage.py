"""The encode stage: each planned media item's pixels (preprocessed here in the Rust core from
the bytes the frontend fetched, or sent by the frontend with `--frontend-decoding`), then the
vision tower. A video is decoded at the frames its planned sampling picks
(`media.video.video_options`) into `pixel_values_videos`, once per video: a video planned one
item per temporal group (Qwen3-VL) gives each group its rows. An image planned with its
pan-and-scan crops (Gemma 3) is decoded once, and each crop cut from it and resized here. An
audio clip is decoded at its family's rate and turned into log-mel features in the core
(`_mm.audio_features`, the GIL released), cut to the extractor's chunk as its processor cuts
it.

The plan already says what each item is and where its tokens go; the stage only checks that
what it decoded agrees with it. It encodes the items in state `ENCODE` and reads those in
`REUSE` from the encoder cache (`protocol.ItemState`); the others it leaves. Used by the encode
worker and by a worker or prefill worker started with `--encode`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import torch

from mmserve import _mm, media
from mmserve.encode.peer_pull import PeerPuller, worth_pulling
from mmserve.engines.base import AudioTrack, Engine, EngineError, ItemEmbedding, MediaInput
from mmserve.media.video import checkpoint_video_options, video_options
from mmserve.models.family import resolve_model_spec
from mmserve.observability import metrics, nvtx
from mmserve.protocol import ItemState, MediaPayload, PlannedMedia, PreprocessedRequest
from mmserve.transfer import TransferAgent


class EncodeStage:
    def __init__(
        self,
        engine: Engine,
        transfer: TransferAgent,
        model_path: Path,
        component: str,
        puller: PeerPuller | None = None,
    ) -> None:
        self.engine = engine
        self.transfer = transfer
        model = resolve_model_spec(model_path)
        self.spec = model.core
        # The checkpoint's video options, or None for a family whose videos are not planned.
        self.video_base = (
            checkpoint_video_options(Path(model_path), family=self.spec.family)
            if self.spec.takes_video
            else None
        )
        self.component = component
        self.puller = puller

    async def run(self, request: PreprocessedRequest) -> dict[int, ItemEmbedding]:
        """An embedding for each item to encode, by item index: pulled from the peer encoder
        the router named for it (`request.peers`) when that is cheaper, else encoded here;
        read from the encoder cache for an item named by its media id (`REUSE`; left out when
        the cache no longer holds it)."""
        if len(request.payloads) != len(request.plan.media):
            raise EngineError(
                f"{len(request.payloads)} media payloads for {len(request.plan.media)} planned "
                "items"
            )
        reused = await self._reused(request)
        todo = request.items(ItemState.ENCODE)
        pulled = await self._pulled(request, todo)
        todo = [i for i in todo if i not in pulled]
        reused |= pulled
        if not todo:
            return reused
        planned = [request.plan.media[i] for i in todo]
        # With frontend decoding an image's pixels travel, and a video's bytes beside them.
        sent = [i for i in todo if request.payloads[i].pixel_values is not None]
        from_bytes = [i for i in todo if request.payloads[i].pixel_values is None]
        with metrics.timed_stage(self.component, "transfer"):
            loaded = await self._inputs_from_pixels(
                [request.plan.media[i] for i in sent], [request.payloads[i] for i in sent]
            )
        decoded = await self._preprocess(request, from_bytes) if from_bytes else []
        by_index = dict(zip(sent, loaded, strict=True)) | dict(
            zip(from_bytes, decoded, strict=True)
        )
        inputs = [by_index[i] for i in todo]
        with nvtx.nvtx_range(nvtx.ENC_VISION_ENCODE), metrics.timed_stage(self.component, "encode"):
            embeddings = await self.engine.encode(inputs)
        for index, item, embedding in zip(todo, planned, embeddings, strict=True):
            if embedding.num_tokens != item.length:
                raise EngineError(
                    f"media item {index}: the vision tower gave {embedding.num_tokens} rows for "
                    f"the {item.length} tokens the plan holds"
                )
        return reused | dict(zip(todo, embeddings, strict=True))

    async def _pulled(
        self, request: PreprocessedRequest, todo: list[int]
    ) -> dict[int, ItemEmbedding]:
        """The items of `todo` pulled from a peer encoder, kept in this encoder's cache as if
        encoded here (so the routers learn it holds them)."""
        if self.puller is None or not request.peers:
            return {}
        cost = self.engine.vision_cost()
        holders = {
            i: holder
            for i, holder in request.peers.items()
            if i in todo and worth_pulling(request.plan.media[i].length, cost)
        }
        if not holders:
            return {}
        pulled = await self.puller.pull(request.request_id, holders, request.plan.media)
        self.engine.store_embeddings(list(pulled.values()))
        return pulled

    async def _reused(self, request: PreprocessedRequest) -> dict[int, ItemEmbedding]:
        """The embeddings the encoder cache holds for the items named by their media id
        alone; one it no longer holds stays without (the language hop's prefix cache may
        hold its tokens)."""
        indices = request.items(ItemState.REUSE)
        if not indices:
            return {}
        items = [request.plan.media[i] for i in indices]
        cached = await self.engine.cached_embeddings([(i.mm_hash, i.grid_thw) for i in items])
        return {i: e for i, e in zip(indices, cached, strict=True) if e is not None}

    async def _preprocess(
        self, request: PreprocessedRequest, indices: list[int]
    ) -> list[MediaInput]:
        """Pixels for the request's items at `indices` from their bytes; a video planned one
        item per temporal group is decoded once, its bytes read from its group 0's payload,
        and each group gets its rows; an image's crops read the image's bytes
        (`PlannedMedia.source`)."""
        plan = request.plan
        planned = [plan.media[i] for i in indices]
        carriers = [plan.source_of(i) for i in indices]
        for index, carrier in zip(indices, carriers, strict=True):
            if not 0 <= carrier < len(plan.media) or plan.media[carrier].source is not None:
                raise EngineError(
                    f"media item {index}: the item that carries its bytes is not planned"
                )
        distinct = sorted(set(carriers))
        with metrics.timed_stage(self.component, "transfer"):
            fetched = await asyncio.gather(
                *(self._encoded_bytes(request.payloads[c]) for c in distinct)
            )
        data = dict(zip(distinct, fetched, strict=True))
        with metrics.timed_stage(self.component, "preprocess"):
            images = [i for i, item in enumerate(planned) if item.modality == "image"]
            videos: dict[int, list[int]] = {}  # carrier -> its items' places in `planned`
            for position, item in enumerate(planned):
                if item.modality == "video":
                    videos.setdefault(carriers[position], []).append(position)
            clips = [i for i, item in enumerate(planned) if item.modality == "audio"]
            # Videos served with their own audio track: the track is a clip of the same bytes.
            tracked = [i for i, item in enumerate(planned) if _with_track(item)]
            image_pixels, video_pixels, clip_features, track_features = await asyncio.gather(
                self._images(
                    [planned[i] for i in images],
                    [data[carriers[i]] for i in images],
                    [carriers[i] for i in images],
                ),
                asyncio.gather(
                    *(
                        self._video(planned[places[0]], data[carrier], request.deadline)
                        for carrier, places in videos.items()
                    )
                ),
                self._audio([data[carriers[i]] for i in clips], request.deadline),
                self._audio([data[carriers[i]] for i in tracked], request.deadline),
            )
        processed = dict(zip(images, image_pixels, strict=True))
        processed |= dict(zip(clips, clip_features, strict=True))
        for places, (pixels, group_hashes) in zip(videos.values(), video_pixels, strict=True):
            for place in places:
                processed[place] = _group_pixels(pixels, group_hashes, planned[place])
        tracks = {
            place: self._track(plan.token_ids[planned[place].offset : planned[place].end], heard)
            for place, heard in zip(tracked, track_features, strict=True)
        }
        inputs = []
        for position, (index, item) in enumerate(zip(indices, planned, strict=True)):
            pixels = processed[position]
            if (pixels.mm_hash, pixels.grid_thw) != (item.mm_hash, item.grid_thw):
                # The frontend sized the item from its headers; the decoded item disagrees.
                raise EngineError(
                    f"media item {index} ({item.modality}) decodes to grid {pixels.grid_thw} "
                    f"(hash {pixels.mm_hash:016x}); the plan says {item.grid_thw} "
                    f"({item.mm_hash_hex})"
                )
            inputs.append(
                MediaInput(
                    mm_hash=item.mm_hash,
                    pixel_values=torch.from_numpy(pixels.pixel_values),
                    grid_thw=item.grid_thw,
                    modality=item.modality,
                    track=tracks.get(position),
                )
            )
        return inputs

    def _track(self, span: list[int], heard: media.ItemPixels) -> AudioTrack:
        """A video's own audio track (its features `heard`) for the video whose span in the
        plan's ids is `span`: the span's audio tokens must be those the track makes."""
        rows = torch.eq(torch.tensor(span), self.spec.audio_token_id or -1)
        valid, planned = heard.grid_thw[2], int(rows.sum())
        if planned != self.spec.audio_tokens(valid):
            raise EngineError(
                f"a video's audio track decodes to {valid} feature frames "
                f"({self.spec.audio_tokens(valid)} tokens); the plan holds {planned}"
            )
        features = torch.from_numpy(heard.pixel_values)
        return AudioTrack(features=features, grid_thw=heard.grid_thw, rows=rows)

    async def _images(
        self, planned: list[PlannedMedia], data: list[bytes], carriers: list[int]
    ) -> list[media.ItemPixels]:
        """Pixels of the `planned` images, each with its identity as `mm_hash`: one batch per
        pixel bounds (a request's images share them); an image planned with pan-and-scan on
        is preprocessed with its crops, once per image (`carriers`: the request's index of
        the image each item is, or is a crop of)."""
        processed: dict[int, media.ItemPixels] = {}
        panned = [i for i, item in enumerate(planned) if item.pan_and_scan is not None]
        by_image: dict[int, list[media.ItemPixels]] = {}
        for i in panned:
            knobs, carrier = planned[i].pan_and_scan, carriers[i]
            if carrier not in by_image:
                spec = self.spec.with_pan_and_scan(knobs)
                by_image[carrier] = await media.preprocess_with_crops(spec, data[i])
            parts = by_image[carrier]
            part = planned[i].crop or 0
            if part >= len(parts):
                raise EngineError(
                    f"the plan names crop {part} of an image that has {len(parts) - 1} crops"
                )
            processed[i] = parts[part]
        for bounds in {item.pixel_bounds for item in planned if item.pan_and_scan is None}:
            group = [
                i
                for i, item in enumerate(planned)
                if item.pixel_bounds == bounds and item.pan_and_scan is None
            ]
            done = await media.preprocess_items(self.spec, [data[i] for i in group], bounds)
            processed |= dict(zip(group, done, strict=True))
        return [processed[i] for i in range(len(planned))]

    async def _video(
        self, item: PlannedMedia, data: bytes, deadline: float
    ) -> tuple[media.ItemPixels, list[int]]:
        """`pixel_values_videos` of one video, sampled and sized as planned, with its identity
        as `mm_hash`, and the identity of each temporal group where the family plans one item
        per group; decoded in a worker thread (the core releases the GIL), cut off at the
        request's deadline."""
        if self.video_base is None:
            raise EngineError(
                f"a video reached an encoder whose {self.spec.family} checkpoint takes none"
            )
        if item.video is None:
            raise EngineError("a video item of the plan carries no sampling")
        options = video_options(self.video_base, item.video)
        plan, pixel_values = await asyncio.to_thread(
            _mm.process_video, data, options, timeout_s=max(deadline - time.time(), 0.0)
        )
        t, h, w = plan["grid_thw"]
        pixels = media.ItemPixels(
            mm_hash=int(plan["mm_hash"]), pixel_values=pixel_values, grid_thw=(t, h, w)
        )
        return pixels, plan["group_mm_hashes"]

    async def _audio(self, data: list[bytes], deadline: float) -> list[media.ItemPixels]:
        """Each clip's `input_features` with its identity as `mm_hash` and its grid
        `(1, 1, valid frames)`: decoded and featurized in one core call (fanned out over its
        pool, the GIL released), cut off at the request's deadline."""
        if not data:
            return []
        extractor = self.spec.audio_extractor
        if extractor is None:
            raise EngineError(
                f"an audio clip reached an encoder whose {self.spec.family} checkpoint takes none"
            )
        featurized = await asyncio.to_thread(
            _mm.audio_features,
            data,
            extractor,
            timeout_s=max(deadline - time.time(), 0.0),
        )
        return [
            media.ItemPixels(
                mm_hash=extractor.identity(clip), pixel_values=features, grid_thw=(1, 1, valid)
            )
            for clip, (_, features, valid, _) in zip(data, featurized, strict=True)
        ]

    async def _encoded_bytes(self, payload: MediaPayload) -> bytes:
        if payload.data is not None:
            return payload.data
        if payload.encoded is not None:
            encoded = await self.transfer.fetch(payload.encoded)
            return encoded.numpy().tobytes()
        raise EngineError("a media payload carries neither bytes nor pixels")

    async def _inputs_from_pixels(
        self, planned: list[PlannedMedia], payloads: list[MediaPayload]
    ) -> list[MediaInput]:
        async def load(item: PlannedMedia, payload: MediaPayload) -> MediaInput:
            assert payload.pixel_values is not None
            pixels = await self.transfer.fetch(payload.pixel_values)
            return MediaInput(
                mm_hash=item.mm_hash,
                pixel_values=pixels,
                grid_thw=item.grid_thw,
                modality=item.modality,
            )

        return list(
            await asyncio.gather(*(load(i, p) for i, p in zip(planned, payloads, strict=True)))
        )


def _with_track(item: PlannedMedia) -> bool:
    """Whether `item` is a video served with its own audio track (`use_audio_in_video`)."""
    return item.video is not None and item.video.use_audio_in_video


def _group_pixels(
    video: media.ItemPixels, group_hashes: list[int], item: PlannedMedia
) -> media.ItemPixels:
    """The pixels of the part of `video` that `item` stands for: the whole video, or one
    temporal group's rows of `pixel_values_videos` with its grid `(1, h, w)` and identity
    (`group_hashes`, one per group)."""
    group = item.temporal_group
    if group is None:
        return video
    _, h, w = video.grid_thw
    if group >= len(group_hashes):
        raise EngineError(
            f"the plan names temporal group {group} of a video that decodes to "
            f"{len(group_hashes)} groups"
        )
    rows = h * w
    return media.ItemPixels(
        mm_hash=group_hashes[group],
        pixel_values=video.pixel_values[group * rows : (group + 1) * rows],
        grid_thw=(1, h, w),
    )
