"""The `mock` engine: no model, simulated timing, a real prefix cache and real KV events.

It serves the router, the frontend and every deployment pattern at scale without compute:

- prefill sleeps `prefill_us_per_token` per prompt token the prefix cache does not hold, one
  prefill at a time (as one accelerator runs them), so queueing and cache hits show in TTFT;
- decode sleeps `decode_ms_per_token` per token, streams running side by side (as a batch);
- the prefix cache is `engines.prefix_cache.PrefixCache` with no payloads, keyed by the same
  block hashes as the hf engine (pad values included), with LRU eviction under `cache_blocks`,
  so its KV events are the ones a real engine would publish for the same prompts (none, and
  no hits, for a model with linear-attention layers, as the hf engine);
- tokens are pseudo-random ids seeded by the prompt (its ids and media hashes): the same
  prompt gives the same completion on any worker and in any pattern, and a completion resumed
  on another worker (`EngineRequest.resumed`) goes on with the ids it would have had; under a
  grammar each token is one it allows (`_GrammarDraw`: the end as soon as the grammar may end,
  else one of the allowed single characters, else any allowed token); there is no
  distribution, so temperature, the penalties and `logit_bias` change nothing, and
  log-probabilities are simulated (`simulated_logprob`: deterministic, the chosen token the
  most likely), the prompt's too (`simulated_prompt_logprobs`; such a request reuses no cached
  prefix, as on the hf engine);
- encode sleeps `encode_us_per_token` per embedding row it computes, one encode at a time (as
  one vision tower runs them), then returns
  deterministic embeddings of the right row count (grid / merge^2) keyed by the item's hash;
  a real encoder cache (`engines.encoder_cache.EncoderCache`, `encoder_cache_bytes`) holds them,
  so a repeated item costs nothing and its embedding-cache events are a real engine's;
- export/import move one small tensor (the completion's seed), so P/D works over the transfer
  layer.

Everything runs on the event loop: KV event sinks are called on the loop's thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mmserve.engines.base import (
    Admission,
    Embeddings,
    EngineError,
    EngineRequest,
    ItemEmbedding,
    KvHandle,
    MediaInput,
    VisionCost,
)
from mmserve.engines.caching import CachingEngine
from mmserve.engines.defaults import (
    DEFAULT_CACHE_BLOCKS,
    DEFAULT_DECODE_MS_PER_TOKEN,
    DEFAULT_ENCODE_US_PER_TOKEN,
    DEFAULT_ENCODER_CACHE_BYTES,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PREFILL_US_PER_TOKEN,
)
from mmserve.engines.encoder_cache import EncoderCache
from mmserve.engines.prefix_cache import PrefixCache
from mmserve.engines.sampling import Step, StopRules, check_sampling, stream_completion
from mmserve.grammar.cache import GrammarCache
from mmserve.grammar.constraint import Constraint
from mmserve.grammar.defaults import DEFAULT_COMPILE_TIMEOUT_S
from mmserve.grammar.mask import new_bitmask
from mmserve.kv.hashing import DEFAULT_BLOCK_SIZE
from mmserve.kv.pad import PadScheme
from mmserve.kv.view import prompt_block_keys, reusable_blocks
from mmserve.models.family import ModelSpec, resolve_model_spec
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

EMBEDDING_DIM = 8  # columns of a mock embedding: small, so transfers stay cheap
PSEUDO_TOKENS = (1_000, 100_000)  # ordinary vocabulary ids, far from the special tokens


@dataclass
class _MockKv:
    seed: int  # the completion's pseudo-random stream
    # Each choice's grammar past its tokens so far, by choice (None: free text).
    constraints: dict[int, Constraint] | None = None
    live: bool = True


def _draw(
    tokens: random.Random, banned: frozenset[int], grammar: _GrammarDraw | None = None
) -> int:
    """The next pseudo token, one draw from `tokens` (under a grammar too, so a stream's
    draws line up whatever the grammar); a banned id (a stop id before min_tokens) gives way
    to the next id that is not."""
    low, high = PSEUDO_TOKENS
    token = tokens.randrange(low, high)
    if grammar is not None:
        chosen = grammar.pick(token, banned)
        if chosen is not None:
            return chosen
    for _ in range(min(len(banned), high - low)):
        if token not in banned:
            break
        token = low + (token + 1 - low) % (high - low)
    return token


class _GrammarDraw:
    """A choice's draws under its grammar."""

    def __init__(self, constraint: Constraint, vocab_size: int, characters: np.ndarray) -> None:
        self.constraint = constraint
        self._vocab_size = vocab_size
        self._characters = characters  # the ids of the single printable characters

    def pick(self, draw: int, banned: frozenset[int]) -> int | None:
        """The allowed token `draw` falls on (None: the grammar allows any): a stop token
        where the grammar may end (unless banned and something else is allowed), else one
        of the allowed single characters (short texts end soon), else any allowed token."""
        bitmask = new_bitmask(1, self._vocab_size)
        if not self.constraint.fill(bitmask, 0):
            return None
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
        allowed = np.flatnonzero(bits[: self._vocab_size])
        ends = [token for token in self.constraint.stop_ids if bits[token]]
        if ends and not (banned and not self.constraint.only_end(bitmask[0])):
            return ends[0]
        allowed = allowed[~np.isin(allowed, list(banned))] if banned else allowed
        short = np.intersect1d(allowed, self._characters)
        pool = short if len(short) else allowed
        return int(pool[draw % len(pool)])


