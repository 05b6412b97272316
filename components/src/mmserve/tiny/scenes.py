"""Synthetic scenes and plain-English questions about them, for the trained tiny model.

A scene is a small RGB picture drawn in code: coloured circles, squares and triangles on a 4x4
grid of cells (one image token each), or one word in large block letters. Each `Question` pairs
one or two scenes with a question whose one right answer follows from the pixels. The same
generator makes the training set, the held-out set and the images the tests and the README ask
about, so a seed names a scene exactly (Pillow draws the shapes; the letters are a bitmap font
defined here, so no font file is involved).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

SCENE_SIZE = 112  # pixels a side: 8x8 patches of 14, 16 tokens after the 2x2 merge
TOKEN_PIXELS = 28  # a side of one image token: a 14-pixel patch times the 2 x 2 merge
LETTER_SCALE = 4  # pixels per bitmap-font dot: a 5 x 7 letter is 20 x 28, one token tall
LETTER_INSET = (TOKEN_PIXELS - 5 * LETTER_SCALE) // 2  # centres a letter in its token
# Shapes sit in a CELLS x CELLS grid, at most one per cell, each cell one merged image token:
# a shape that straddles tokens is counted at under 90% by a model this size, one per token at
# well over 95% (docs/models.md).
CELLS = SCENE_SIZE // TOKEN_PIXELS
RADII = (8, 13)  # a shape's radius in pixels, drawn from [8, 13): it stays inside its cell
# Shapes in a scene besides the ones a question is about. The shipped model is trained with
# none: with up to two more, training on 2 CPU cores takes hours instead of minutes.
MAX_OTHERS = 0

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 40, 170),
    "orange": (245, 130, 20),
}
SHAPES = ("circle", "square", "triangle")
WORDS = ("CAT", "DOG", "SUN", "BOX", "HAT", "CAR", "BUS", "FOX")
ORDINALS = ("first", "second")

COLOUR_TEXT = "What colour is the {shape}?"
COUNT_TEXT = "How many {shape}s are there?"
POSITION_TEXT = "Is the {shape} on the left or the right?"
WORD_TEXT = "What word is written?"
NTH_WORD_TEXT = "What word is written in the {nth} image?"
NTH_COLOUR_TEXT = "What colour is the {shape} in the {nth} image?"

# 5x7 block letters, enough for WORDS.
_GLYPHS: dict[str, tuple[str, ...]] = {
    "A": (".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"),
    "B": ("####.", "#...#", "#...#", "####.", "#...#", "#...#", "####."),
    "C": (".###.", "#...#", "#....", "#....", "#....", "#...#", ".###."),
    "D": ("####.", "#...#", "#...#", "#...#", "#...#", "#...#", "####."),
    "F": ("#####", "#....", "#....", "####.", "#....", "#....", "#...."),
    "G": (".###.", "#...#", "#....", "#.###", "#...#", "#...#", ".###."),
    "H": ("#...#", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"),
    "N": ("#...#", "##..#", "#.#.#", "#..##", "#...#", "#...#", "#...#"),
    "O": (".###.", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."),
    "R": ("####.", "#...#", "#...#", "####.", "#.#..", "#..#.", "#...#"),
    "S": (".####", "#....", "#....", ".###.", "....#", "....#", "####."),
    "T": ("#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."),
    "U": ("#...#", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."),
    "X": ("#...#", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "#...#"),
}


@dataclass(frozen=True)
class Shape:
    kind: str  # one of SHAPES
    colour: str  # a key of COLOURS
    cell: int  # 0..CELLS * CELLS - 1, row-major


@dataclass(frozen=True)
class Question:
    """One or two scenes, a question about them, and its one right answer."""

    kind: str  # one of QUESTION_KINDS
    images: tuple[Image.Image, ...]
    text: str
    answer: str


def _background(rng: np.random.Generator) -> tuple[int, int, int]:
    return tuple(int(v) for v in rng.integers(225, 256, 3))  # type: ignore[return-value]


def _jitter(rng: np.random.Generator, colour: tuple[int, int, int]) -> tuple[int, int, int]:
    return tuple(int(np.clip(c + rng.integers(-20, 21), 0, 255)) for c in colour)  # type: ignore[return-value]


def draw_shapes(rng: np.random.Generator, shapes: list[Shape]) -> Image.Image:
    image = Image.new("RGB", (SCENE_SIZE, SCENE_SIZE), _background(rng))
    draw = ImageDraw.Draw(image)
    cell = SCENE_SIZE / CELLS
    for shape in shapes:
        radius = int(rng.integers(*RADII))
        slack = cell / 2 - radius - 1
        cx = (shape.cell % CELLS + 0.5) * cell + rng.uniform(-slack, slack)
        cy = (shape.cell // CELLS + 0.5) * cell + rng.uniform(-slack, slack)
        box = (cx - radius, cy - radius, cx + radius, cy + radius)
        fill = _jitter(rng, COLOURS[shape.colour])
        if shape.kind == "circle":
            draw.ellipse(box, fill=fill)
        elif shape.kind == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon(
                [(cx, cy - radius), (cx + radius, cy + radius), (cx - radius, cy + radius)],
                fill=fill,
            )
    return image


def draw_word(rng: np.random.Generator, word: str) -> Image.Image:
    # One letter per merged token (28 x 28 pixels, 2 x 2 patches), the word on the token grid:
    # the same letter is then the same pixels in every scene but for the ink. Letters at
    # arbitrary pixel offsets across patch boundaries stay unread (chance) by a model this size.
    tokens = SCENE_SIZE // TOKEN_PIXELS
    col0 = int(rng.integers(0, tokens - len(word) + 1))
    row = int(rng.integers(0, tokens))
    ink = (
        _jitter(rng, (20, 20, 20))
        if rng.random() < 0.5
        else COLOURS[str(rng.choice(list(COLOURS)))]
    )
    image = np.empty((SCENE_SIZE, SCENE_SIZE, 3), dtype=np.uint8)
    image[:] = _background(rng)
    for index, letter in enumerate(word):
        x0 = (col0 + index) * TOKEN_PIXELS + LETTER_INSET
        y0 = row * TOKEN_PIXELS
        for r, line in enumerate(_GLYPHS[letter]):
            for c, pixel in enumerate(line):
                if pixel == "#":
                    y = y0 + r * LETTER_SCALE
                    x = x0 + c * LETTER_SCALE
                    image[y : y + LETTER_SCALE, x : x + LETTER_SCALE] = ink
    return Image.fromarray(image)


def _cells(rng: np.random.Generator, count: int, allowed: list[int] | None = None) -> list[int]:
    pool = allowed if allowed is not None else list(range(CELLS * CELLS))
    return [int(c) for c in rng.choice(pool, size=count, replace=False)]


def _others(rng: np.random.Generator, exclude: str, count: int) -> list[str]:
    pool = [s for s in SHAPES if s != exclude]
    return [str(rng.choice(pool)) for _ in range(count)]


def _colour(rng: np.random.Generator) -> str:
    return str(rng.choice(list(COLOURS)))


def _unique_shape_scene(rng: np.random.Generator, cells: list[int]) -> tuple[list[Shape], Shape]:
    """A target shape that is the only one of its kind, among 0-3 shapes of other kinds."""
    kind = str(rng.choice(SHAPES))
    others = _others(rng, kind, len(cells) - 1)
    target = Shape(kind, _colour(rng), cells[0])
    return [
        target,
        *(Shape(k, _colour(rng), c) for k, c in zip(others, cells[1:], strict=True)),
    ], target


def colour_question(rng: np.random.Generator, others: int = MAX_OTHERS) -> Question:
    cells = _cells(rng, 1 + int(rng.integers(0, others + 1)))
    shapes, target = _unique_shape_scene(rng, cells)
    return Question(
        "colour", (draw_shapes(rng, shapes),), COLOUR_TEXT.format(shape=target.kind), target.colour
    )


def count_question(rng: np.random.Generator, others: int = MAX_OTHERS) -> Question:
    kind = str(rng.choice(SHAPES))
    count = int(rng.integers(1, 5))
    distractors = int(rng.integers(0, others + 1))
    cells = _cells(rng, count + distractors)
    kinds = [kind] * count + _others(rng, kind, distractors)
    shapes = [Shape(k, _colour(rng), c) for k, c in zip(kinds, cells, strict=True)]
    return Question("count", (draw_shapes(rng, shapes),), COUNT_TEXT.format(shape=kind), str(count))


def position_question(rng: np.random.Generator, others: int = MAX_OTHERS) -> Question:
    side = str(rng.choice(("left", "right")))
    column = 0 if side == "left" else CELLS - 1
    first = _cells(rng, 1, [c for c in range(CELLS * CELLS) if c % CELLS == column])
    rest = _cells(
        rng, int(rng.integers(0, others + 1)), [c for c in range(CELLS * CELLS) if c != first[0]]
    )
    shapes, target = _unique_shape_scene(rng, first + rest)
    return Question(
        "position", (draw_shapes(rng, shapes),), POSITION_TEXT.format(shape=target.kind), side
    )


def word_question(rng: np.random.Generator, others: int = MAX_OTHERS) -> Question:
    del others  # a word scene has no shapes
    word = str(rng.choice(WORDS))
    return Question("word", (draw_word(rng, word),), WORD_TEXT, word)


@dataclass(frozen=True)
class ImagePair:
    """Two scenes of the same sort with different answers to one question naming either."""

    images: tuple[Image.Image, Image.Image]
    template: str  # a question with {nth} for "first" or "second"
    answers: tuple[str, str]

    def ask(self, which: int, swapped: bool = False) -> Question:
        """The question about image `which` (0 or 1), the images in reverse order if `swapped`."""
        images = self.images[::-1] if swapped else self.images
        answer = self.answers[which ^ int(swapped)]
        return Question("two_images", images, self.template.format(nth=ORDINALS[which]), answer)


def image_pair(rng: np.random.Generator, others: int = MAX_OTHERS) -> ImagePair:
    if rng.random() < 0.5:
        w1, w2 = (str(w) for w in rng.choice(WORDS, size=2, replace=False))
        return ImagePair((draw_word(rng, w1), draw_word(rng, w2)), NTH_WORD_TEXT, (w1, w2))
    kind = str(rng.choice(SHAPES))
    c1, c2 = (str(c) for c in rng.choice(list(COLOURS), size=2, replace=False))
    images = []
    for colour in (c1, c2):
        cells = _cells(rng, 1 + int(rng.integers(0, others + 1)))
        kinds = _others(rng, kind, len(cells) - 1)
        shapes = [Shape(kind, colour, cells[0])] + [
            Shape(k, _colour(rng), c) for k, c in zip(kinds, cells[1:], strict=True)
        ]
        images.append(draw_shapes(rng, shapes))
    template = NTH_COLOUR_TEXT.replace("{shape}", kind)
    return ImagePair((images[0], images[1]), template, (c1, c2))


def two_image_question(rng: np.random.Generator, others: int = MAX_OTHERS) -> Question:
    return image_pair(rng, others).ask(int(rng.integers(0, 2)))


QUESTION_MAKERS: dict[str, Callable[[np.random.Generator, int], Question]] = {
    "colour": colour_question,
    "count": count_question,
    "position": position_question,
    "word": word_question,
    "two_images": two_image_question,
}
QUESTION_KINDS = tuple(QUESTION_MAKERS)


def question(kind: str, seed: int, others: int = MAX_OTHERS) -> Question:
    """The question of `kind` that `seed` names (the same on every machine), with at most
    `others` shapes besides the ones asked about."""
    rng = np.random.default_rng([seed, QUESTION_KINDS.index(kind)])
    return QUESTION_MAKERS[kind](rng, others)


def question_texts() -> set[str]:
    """Every question text the makers can ask."""
    texts = {WORD_TEXT, *(NTH_WORD_TEXT.format(nth=nth) for nth in ORDINALS)}
    for shape in SHAPES:
        texts |= {COLOUR_TEXT.format(shape=shape), COUNT_TEXT.format(shape=shape)}
        texts |= {POSITION_TEXT.format(shape=shape)}
        texts |= {NTH_COLOUR_TEXT.format(shape=shape, nth=nth) for nth in ORDINALS}
    return texts


def held_out_pair(seed: int) -> ImagePair:
    """The image pair behind `question("two_images", seed)`."""
    return image_pair(np.random.default_rng([seed, QUESTION_KINDS.index("two_images")]))


def answers() -> set[str]:
    """Every answer any question can have."""
    return {*COLOURS, *SHAPES, *WORDS, "left", "right", *(str(n) for n in range(1, 5))}
