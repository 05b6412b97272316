"""`mmserve train-tiny-model`: train the default model on synthetic scenes, offline, on CPU.

Training renders every example exactly as the frontend renders a chat request (the checkpoint's
chat template with its generation prompt, one image part per scene) and teaches the answer
followed by `<|im_end|>`, so greedy decoding through mmserve says the answer and stops.

Only the token ids that occur in training sequences take part: the model is trained with a
vocabulary of just those rows (initialised from the seeded table), and the rows are scattered
back into the full 151,936-row table afterwards. Every other row keeps its seeded value exactly,
which is what lets `tiny/trained.py` ship the trained rows alone. The held-out accuracy is
measured on the checkpoint rebuilt from the written weights, through the transformers image
processor that the Rust core matches bit for bit, and greedy `generate` over the full vocabulary.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmserve.tiny import scenes
from mmserve.tiny.trained import (
    EMBED_KEY,
    ROW_IDS_KEY,
    ROW_WEIGHTS_KEY,
    SPECIAL_IDS,
    WEIGHTS_FILE,
    build_trained_model,
    model_config,
    scenes_preprocessor_config,
    seeded_embeddings,
)

IM_END = 151645
PAD = 151643
IMAGE_PAD = 151655
# The held-out set and the tests use question seeds below this; training never does.
TRAIN_SEED_BASE = 1_000_000
# Share of training prompts with the question before the images (the README asks image first).
TEXT_FIRST_SHARE = 0.25
# Counting is the slowest kind to learn, so it gets twice the share of each other kind.
KIND_WEIGHTS = np.array([2.0 if kind == "count" else 1.0 for kind in scenes.QUESTION_KINDS])
KIND_SHARES = KIND_WEIGHTS / KIND_WEIGHTS.sum()
MERGE = 2
PATCH = 14
GRID = scenes.SCENE_SIZE // PATCH
TOKENS_PER_IMAGE = GRID * GRID // MERGE**2


@dataclass
class Example:
    ids: list[int]  # prompt and answer, in full-vocabulary ids
    prompt_len: int
    images: tuple[Any, ...]  # PIL images


class Prompts:
    """Chat prompts through the checkpoint's tokenizer and template, expanded per image."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[tuple[str, int, bool], list[int]] = {}

    def prompt(self, text: str, num_images: int, text_first: bool = False) -> list[int]:
        key = (text, num_images, text_first)
        if key not in self._cache:
            images: list[dict[str, str]] = [{"type": "image"}] * num_images
            parts = [{"type": "text", "text": text}]
            content = parts + images if text_first else images + parts
            rendered = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
            ids: list[int] = []
            for token in self.tokenizer(rendered)["input_ids"]:
                ids.extend([token] * (TOKENS_PER_IMAGE if token == IMAGE_PAD else 1))
            self._cache[key] = ids
        return self._cache[key]

    def answer(self, answer: str) -> list[int]:
        return [*self.tokenizer(answer)["input_ids"], IM_END]

    def example(self, question: scenes.Question, text_first: bool = False) -> Example:
        prompt = self.prompt(question.text, len(question.images), text_first)
        return Example(prompt + self.answer(question.answer), len(prompt), question.images)

    def vocabulary(self) -> list[int]:
        """Every token id a training sequence can hold, and the ids the config names."""
        ids = set(SPECIAL_IDS.values()) | {PAD}
        for text in scenes.question_texts():
            for num_images in (1, 2):
                for text_first in (False, True):
                    ids.update(self.prompt(text, num_images, text_first))
        for answer in scenes.answers():
            ids.update(self.answer(answer))
        return sorted(ids)