def _chosen(token: int, sampling: SamplingParams) -> tuple[int, TokenLogprob | None]:
    """`token` with its simulated log-probabilities where `sampling` asks for them."""
    top = sampling.logprobs
    return token, None if top is None else simulated_logprob(token, top)


def simulated_logprob(token: int, top: int) -> TokenLogprob:
    """The mock's log-probabilities of `token`: a value in (-1, 0] from the id, the chosen token
    first among `top` neighbouring ids, each one less likely than the one before."""
    low, high = PSEUDO_TOKENS
    logprob = -((token * 2654435761) % 1000) / 1000
    neighbours = [low + (token - low + step) % (high - low) for step in range(top)]
    return TokenLogprob(
        token_id=token,
        logprob=logprob,
        top=[(other, logprob - step) for step, other in enumerate(neighbours)],
    )


def _drawn(seed: int, choice: int, sampling: SamplingParams, draws: int) -> random.Random:
    """Choice `choice`'s stream once `draws` tokens were drawn from it."""
    stream = choice_stream(seed, choice, sampling)
    for _ in range(draws):
        stream.randrange(*PSEUDO_TOKENS)
    return stream


def choice_stream(seed: int, choice: int, sampling: SamplingParams) -> random.Random:
    """The pseudo-random tokens of one choice of a completion seeded `seed`: choice 0's
    stream, or with temperature 0 every choice's (greedy choices are one text)."""
    if choice == 0 or sampling.temperature == 0:
        return random.Random(seed)
    return random.Random(f"{seed}/{choice}")


def simulated_prompt_logprobs(token_ids: Sequence[int], top: int) -> list[TokenLogprob]:
    """The mock's log-probabilities of each prompt token after the first: its value as
    `simulated_logprob` gives it, the token the most likely (rank 1, first among `top`), then
    neighbouring pseudo ids, each one less likely than the one before."""
    low, high = PSEUDO_TOKENS
    found = []
    for token in token_ids[1:]:
        logprob = simulated_logprob(token, 0).logprob
        others = [low + (token - low + step) % (high - low) for step in range(1, top)]
        ranked = [(token, logprob)] + [(o, logprob - s) for s, o in enumerate(others, start=1)]
        found.append(TokenLogprob(token_id=token, logprob=logprob, top=ranked[:top], rank=1))
    return found


