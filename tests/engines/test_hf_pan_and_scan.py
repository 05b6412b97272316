"""Gemma 3 with pan-and-scan through the hf engine: the frontend's plan (each crop an item
after its image), the encode stage cutting and resizing the crops from the image's bytes,
and greedy tokens equal to transformers' `generate` on Gemma3Processor's inputs with
`do_pan_and_scan`; a crop encoded again comes from the encoder cache."""

from __future__ import annotations

import dataclasses
import os
import time

import msgspec
import pytest
import torch
from transformers import AutoProcessor

from mmserve.encode.stage import EncodeStage
from mmserve.engines import hf
from mmserve.engines.base import EngineRequest, ItemEmbedding
from mmserve.engines.hf import HfEngine
from mmserve.frontend.chat import ChatOptions, ChatPreprocessor, ServedModel
from mmserve.media import MediaPolicy
from mmserve.protocol import ChatCompletionRequest, PreprocessedRequest, StopConditions
from mmserve.tiny.checkpoints import build_tiny_model
from mmserve.transfer.inline import InlineTransferAgent
from tests.support.engines import make_image
from tests.support.images import png_data_url

os.environ.setdefault("HF_HUB_OFFLINE", "1")

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def engine() -> HfEngine:
    return HfEngine(build_tiny_model("gemma3"))


async def test_greedy_tokens_equal_generate_with_pan_and_scan(
    engine: HfEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    logits: list[torch.Tensor] = []
    choose = hf.next_tokens

    def keep_logits(samplers, step_logits, banned=()):
        logits.append(step_logits[0].clone())
        return choose(samplers, step_logits, banned)

    monkeypatch.setattr(hf, "next_tokens", keep_logits)
    path = engine.spec.path
    # Two crops, no crops (below the activation ratio), three crops.
    images = [make_image(700, 350, 0), make_image(300, 280, 1), make_image(260, 800, 2)]
    content = [
        {"type": "text", "text": "Compare:"},
        *({"type": "image_url", "image_url": {"url": png_data_url(i)}} for i in images),
    ]
    messages = [{"role": "user", "content": content}]
    preprocessor = ChatPreprocessor(ServedModel.load(path), ChatOptions(policy=MediaPolicy()))
    request = msgspec.convert(
        {
            "model": preprocessor.model.name,
            "messages": messages,
            "mm_processor_kwargs": {"do_pan_and_scan": True},
        },
        ChatCompletionRequest,
    )
    sent: PreprocessedRequest = await preprocessor.preprocess(request, "pan", time.time() + 120)
    assert [m.crop for m in sent.plan.media] == [None, 1, 2, None, None, 1, 2, 3]

    processor = AutoProcessor.from_pretrained(path)
    text = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": [content[0], *[{"type": "image"}] * len(images)]}],
        tokenize=False,
        add_generation_prompt=True,
    )
    inputs = processor(
        text=text,
        images=images,
        do_pan_and_scan=True,
        add_special_tokens=False,
        return_tensors="pt",
    )
    assert sent.plan.token_ids == inputs["input_ids"][0].tolist()
    out = engine.model.generate(
        **inputs,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )
    expected = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()

    stage = EncodeStage(engine, InlineTransferAgent(), path, "worker")
    encoded = await stage.run(sent)
    embeddings = [encoded[i] for i in range(len(sent.plan.media))]
    stop = StopConditions(max_tokens=NEW_TOKENS, ignore_eos=True)

    async def tokens(request_id: str, rows: list[ItemEmbedding]) -> list[int]:
        request = EngineRequest.from_plan(request_id, sent.plan, stop=stop)
        return [t async for chunk in engine.generate(request, rows) for t in chunk.token_ids]

    assert await tokens("pan", embeddings) == expected
    assert torch.equal(logits[0], out.logits[0][0])
    # The crops' rows are seen: two of them swapped, the first token's logits change.
    swapped = [embeddings[0], embeddings[2], embeddings[1], *embeddings[3:]]
    swapped[1:3] = [
        dataclasses.replace(e, mm_hash=o.mm_hash)
        for e, o in zip(swapped[1:3], embeddings[1:3], strict=True)
    ]
    await engine.clear_caches()  # not the prefix cache's blocks of the request above
    logits.clear()
    await tokens("swapped", swapped)
    assert not torch.allclose(logits[0], out.logits[0][0])
    await stage.run(sent)  # the encoder cache holds the items again
    # The same request again finds every item, crops too, in the encoder cache.
    before = engine.encoder_cache_stats()
    await stage.run(msgspec.structs.replace(sent, request_id="again"))
    hits, _ = engine.encoder_cache_stats()
    assert hits - before[0] == len(sent.plan.media)