def patches(image: Any) -> np.ndarray:
    """Qwen2-VL pixel_values of a SCENE_SIZE image (no resize: it is a multiple of 28)."""
    config = scenes_preprocessor_config()
    mean = np.array(config["image_mean"], np.float32)
    std = np.array(config["image_std"], np.float32)
    pixels = (np.asarray(image, dtype=np.float32) * np.float32(1 / 255) - mean) / std
    frames = np.stack([pixels.transpose(2, 0, 1)] * 2)  # temporal patch of 2 equal frames
    grid = frames.reshape(1, 2, 3, GRID // MERGE, MERGE, PATCH, GRID // MERGE, MERGE, PATCH)
    return grid.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(GRID * GRID, -1)


class Trainer:
    """The model with the training vocabulary, its optimiser and the batch builder."""

    def __init__(self, prompts: Prompts, seed: int, lr: float, steps: int) -> None:
        import torch
        import transformers

        self.prompts = prompts
        self.vocab = prompts.vocabulary()
        self.index = {token: i for i, token in enumerate(self.vocab)}
        ids = {name: self.index[token] for name, token in SPECIAL_IDS.items()}
        torch.manual_seed(seed)
        self.model = transformers.Qwen2VLForConditionalGeneration(
            model_config(len(self.vocab), ids)
        )
        with torch.no_grad():
            embed: Any = self.model.get_input_embeddings()
            embed.weight.copy_(seeded_embeddings()[torch.tensor(self.vocab)])
        self.model.train()
        # No weight decay: nothing should drift but what the loss moves.
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.0
        )
        warmup = max(1, steps // 20)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda step: (
                min(1.0, (step + 1) / warmup)
                * 0.5
                * (1 + math.cos(math.pi * min(step, steps) / steps))
            ),
        )
        self.image_token = ids["image_token_id"]

    def _positions(self, ids: Any, num_images: int) -> Any:
        import torch

        grid = torch.tensor([[1, GRID, GRID]] * num_images)
        types = (ids == self.image_token).int()
        positions, _ = self.model.model.get_rope_index(ids[None], types[None], grid)
        return positions[:, 0]

    def step(self, examples: Sequence[Example]) -> float:
        import torch

        length = max(len(e.ids) for e in examples)
        ids = torch.full((len(examples), length), self.index[PAD])
        targets = torch.full((len(examples), length), -100)
        positions = torch.zeros(3, len(examples), length, dtype=torch.long)
        for row, example in enumerate(examples):
            seq = torch.tensor([self.index[t] for t in example.ids])
            ids[row, : len(seq)] = seq
            # Position t predicts token t + 1: the answer and its <|im_end|>.
            targets[row, example.prompt_len - 1 : len(seq) - 1] = seq[example.prompt_len :]
            positions[:, row, : len(seq)] = self._positions(seq, len(example.images))
        images = [image for example in examples for image in example.images]
        pixel_values = torch.from_numpy(np.concatenate([patches(image) for image in images]))
        # Right padding under a causal mask: no real token attends to a pad.
        hidden = self.model.model(
            input_ids=ids,
            position_ids=positions,
            pixel_values=pixel_values,
            image_grid_thw=torch.tensor([[1, GRID, GRID]] * len(images)),
        ).last_hidden_state
        mask = targets != -100
        logits = self.model.lm_head(hidden[mask])
        loss = torch.nn.functional.cross_entropy(logits, targets[mask])
        self.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        self.scheduler.step()
        return loss.item()

    def trained_weights(self) -> dict[str, Any]:
        """What to ship: every weight but the table, and the table's rows by full-vocab id."""
        import torch

        state = self.model.state_dict()
        out = {
            name: tensor.detach().clone().contiguous()
            for name, tensor in state.items()
            if name not in (EMBED_KEY, "lm_head.weight")
        }
        out[ROW_IDS_KEY] = torch.tensor(self.vocab, dtype=torch.int64)
        out[ROW_WEIGHTS_KEY] = state[EMBED_KEY].detach().clone().contiguous()
        return out


def training_examples(prompts: Prompts, seed: int, step: int, batch: int) -> list[Example]:
    rng = np.random.default_rng([seed, step])
    examples = []
    for j in range(batch):
        kind = str(rng.choice(scenes.QUESTION_KINDS, p=KIND_SHARES))
        question = scenes.question(kind, TRAIN_SEED_BASE + step * batch + j)
        examples.append(prompts.example(question, text_first=rng.random() < TEXT_FIRST_SHARE))
    return examples


