"""The `hf` engine: transformers' model code (Qwen-VL, Gemma 3), on CPU or GPU, from any local
checkpoint.

The engine drives the model's parts itself rather than `generate`: the vision tower (via
`get_image_features`, and `get_video_features` for a video's `pixel_values_videos`), the
embedding table, the language model with explicit positions (the request plan's M-RoPE
positions, which tests prove equal to the model's own `get_rope_index`; Gemma 3: 1-D, through
the model's own forward so that its bidirectional image mask is the model's) and a
cache (attention KV per layer; Qwen3.5's linear-attention layers hold their convolution and
recurrent states instead, in transformers' `LinearAttentionLayer`), and the LM head. That is
what lets a prefill start from precomputed embeddings and from cached prefix blocks, and a
decode continue from a cache made in another process, while giving the tokens of
`generate(pixel_values=...)` (and of `pixel_values_videos`: a video's run of `<|video_pad|>`
tokens takes its rows as an image's run does).

Every model call runs on one dedicated thread per engine, so the asyncio loop never blocks and
the model, the prefix cache and the encoder cache have a single owner. Decode streams submit one
step at a time to that thread; its FIFO queue interleaves active streams round-robin.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from mmserve.engines.audio_tower import audio_rows, thinker_audio_rows
from mmserve.engines.base import (
    Admission,
    Embeddings,
    EngineError,
    EngineRequest,
    ItemEmbedding,
    KvHandle,
    MediaInput,
    MediaModality,
)
from mmserve.engines.caching import CachingEngine
from mmserve.engines.defaults import DEFAULT_ENCODER_CACHE_BYTES, DEFAULT_MAX_QUEUE, LogprobsMode
from mmserve.engines.encoder_cache import EncoderCache
from mmserve.engines.logits import Sampler, next_tokens, read_prompt_logprobs
from mmserve.engines.prefix_cache import PrefixCache
from mmserve.engines.sampling import Step, StopRules, check_sampling, stream_completion
from mmserve.grammar.base import CompiledGrammar
from mmserve.grammar.cache import GrammarCache
from mmserve.grammar.constraint import Constraint
from mmserve.grammar.defaults import DEFAULT_COMPILE_TIMEOUT_S
from mmserve.kv.hashing import DEFAULT_BLOCK_SIZE
from mmserve.kv.pad import PadScheme
from mmserve.kv.view import prompt_block_keys, reusable_blocks
from mmserve.models.family import ModelSpec, load_model, resolve_model_spec
from mmserve.models.tokenizer import shared_tokenizer
from mmserve.protocol import (
    BootstrapInfo,
    FirstToken,
    PrefillDone,
    SamplingParams,
    StopConditions,
    TokenChunk,
    TokenLogprob,
)

Result = TypeVar("Result")

DEFAULT_PREFIX_CACHE_BYTES = 1 << 30
# Prompt positions whose logits are scored at once (`HfEngine._prompt_logprobs`): 256 rows of
# a 152k vocabulary are 155 MB of float32.
_PROMPT_ROWS = 256


@dataclass
class _KvState:
    """What decode needs beyond the handle: the cache, the M-RoPE offset, each choice's
    token choice, and which choice each row of the cache's batch holds (the prompt's one row
    until decode copies it for each choice)."""

    cache: Any  # transformers Cache
    rope_delta: int
    samplers: list[Sampler]
    rows: list[int] | None = None  # None: the prompt's one row


def _tensor_bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class HfEngine(CachingEngine[_KvState, torch.Tensor]):
    """A transformers vision-language model behind the engine interface."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        device: str = "cpu",
        dtype: torch.dtype = torch.float32,
        block_size: int = DEFAULT_BLOCK_SIZE,
        prefix_cache_bytes: int | None = DEFAULT_PREFIX_CACHE_BYTES,
        prefix_cache_blocks: int | None = None,
        encoder_cache_bytes: int = DEFAULT_ENCODER_CACHE_BYTES,
        max_queue: int = DEFAULT_MAX_QUEUE,
        pad_scheme: PadScheme = PadScheme.DYNAMO,
        logprobs_mode: LogprobsMode = "raw_logprobs",
        grammar_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        """Load the checkpoint (blocking: use `HfEngine.load` from async code)."""
        self.logprobs_mode: LogprobsMode = logprobs_mode
        self.spec: ModelSpec = resolve_model_spec(model_path)
        self.device = torch.device(device)
        self.dtype = dtype
        self.admission = Admission(max_queue)
        self.pad_scheme = pad_scheme
        model: Any = load_model(self.spec.family, self.spec.path, dtype=dtype)
        self.model = model.to(self.device)
        self.model.eval()
        self.tokenizer = shared_tokenizer(self.spec.path)
        self._inner = self.model.model
        self._text_config = self.model.config.get_text_config()
        self._linear_layers = frozenset(self.spec.linear_attention_layers)
        # With M-RoPE the plan's positions go to the text model itself; with 1-D positions the
        # model's own forward runs, which builds its mask from token_type_ids (Gemma 3's
        # bidirectional attention within each image).
        self._own_forward = self.spec.core.rope == "1d"
        self._attention_layers = [
            index
            for index in range(self._text_config.num_hidden_layers)
            if index not in self._linear_layers
        ]
        self.prefix_cache: PrefixCache[torch.Tensor] = PrefixCache(
            block_size,
            max_bytes=prefix_cache_bytes,
            max_blocks=prefix_cache_blocks,
            payload_bytes=lambda block: _tensor_bytes((block,)),
        )
        self.encoder_cache = EncoderCache(encoder_cache_bytes)
        self.vocab_size: int = self.model.get_output_embeddings().weight.shape[0]
        self.grammars = GrammarCache.for_tokenizer(
            self.tokenizer, self.vocab_size, self.spec.eos_token_ids, grammar_compile_timeout_s
        )
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")

    @classmethod
    async def load(cls, model_path: str | Path, **options: Any) -> HfEngine:
        """Load without blocking the event loop."""
        return await asyncio.to_thread(functools.partial(cls, model_path, **options))

    # -- admission and the model thread --------------------------------------------------------

    async def _call(self, fn: Callable[..., Result], *args: Any) -> Result:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._in_inference_mode, fn, *args)

    @staticmethod
    def _in_inference_mode(fn: Callable[..., Result], *args: Any) -> Result:
        with torch.inference_mode():
            return fn(*args)

    async def _admitted_call(self, fn: Callable[..., Result], *args: Any) -> Result:
        with self.admission():
            return await self._call(fn, *args)

    async def _on_cache_owner(self, fn: Callable[[], Result]) -> Result:
        return await self._call(fn)  # the model thread owns both caches

    # -- encode ---------------------------------------------------------------------------------

    async def encode(self, items: Sequence[MediaInput]) -> list[ItemEmbedding]:
        if not items:
            return []
        return await self._admitted_call(self._encode_sync, list(items))

    def _encode_sync(self, items: list[MediaInput]) -> list[ItemEmbedding]:
        results: list[ItemEmbedding | None] = []
        missing: list[tuple[int, MediaInput]] = []
        for index, item in enumerate(items):
            self._check_media(item)
            cached = self.encoder_cache.get(item.mm_hash, item.grid_thw)
            results.append(cached)
            if cached is None:
                missing.append((index, item))
        if missing:
            towered = self._vision_tower([item for _, item in missing])
            for (index, item), (rows, deepstack) in zip(missing, towered, strict=True):
                embedding = ItemEmbedding(
                    mm_hash=item.mm_hash,
                    grid_thw=item.grid_thw,
                    embeddings=rows.contiguous(),
                    deepstack=tuple(layer.contiguous() for layer in deepstack),
                )
                self.encoder_cache.put(embedding)
                results[index] = embedding
        return [result for result in results if result is not None]

    def _vision_tower(
        self, items: list[MediaInput]
    ) -> list[tuple[torch.Tensor, tuple[torch.Tensor, ...]]]:
        """Each item's rows and deepstack features (empty but for Qwen3-VL), in order. Images
        and videos go through the tower in separate calls, as the model's own forward sends
        them (`get_image_features`, `get_video_features`)."""
        towered: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}
        audio = [i for i, item in enumerate(items) if item.modality == "audio"]
        if audio:
            clips = self._audio_tower([items[i] for i in audio])
            towered |= {index: (rows, ()) for index, rows in zip(audio, clips, strict=True)}
        # Videos served with their own audio track: the track through the audio tower.
        tracked = {i: clip for i, item in enumerate(items) if (clip := item.track_clip())}
        tracks = dict(zip(tracked, self._audio_tower(list(tracked.values())), strict=True))
        for modality in ("image", "video"):
            group = [i for i, item in enumerate(items) if item.modality == modality]
            if not group:
                continue
            output = self._tower_call(modality, [items[i] for i in group])
            deepstack_layers = getattr(output, "deepstack_features", None) or []
            for position, index in enumerate(group):
                towered[index] = (
                    output.pooler_output[position],
                    tuple(layer[position] for layer in deepstack_layers),
                )
        for index, heard in tracks.items():
            track = items[index].track
            assert track is not None
            towered[index] = (track.interleave(towered[index][0], heard), ())
        return [towered[i] for i in range(len(items))]

    def _audio_tower(self, clips: list[MediaInput]) -> list[torch.Tensor]:
        """Each clip's rows from the model's audio tower (its projector's, where separate)."""
        if not clips:
            return []
        if hasattr(self._inner, "multi_modal_projector"):
            return audio_rows(
                self._inner.audio_tower, self._inner.multi_modal_projector, clips, self.dtype
            )
        return thinker_audio_rows(self._inner, clips, self.dtype, self.spec.core.audio_tokens)

    def _tower_call(self, modality: MediaModality, items: list[MediaInput]) -> Any:
        """The tower's output for `items` of one modality: `pooler_output[i]` holds item i's
        rows."""
        if self.spec.vision_input == "image":
            pixel_values = torch.stack([item.pixel_values for item in items])
            return self._inner.get_image_features(
                pixel_values.to(self.device, self.dtype), return_dict=True
            )
        pixel_values = torch.cat([item.pixel_values for item in items]).to(self.device)
        grid = torch.tensor([item.grid_thw for item in items], device=self.device)
        if modality == "video":
            return self._inner.get_video_features(pixel_values, grid, return_dict=True)
        return self._inner.get_image_features(pixel_values, grid, return_dict=True)

    def _check_media(self, item: MediaInput) -> None:
        if item.modality == "audio":
            self._check_audio(item)
            return
        if item.modality == "video":
            self._check_takes_video()
        if (clip := item.track_clip()) is not None:
            self._check_audio(clip)
        t, h, w = item.grid_thw
        merge = self.spec.spatial_merge_size
        if min(t, h, w) <= 0 or h % merge or w % merge:
            raise EngineError(
                f"{item.modality} grid {item.grid_thw} does not fit merge size {merge}"
            )
        if self.spec.vision_input == "image":
            patch = self.spec.patch_size
            if tuple(item.pixel_values.shape) != (3, h * patch, w * patch):
                raise EngineError(
                    f"pixel_values of shape {tuple(item.pixel_values.shape)} do not match grid "
                    f"{item.grid_thw} (one image of 3 x {h * patch} x {w * patch})"
                )
        elif item.pixel_values.ndim != 2 or item.pixel_values.shape[0] != t * h * w:
            raise EngineError(
                f"pixel_values of shape {tuple(item.pixel_values.shape)} do not match grid "
                f"{item.grid_thw} ({t * h * w} patches)"
            )

    def _check_audio(self, item: MediaInput) -> None:
        extractor = self.spec.core.audio_extractor
        if extractor is None:
            raise EngineError(f"{self.spec.family} models take no audio")
        frames = item.pixel_values.shape[-1]
        if (
            item.pixel_values.ndim != 2
            or item.pixel_values.shape[0] != extractor.feature_size
            or not 0 < item.grid_thw[2] <= frames
        ):
            raise EngineError(
                f"input_features of shape {tuple(item.pixel_values.shape)} do not match grid "
                f"{item.grid_thw} ({extractor.feature_size} mel bins, the valid frames last)"
            )

    def _check_takes_video(self) -> None:
        if not self.spec.core.takes_video:
            raise EngineError(f"{self.spec.family} models take no video")

    # -- prefill --------------------------------------------------------------------------------

    async def prefill(
        self,
        request: EngineRequest,
        embeddings: Embeddings = (),
        bootstrap: BootstrapInfo | None = None,
    ) -> KvHandle[_KvState]:
        check_sampling(request.sampling, request.stop)
        request.check_media(embeddings)
        grammar = await self._compiled(request.sampling)
        return await self._admitted_call(self._prefill_sync, request, list(embeddings), grammar)

    async def _compiled(self, sampling: SamplingParams) -> CompiledGrammar | None:
        """The request's grammar compiled (from the cache, or on its threads), or None."""
        if sampling.grammar is None:
            return None
        return await self.grammars.compiled(sampling.grammar)

    def _positions(self, request: EngineRequest) -> tuple[torch.Tensor, int]:
        """Position ids `[3, 1, len]` (the same row three times for 1-D positions) and the
        rope delta, as the plan gives them."""
        length = len(request.token_ids)
        if request.positions is None:
            positions = torch.arange(length, device=self.device).view(1, 1, -1).expand(3, 1, -1)
            return positions, 0
        rows = torch.tensor(request.positions.rows, dtype=torch.long, device=self.device)
        if rows.numel() != 3 * length:
            raise EngineError(
                f"the plan's positions hold {rows.numel()} ids for 3 x {length} prompt tokens"
            )
        return rows.view(3, 1, length), request.positions.delta

    def _prefill_sync(
        self,
        request: EngineRequest,
        embeddings: list[ItemEmbedding | None],
        grammar: CompiledGrammar | None,
    ) -> KvHandle[_KvState]:
        if not request.token_ids:
            raise EngineError("the prompt is empty")
        ids = torch.tensor(request.token_ids, dtype=torch.long, device=self.device)
        if int(ids.max()) >= self.spec.vocab_size or int(ids.min()) < 0:
            raise EngineError(f"token ids must lie in [0, {self.spec.vocab_size})")
        for item, embedding in zip(request.media, embeddings, strict=True):
            if item.modality == "video":
                self._check_takes_video()
            if embedding is not None and item.grid_thw != embedding.grid_thw:
                raise EngineError(f"embedding of grid {embedding.grid_thw} for item {item}")
        positions, rope_delta = self._positions(request)

        block_size = self.prefix_cache.block_size
        keys = prompt_block_keys(request.token_ids, request.media, block_size, self.pad_scheme)
        # Prompt log-probabilities need every position's logits: nothing is reused for them.
        scores_prompt = request.sampling.prompt_logprobs is not None
        blocks = (
            self.prefix_cache.match(keys.seq_hashes, reusable_blocks(len(ids), block_size))
            if self.spec.reuses_prefix_blocks and not scores_prompt
            else []
        )
        cached = len(blocks) * block_size

        cache = self._new_cache()
        if blocks:
            past = torch.cat(blocks, dim=3)  # [layers, 2, kv_heads, cached, head_dim]
            for layer in range(past.shape[0]):
                cache.update(past[layer, 0][None], past[layer, 1][None], layer)

        # Only the uncached suffix runs: its embeddings, with the image rows that fall in it,
        # from the items it reaches (the first may start inside the cached prefix).
        live = request.live_embeddings(embeddings, cached)
        reached = [item for item in request.media if item.end > cached]
        skipped = max(0, cached - reached[0].offset) if reached else 0
        suffix_mask = request.media_mask().to(self.device)[cached:]
        inputs_embeds = self._inner.get_input_embeddings()(ids[None, cached:])
        if live:
            rows = torch.cat([item.embeddings for item in live])[skipped:]
            inputs_embeds[0, suffix_mask] = rows.to(self.device, inputs_embeds.dtype)
        extra = self._deepstack_inputs(request, live, cached)
        if self._own_forward:
            # From the start of the prompt: the model reads the image spans by position.
            extra["token_type_ids"] = request.media_mask().to(self.device, torch.long)[None]
        output = self._text_model(inputs_embeds, positions[:, :, cached:], cache, extra)
        logits = self.model.lm_head(output.last_hidden_state[:, -1])[0]
        prompt_logprobs = (
            self._prompt_logprobs(output.last_hidden_state[0], request) if scores_prompt else []
        )

        if self.spec.reuses_prefix_blocks:
            full_blocks = len(ids) // block_size
            self.prefix_cache.store(
                keys,
                len(blocks),
                [self._block_kv(cache, index) for index in range(len(blocks), full_blocks)],
            )
        samplers = self._samplers(request, grammar=grammar)
        banned = StopRules(request.stop, self.spec.eos_token_ids).banned(len(request.resumed_ids))
        drawn = next_tokens(samplers, logits.expand(len(samplers), -1), banned)
        first_tokens = [FirstToken(token, logprob) for token, logprob in drawn]
        return KvHandle(
            request_id=request.request_id,
            prompt_tokens=len(request.token_ids),
            first_tokens=first_tokens,
            cached_tokens=cached,
            state=_KvState(cache, rope_delta, samplers),
            sampling_seed=samplers[0].seed,
            prompt_logprobs=prompt_logprobs,
            resumed=request.resumed,
        )

    def _prompt_logprobs(self, hidden: torch.Tensor, request: EngineRequest) -> list[TokenLogprob]:
        """The prompt's log-probabilities from its hidden states (`[len, hidden]`, the whole
        prompt's), `_PROMPT_ROWS` positions at a time: a long prompt's logits over a large
        vocabulary are never all in memory at once."""
        top = request.sampling.prompt_logprobs or 0
        ids = request.token_ids
        found: list[TokenLogprob] = []
        for start in range(0, len(ids) - 1, _PROMPT_ROWS):
            end = min(start + _PROMPT_ROWS, len(ids) - 1)
            logits = self.model.lm_head(hidden[start:end])
            found += read_prompt_logprobs(logits, ids[start + 1 : end + 1], top)
        return found

    def _samplers(
        self,
        request: EngineRequest,
        seed: int | None = None,
        grammar: CompiledGrammar | None = None,
    ) -> list[Sampler]:
        """One sampler per choice, all on one seed (`seed`, else the request's, else drawn),
        each with its own matcher of `grammar` (the request's, compiled); a resumed choice's
        has its tokens so far (its matcher past them)."""
        start_after = request.sampling.grammar.start_after if request.sampling.grammar else None

        def sampler(seed: int | None, choice: int) -> Sampler:
            return Sampler(
                request.sampling,
                request.prompt_ids,
                self.vocab_size,
                self.device,
                seed,
                choice,
                self.logprobs_mode,
                None if grammar is None else Constraint(grammar, start_after),
            )

        first = sampler(seed, request.first_choice)
        for token in request.resumed_ids:
            first.observe(token)
        return [first] + [sampler(first.seed, choice) for choice in range(1, request.sampling.n)]

    def _deepstack_inputs(
        self, request: EngineRequest, live: list[ItemEmbedding], cached: int
    ) -> dict[str, Any]:
        """Deepstack features (Qwen3-VL's, Qwen3-Omni's) for the image and video tokens past
        the first `cached`: those of the `live` visual items (an Omni thinker's clips have
        none), the first past its rows inside the cached prefix."""
        if not self.spec.deepstack_layers or not live:
            return {}
        reached = [item for item in request.media if item.end > cached]
        visual = [
            (item, embedding)
            for item, embedding in zip(reached, live, strict=True)
            if item.modality != "audio"
        ]
        if not visual:
            return {}
        skipped = max(0, cached - visual[0][0].offset)
        mask = torch.zeros(len(request.token_ids), dtype=torch.bool)
        for item, _ in visual:
            mask[item.offset : item.end] = True
        features = [
            # In the model's dtype: a client's precomputed features may come in another.
            torch.cat([embedding.deepstack[layer] for _, embedding in visual])[skipped:].to(
                self.device, self.dtype
            )
            for layer in range(len(visual[0][1].deepstack))
        ]
        return {
            "visual_pos_masks": mask[cached:].to(self.device)[None],
            "deepstack_visual_embeds": features,
        }

    def _new_cache(self) -> Any:
        """An empty cache whose every attention layer keeps the whole sequence, and whose
        linear-attention layers keep their states. transformers' own caches keep only a window
        in sliding-window layers; the attention mask applies the window either way, and whole
        layers are what a prefix block or a KV export must hold."""
        from transformers import DynamicCache
        from transformers.cache_utils import Cache, DynamicLayer, LinearAttentionLayer

        if not self._linear_layers:
            return DynamicCache()
        return Cache(
            layers=[
                LinearAttentionLayer() if index in self._linear_layers else DynamicLayer()
                for index in range(self._text_config.num_hidden_layers)
            ]
        )

    def _text_model(
        self, inputs_embeds: torch.Tensor, positions: torch.Tensor, cache: Any, extra: dict
    ) -> Any:
        """The language model over `inputs_embeds` at `positions` (`[3, 1, len]`), extending
        `cache`."""
        if self._own_forward:
            return self._inner(
                inputs_embeds=inputs_embeds,
                position_ids=positions[0],
                cache=cache,
                use_cache=True,
                **extra,
            )
        return self._inner.language_model(
            inputs_embeds=inputs_embeds,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            **extra,
        )

    def _block_kv(self, cache: Any, index: int) -> torch.Tensor:
        """Block `index` of a cache as one tensor `[layers, 2, kv_heads, block, head_dim]`."""
        size = self.prefix_cache.block_size
        window = slice(index * size, (index + 1) * size)
        return torch.stack(
            [
                torch.stack([layer.keys[0, :, window], layer.values[0, :, window]])
                for layer in cache.layers
            ]
        ).clone()

    # -- decode ---------------------------------------------------------------------------------

    def _state(self, kv: KvHandle[_KvState]) -> _KvState:
        if kv.state.cache is None:
            raise EngineError(f"KV handle of request {kv.request_id} is not live in this engine")
        return kv.state

    async def decode(
        self, kv: KvHandle[_KvState], sampling: SamplingParams, stop: StopConditions
    ) -> AsyncIterator[TokenChunk]:
        state = self._state(kv)
        check_sampling(sampling, stop)
        # Decode's own sampling, the prefill's history.
        state.samplers = [
            sampler if sampler.params == sampling else sampler.with_params(sampling)
            for sampler in state.samplers
        ]
        with self.admission():
            try:

                async def step(steps: list[Step]) -> list[tuple[int, TokenLogprob | None]]:
                    return await self._call(self._decode_step, state, steps)

                by_choice = {sampler.choice: sampler for sampler in state.samplers}

                def grammar_ended(choice: int) -> bool:
                    return by_choice[choice].grammar_ended

                async for chunk in stream_completion(
                    kv,
                    stop,
                    self.spec.eos_token_ids,
                    self.tokenizer.backend_tokenizer,
                    step,
                    grammar_ended,
                ):
                    yield chunk
            finally:
                state.cache = None

    def _decode_step(
        self, state: _KvState, steps: list[Step]
    ) -> list[tuple[int, TokenLogprob | None]]:
        """One token for each step's choice, in one batch: the cache holds a row per
        unfinished choice (the prompt's row copied for each on the first step)."""
        choices = [choice for choice, _, _ in steps]
        if state.rows is None:  # the prompt's one row, copied for each choice
            picked, held = [0] * len(choices), 1
        else:  # the rows of the choices still running
            picked, held = [state.rows.index(choice) for choice in choices], len(state.rows)
        if picked != list(range(held)):
            state.cache.reorder_cache(torch.tensor(picked, device=self.device))  # beam search's
        state.rows = choices
        position = state.cache.get_seq_length() + state.rope_delta
        positions = torch.full((3, len(steps), 1), position, dtype=torch.long, device=self.device)
        ids = torch.tensor([[token] for _, token, _ in steps], device=self.device)
        inputs_embeds = self._inner.get_input_embeddings()(ids)
        output = self._text_model(inputs_embeds, positions, state.cache, {})
        logits = self._choices_logits(output.last_hidden_state[:, -1])
        # The choices of a round have made as many tokens: the same ids are banned for all.
        banned = steps[0][2]
        assert all(each == banned for _, _, each in steps)
        by_choice = {sampler.choice: sampler for sampler in state.samplers}
        return next_tokens([by_choice[choice] for choice in choices], logits, banned)

    def _choices_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The language head on one row of `hidden` per running choice. On a CPU, MKL's GEMM
        for a few rows against a wide vocabulary runs at half the speed of the product taken
        vocabulary-first, which reads the weight once: 4 rows on a 152k x 64 head cost 2x one
        row's time, not 3.5x. One row stays transformers' own call (greedy parity)."""
        head = self.model.lm_head
        if len(hidden) == 1 or hidden.device.type != "cpu" or head.bias is not None:
            return head(hidden)
        return torch.mm(head.weight, hidden.T).T.contiguous()

    def release(self, kv: KvHandle[_KvState]) -> None:
        kv.state.cache = None

    # -- KV export / import ---------------------------------------------------------------------

    async def export_kv(self, kv: KvHandle[_KvState]) -> dict[str, torch.Tensor]:
        return await self._call(self._export_sync, kv)

    def _export_sync(self, kv: KvHandle[_KvState]) -> dict[str, torch.Tensor]:
        """The attention layers' KV (`keys`, `values`: `[attention layers, kv_heads, len,
        head_dim]`) and, for a hybrid model, each linear layer's states at the prompt's end
        (`conv_states`: `[linear layers, conv_dim, kernel]`, `recurrent_states`: `[linear
        layers, value heads, key head dim, value head dim]`), with what decode resumes from
        (the M-RoPE offset; the sampler's seed travels in `PrefillDone`)."""
        state = self._state(kv)
        layers = [state.cache.layers[index] for index in self._attention_layers]
        linear_states: dict[str, torch.Tensor] = {}
        if self._linear_layers:
            linear = [state.cache.layers[index] for index in sorted(self._linear_layers)]
            linear_states = {
                "conv_states": torch.stack([layer.conv_states[0][0] for layer in linear]),
                "recurrent_states": torch.stack([layer.recurrent_states[0][0] for layer in linear]),
            }
        return {
            "keys": torch.stack([layer.keys[0] for layer in layers]).cpu().contiguous(),
            "values": torch.stack([layer.values[0] for layer in layers]).cpu().contiguous(),
            **{name: t.cpu().contiguous() for name, t in linear_states.items()},
            "rope_delta": torch.tensor([state.rope_delta], dtype=torch.int64),
        }

    async def import_kv(
        self,
        request: EngineRequest,
        done: PrefillDone,
        tensors: dict[str, torch.Tensor],
        bootstrap: BootstrapInfo | None = None,
    ) -> KvHandle[_KvState]:
        grammar = await self._compiled(request.sampling)
        return await self._call(self._import_sync, request, done, tensors, grammar)

    def _import_sync(
        self,
        request: EngineRequest,
        done: PrefillDone,
        tensors: dict[str, torch.Tensor],
        grammar: CompiledGrammar | None,
    ) -> KvHandle[_KvState]:
        keys, values = tensors["keys"], tensors["values"]
        config = self._text_config
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        attention = self._attention_layers
        expected = (len(attention), config.num_key_value_heads, done.prompt_tokens, head_dim)
        if tuple(keys.shape) != expected or tuple(values.shape) != expected:
            raise EngineError(
                f"imported KV of shape {tuple(keys.shape)} does not fit this model {expected}"
            )
        cache = self._new_cache()
        for layer, index in enumerate(attention):
            cache.update(
                keys[layer][None].to(self.device, self.dtype),
                values[layer][None].to(self.device, self.dtype),
                index,
            )
        self._import_linear_states(cache, tensors)
        # Each choice's matcher past the prefill's first token.
        samplers = self._samplers(request, done.sampling_seed, grammar)
        if len(samplers) != len(done.first_tokens):
            raise EngineError(
                f"the prefill sampled {len(done.first_tokens)} choices for n={len(samplers)}"
            )
        for sampler, first in zip(samplers, done.first_tokens, strict=True):
            sampler.observe(first.token_id)
        return KvHandle(
            request_id=request.request_id,
            prompt_tokens=done.prompt_tokens,
            first_tokens=done.first_tokens,
            cached_tokens=done.cached_tokens,
            state=_KvState(cache, int(tensors["rope_delta"][0]), samplers),
            sampling_seed=samplers[0].seed,
            prompt_logprobs=done.prompt_logprobs,
            resumed=request.resumed,
        )

    def _import_linear_states(self, cache: Any, tensors: dict[str, torch.Tensor]) -> None:
        """Each linear layer's convolution and recurrent states, as `_export_sync` wrote them
        (kept in the exporter's dtype: the recurrent state may be wider than the model's)."""
        if not self._linear_layers:
            return
        conv, recurrent = tensors.get("conv_states"), tensors.get("recurrent_states")
        linear = sorted(self._linear_layers)
        modules = [self._inner.language_model.layers[index].linear_attn for index in linear]
        first = modules[0]
        conv_shape = (len(linear), first.conv_dim, first.conv_kernel_size)
        recurrent_shape = (len(linear), first.num_v_heads, first.head_k_dim, first.head_v_dim)
        if conv is None or recurrent is None:
            raise EngineError("imported KV lacks the linear-attention layers' states")
        if tuple(conv.shape) != conv_shape or tuple(recurrent.shape) != recurrent_shape:
            raise EngineError(
                f"imported linear-attention states of shapes {tuple(conv.shape)} and "
                f"{tuple(recurrent.shape)} do not fit this model {conv_shape}, {recurrent_shape}"
            )
        for position, index in enumerate(linear):
            cache.update_conv_state(conv[position][None].to(self.device), index)
            cache.update_recurrent_state(recurrent[position][None].to(self.device), index)

    # -- lifecycle ---------------------------------------------------------------------------------

    async def close(self) -> None:
        self.admission.close()
        self.grammars.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
