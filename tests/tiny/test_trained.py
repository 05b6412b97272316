"""The trained default model: rebuilt exactly from the seed and the shipped weights, trained on
what serving gives it, and answering held-out questions."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, Qwen2VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from mmserve.cli import main
from mmserve.frontend.chat import ChatOptions, ChatPreprocessor, ServedModel
from mmserve.media import MediaPolicy
from mmserve.models.family import resolve_model_spec
from mmserve.protocol import ChatCompletionRequest
from mmserve.tiny import scenes, training
from mmserve.tiny.checkpoints import MARKER_FILE, default_model_path
from mmserve.tiny.trained import (
    EMBED_KEY,
    ROW_IDS_KEY,
    ROW_WEIGHTS_KEY,
    SCENES_MODEL_NAME,
    WEIGHTS_FILE,
    build_trained_model,
    scenes_preprocessor_config,
    seeded_embeddings,
)
from tests.support.images import png_data_url


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return build_trained_model()


@pytest.fixture(scope="module")
def prompts(checkpoint: Path) -> training.Prompts:
    return training.Prompts(AutoTokenizer.from_pretrained(checkpoint))


def test_the_default_model_is_the_trained_one(checkpoint: Path):
    assert default_model_path() == checkpoint
    assert checkpoint.name == SCENES_MODEL_NAME
    spec = resolve_model_spec(checkpoint)
    assert spec.family == "qwen2_vl"
    assert spec.vocab_size == 151936
    # Scenes are 112 pixels a side; larger images are scaled down to about that.
    assert json.loads((checkpoint / "preprocessor_config.json").read_text())["max_pixels"] == (
        112 * 112
    )


def test_untrained_rows_keep_their_seeded_values(checkpoint: Path):
    shipped = load_file(WEIGHTS_FILE)
    weights = Qwen2VLForConditionalGeneration.from_pretrained(checkpoint).state_dict()
    table = weights[EMBED_KEY]
    seeded = seeded_embeddings()
    trained = torch.zeros(len(seeded), dtype=torch.bool)
    trained[shipped[ROW_IDS_KEY]] = True
    assert torch.equal(table[~trained], seeded[~trained])
    assert torch.equal(table[trained], shipped[ROW_WEIGHTS_KEY].float())
    assert torch.equal(weights["lm_head.weight"], table)
    # Every other shipped tensor is in the checkpoint as it was shipped.
    for name, tensor in shipped.items():
        if name not in (ROW_IDS_KEY, ROW_WEIGHTS_KEY):
            assert torch.equal(weights[name], tensor.float()), name


def test_rebuilding_is_idempotent_and_follows_the_weights(tmp_path: Path):
    built = build_trained_model(tmp_path)
    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert build_trained_model(tmp_path) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp
    # Another weights file (the same tensors, other bytes) makes another checkpoint.
    other = tmp_path / "other.safetensors"
    save_file(load_file(WEIGHTS_FILE), str(other), metadata={"copy": "1"})
    assert build_trained_model(tmp_path, other) == built
    assert (built / "model.safetensors").stat().st_mtime_ns != stamp
    assert json.loads((built / MARKER_FILE).read_text())["weights"] != ""


def test_training_pixels_are_the_image_processors():
    config = scenes_preprocessor_config()
    processor = Qwen2VLImageProcessorPil(
        **{k: v for k, v in config.items() if k not in ("image_processor_type", "processor_class")}
    )
    for kind in ("colour", "word"):
        image = scenes.question(kind, 7).images[0]
        reference = processor(images=[image], return_tensors="np")
        assert reference["image_grid_thw"].tolist() == [[1, training.GRID, training.GRID]]
        np.testing.assert_allclose(training.patches(image), reference["pixel_values"], atol=1e-5)


async def test_training_prompts_are_what_the_frontend_plans(
    checkpoint: Path, prompts: training.Prompts
):
    model = ServedModel.load(checkpoint)
    preprocessor = ChatPreprocessor(model, ChatOptions(policy=MediaPolicy()))
    question = scenes.held_out_pair(0).ask(1)
    parts: list[dict] = [
        {"type": "image_url", "image_url": {"url": png_data_url(image)}}
        for image in question.images
    ]
    body = {
        "model": model.name,
        "messages": [
            {"role": "user", "content": [*parts, {"type": "text", "text": question.text}]}
        ],
    }
    request = msgspec.json.decode(json.dumps(body).encode(), type=ChatCompletionRequest)
    planned = await preprocessor.preprocess(request, "r", 1e12)
    assert list(planned.plan.token_ids) == prompts.prompt(question.text, 2)


def test_the_model_answers_held_out_questions(checkpoint: Path, prompts: training.Prompts):
    model = Qwen2VLForConditionalGeneration.from_pretrained(checkpoint).eval()
    config = scenes_preprocessor_config()
    processor = Qwen2VLImageProcessorPil(
        **{k: v for k, v in config.items() if k not in ("image_processor_type", "processor_class")}
    )
    with torch.inference_mode():
        # Each kind the shipped weights answer at 98-100% held out (docs/models.md).
        for kind in ("colour", "count", "position", "word"):
            for question in training.held_out(kind, 10):
                got = training.answer(model, processor, prompts, question)
                assert got == question.answer, (kind, question.text, got)
        # Two images in either order, asked about either: swapping them swaps the answer.
        for seed in range(4):
            pair = scenes.held_out_pair(seed)
            for which in (0, 1):
                for swapped in (False, True):
                    question = pair.ask(which, swapped)
                    got = training.answer(model, processor, prompts, question)
                    assert got == question.answer, (seed, question.text, swapped, got)


def test_training_writes_weights_that_rebuild_a_checkpoint(tmp_path: Path):
    weights = tmp_path / "weights.safetensors"
    training.train(weights, steps=2, batch=4, seed=0, lr=1e-3)
    built = build_trained_model(tmp_path / "models", weights)
    assert resolve_model_spec(built).family == "qwen2_vl"
    shipped = load_file(weights)
    assert set(shipped[ROW_IDS_KEY].tolist()) >= {151644, 151645, 151652, 151653, 151655}


def test_train_tiny_model_has_help(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as exit_info:
        main(["train-tiny-model", "--help"])
    assert exit_info.value.code == 0
    assert "--eval-only" in capsys.readouterr().out