def prompt_seed(token_ids: Sequence[int], mm_hashes: Sequence[int]) -> int:
    """The seed of a prompt's completion: its ids and its media contents."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    digest.update(np.asarray(mm_hashes, dtype=np.uint64).tobytes())
    return int.from_bytes(digest.digest(), "little") >> 1  # fits an int64 tensor


class MockEngine(CachingEngine[_MockKv, None]):
    """Simulated prefill and decode behind the engine interface."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        cache_blocks: int = DEFAULT_CACHE_BLOCKS,
        prefill_us_per_token: float = DEFAULT_PREFILL_US_PER_TOKEN,
        decode_ms_per_token: float = DEFAULT_DECODE_MS_PER_TOKEN,
        encode_us_per_token: float = DEFAULT_ENCODE_US_PER_TOKEN,
        encoder_cache_bytes: int = DEFAULT_ENCODER_CACHE_BYTES,
        max_queue: int = DEFAULT_MAX_QUEUE,
        pad_scheme: PadScheme = PadScheme.DYNAMO,
        grammar_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ) -> None:
        """Read the checkpoint's spec and tokenizer (blocking: use `MockEngine.load`)."""
        if min(prefill_us_per_token, decode_ms_per_token, encode_us_per_token) < 0:
            raise ValueError("mock encode, prefill and decode times must be >= 0")
        self.spec: ModelSpec = resolve_model_spec(model_path)
        self.tokenizer = shared_tokenizer(self.spec.path)
        self.grammars = GrammarCache.for_tokenizer(
            self.tokenizer, self.spec.vocab_size, self.spec.eos_token_ids, grammar_compile_timeout_s
        )
        # The ids of the single printable characters, for `_GrammarDraw`.
        ids = [self.tokenizer.convert_tokens_to_ids(chr(code)) for code in range(33, 127)]
        unknown = self.tokenizer.unk_token_id
        self._characters = np.array(sorted({i for i in ids if i is not None and i != unknown}))
        self.prefill_s_per_token = prefill_us_per_token / 1e6
        self.decode_s_per_token = decode_ms_per_token / 1e3
        self.encode_s_per_token = encode_us_per_token / 1e6
        self.admission = Admission(max_queue)
        self.pad_scheme = pad_scheme
        self.prefix_cache: PrefixCache[None] = PrefixCache(block_size, max_blocks=cache_blocks)
        self.encoder_cache = EncoderCache(encoder_cache_bytes)
        self._prefill_turn = asyncio.Lock()
        self._encode_turn = asyncio.Lock()

    @classmethod
    async def load(cls, model_path: str | Path, **options: Any) -> MockEngine:
        return await asyncio.to_thread(cls, model_path, **options)

    def _rows(self, item: MediaInput) -> int:
        """The rows the tower would give the item: the plan's count."""
        if item.modality == "audio":
            return self.spec.core.audio_tokens(item.grid_thw[2])
        heard = 0 if item.track is None else self.spec.core.audio_tokens(item.track.grid_thw[2])
        return self.spec.image_token_count(item.grid_thw) + heard

    async def encode(self, items: Sequence[MediaInput]) -> list[ItemEmbedding]:
        for item in items:
            if self._rows(item) <= 0:
                raise EngineError(f"{item.modality} grid {item.grid_thw} has no tokens")
        # Looked up in turn: an item the encode before this one computed is a hit.
        async with self._encode_turn:
            embeddings = []
            computed = 0  # rows the simulated vision tower runs for
            for item in items:
                cached = self.encoder_cache.get(item.mm_hash, item.grid_thw)
                if cached is None:
                    rows = self._rows(item)
                    generator = torch.Generator().manual_seed(item.mm_hash & (2**63 - 1))
                    values = torch.rand((rows, EMBEDDING_DIM), generator=generator)
                    cached = ItemEmbedding(item.mm_hash, item.grid_thw, values)
                    computed += rows
                embeddings.append(cached)
            await asyncio.sleep(computed * self.encode_s_per_token)
            for embedding in embeddings:
                self.encoder_cache.put(embedding)  # once computed: a cancelled one stores nothing
        return embeddings

    def vision_cost(self) -> VisionCost:
        return VisionCost(self.encode_s_per_token, EMBEDDING_DIM * 4)  # float32 rows

    async def prefill(
        self,
        request: EngineRequest,
        embeddings: Embeddings = (),
        bootstrap: BootstrapInfo | None = None,
    ) -> KvHandle[_MockKv]:
        check_sampling(request.sampling, request.stop)
        if not request.token_ids:
            raise EngineError("the prompt is empty")
        request.check_media(embeddings)
        cache = self.prefix_cache
        keys = prompt_block_keys(
            request.token_ids, request.media, cache.block_size, self.pad_scheme
        )
        with self.admission():
            async with self._prefill_turn:
                limit = reusable_blocks(len(request.token_ids), cache.block_size)
                # As the hf engine: a hybrid model neither reuses nor announces blocks.
                reuses = self.spec.reuses_prefix_blocks
                # As the hf engine: a request that scores its prompt reuses nothing.
                scores_prompt = request.sampling.prompt_logprobs is not None
                hits = cache.match(keys.seq_hashes, limit) if reuses and not scores_prompt else []
                cached = len(hits) * cache.block_size
                # An item that came without its embedding must lie in the cached prefix.
                request.live_embeddings(embeddings, cached)
                await asyncio.sleep((len(request.token_ids) - cached) * self.prefill_s_per_token)
                if reuses:
                    stored = cached // cache.block_size
                    cache.store(keys, stored, [None] * (len(keys.seq_hashes) - stored))
        # Of the prompt alone: a resumed completion goes on with its own stream of draws.
        seed = prompt_seed(request.prompt_ids, [item.mm_hash for item in request.media])
        done = len(request.resumed_ids)
        banned = StopRules(request.stop, self.spec.eos_token_ids).banned(done)
        sampling = request.sampling
        choices = range(request.first_choice, request.first_choice + sampling.n)
        # A resumed choice's grammar past its tokens so far.
        histories = {i: list(request.resumed_ids if i == choices[0] else ()) for i in choices}
        constraints = await self._constraints(sampling, histories)
        draws = self._grammar_draws(constraints)
        firsts = [_draw(_drawn(seed, i, sampling, done), banned, draws.get(i)) for i in choices]
        for choice, token in zip(choices, firsts, strict=True):
            if constraints is not None:
                constraints[choice].observe(token)
        prompt_top = sampling.prompt_logprobs
        return KvHandle(
            request_id=request.request_id,
            prompt_tokens=len(request.token_ids),
            first_tokens=[FirstToken(*_chosen(token, sampling)) for token in firsts],
            cached_tokens=cached,
            state=_MockKv(seed, constraints),
            prompt_logprobs=(
                []
                if prompt_top is None
                else simulated_prompt_logprobs(request.token_ids, prompt_top)
            ),
            resumed=request.resumed,
        )

    async def _constraints(
        self, sampling: SamplingParams, histories: dict[int, list[int]]
    ) -> dict[int, Constraint] | None:
        """Each choice's grammar past its tokens so far, by choice; None without a grammar."""
        if sampling.grammar is None:
            return None
        grammar = sampling.grammar
        return {i: await self.grammars.constraint(grammar, t) for i, t in histories.items()}

    def _grammar_draws(self, constraints: dict[int, Constraint] | None) -> dict[int, _GrammarDraw]:
        """Each choice's draws under its grammar, by choice (none without a grammar)."""
        return {
            choice: _GrammarDraw(each, self.spec.vocab_size, self._characters)
            for choice, each in (constraints or {}).items()
        }

    def _state(self, kv: KvHandle[_MockKv]) -> _MockKv:
        if not kv.state.live:
            raise EngineError(f"KV handle of request {kv.request_id} is not live in this engine")
        return kv.state

    async def decode(
        self, kv: KvHandle[_MockKv], sampling: SamplingParams, stop: StopConditions
    ) -> AsyncIterator[TokenChunk]:
        state = self._state(kv)
        check_sampling(sampling, stop)
        with self.admission():
            try:
                resumed = kv.resumed
                first, done = (
                    (0, 0) if resumed is None else (resumed.choice, len(resumed.token_ids))
                )
                # Past the draws of the tokens so far and of the first token.
                streams = {
                    i: _drawn(state.seed, i, sampling, done + 1)
                    for i in range(first, first + sampling.n)
                }
                draws = self._grammar_draws(state.constraints)

                async def step(steps: list[Step]) -> list[tuple[int, TokenLogprob | None]]:
                    await asyncio.sleep(self.decode_s_per_token)  # one step of the batch
                    tokens = [
                        (i, _draw(streams[i], banned, draws.get(i))) for i, _, banned in steps
                    ]
                    for i, token in tokens:
                        if state.constraints is not None:
                            state.constraints[i].observe(token)
                    return [_chosen(token, sampling) for _, token in tokens]

                def grammar_ended(choice: int) -> bool:
                    return state.constraints is not None and state.constraints[choice].terminated

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
                state.live = False

    def release(self, kv: KvHandle[_MockKv]) -> None:
        kv.state.live = False

    async def export_kv(self, kv: KvHandle[_MockKv]) -> dict[str, torch.Tensor]:
        return {"seed": torch.tensor([self._state(kv).seed], dtype=torch.int64)}

    async def import_kv(
        self,
        request: EngineRequest,
        done: PrefillDone,
        tensors: dict[str, torch.Tensor],
        bootstrap: BootstrapInfo | None = None,
    ) -> KvHandle[_MockKv]:
        seed = tensors.get("seed")
        if seed is None:
            raise EngineError("imported KV lacks 'seed' (not made by a mock engine)")
        first = request.first_choice
        histories = {
            first + i: [*(request.resumed_ids if i == 0 else ()), token.token_id]
            for i, token in enumerate(done.first_tokens)
        }
        constraints = await self._constraints(request.sampling, histories)
        return KvHandle(
            request_id=request.request_id,
            prompt_tokens=done.prompt_tokens,
            first_tokens=done.first_tokens,
            cached_tokens=done.cached_tokens,
            state=_MockKv(int(seed[0]), constraints),
            prompt_logprobs=done.prompt_logprobs,
            resumed=request.resumed,
        )

    async def close(self) -> None:
        self.admission.close()
        self.grammars.close()