def train(
    weights: Path, *, steps: int, batch: int, seed: int, lr: float, log_every: int = 100
) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from mmserve.tiny.checkpoints import build_tiny_model

    # The random tiny Qwen2-VL has the same tokenizer files the trained checkpoint gets.
    prompts = Prompts(AutoTokenizer.from_pretrained(build_tiny_model("qwen2_vl")))
    trainer = Trainer(prompts, seed, lr, steps)
    start = time.monotonic()
    recent: list[float] = []
    for step in range(steps):
        recent.append(trainer.step(training_examples(prompts, seed, step, batch)))
        if (step + 1) % log_every == 0 or step + 1 == steps:
            elapsed = time.monotonic() - start
            print(
                f"step {step + 1}/{steps}  loss {np.mean(recent):.4f}  {elapsed:.0f}s", flush=True
            )
            recent.clear()
    weights.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        save_file(trainer.trained_weights(), str(weights), metadata={"seed": str(seed)})
    print(f"wrote {weights} ({weights.stat().st_size / 2**20:.2f} MiB)")


def held_out(kind: str, count: int) -> list[scenes.Question]:
    return [scenes.question(kind, seed) for seed in range(count)]


def answer(model: Any, processor: Any, prompts: Prompts, question: scenes.Question) -> str:
    """Greedy `generate` on the full model: the text before <|im_end|>, or "" if none came."""
    import torch

    ids = torch.tensor([prompts.prompt(question.text, len(question.images))])
    pixels = processor(images=list(question.images), return_tensors="pt")
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        pixel_values=pixels["pixel_values"],
        image_grid_thw=pixels["image_grid_thw"],
        mm_token_type_ids=(ids == IMAGE_PAD).int(),
        max_new_tokens=8,
        do_sample=False,
    )
    new = out[0, ids.shape[1] :].tolist()
    if IM_END not in new:
        return ""
    return str(prompts.tokenizer.decode(new[: new.index(IM_END)]))


def evaluate(checkpoint: Path, per_kind: int) -> dict[str, float]:
    """Held-out accuracy per question kind of the checkpoint, printed as it goes."""
    import torch
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    config = scenes_preprocessor_config()
    processor = Qwen2VLImageProcessorPil(
        **{k: v for k, v in config.items() if k not in ("image_processor_type", "processor_class")}
    )
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(checkpoint).eval()
    prompts = Prompts(transformers.AutoTokenizer.from_pretrained(checkpoint))
    accuracy = {}
    with torch.inference_mode():
        for kind in scenes.QUESTION_KINDS:
            questions = held_out(kind, per_kind)
            right = sum(answer(model, processor, prompts, q) == q.answer for q in questions)
            accuracy[kind] = right / len(questions)
            print(
                f"{kind:<11} {right:>4}/{len(questions)}  {100 * accuracy[kind]:.1f}%", flush=True
            )
    return accuracy


def _handle(args: argparse.Namespace) -> int:
    weights = Path(args.weights).expanduser()
    if not args.eval_only:
        start = time.monotonic()
        train(weights, steps=args.steps, batch=args.batch_size, seed=args.seed, lr=args.lr)
        print(f"trained in {time.monotonic() - start:.0f}s")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = build_trained_model(Path(tmp), weights)
        print(f"held-out accuracy of the checkpoint rebuilt from {weights}:")
        accuracy = evaluate(checkpoint, args.eval_per_kind)
    return 0 if min(accuracy.values()) >= args.min_accuracy else 1


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train-tiny-model",
        help="train the default tiny Qwen2-VL on synthetic scenes (offline, CPU)",
        description=(
            "Train the tiny Qwen2-VL that `make run` serves on synthetic scenes (shapes, "
            "colours, counts, positions, words), write the trained weights, rebuild the "
            "checkpoint from them and print its held-out accuracy per question kind. Exits 1 "
            "when a kind is under --min-accuracy."
        ),
    )
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--seed", type=int, default=0, help="initialisation seed")
    parser.add_argument(
        "--weights",
        default=str(WEIGHTS_FILE),
        help="the trained weights to write (default: the ones the package ships)",
    )
    parser.add_argument(
        "--eval-only", action="store_true", help="measure --weights without training"
    )
    parser.add_argument(
        "--eval-per-kind", type=int, default=200, help="held-out questions per kind"
    )
    parser.add_argument("--min-accuracy", type=float, default=0.95)
    parser.set_defaults(handler=_handle)
