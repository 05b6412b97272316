"""Resize parity: `mmserve._mm.resize` against the installed Pillow (`Image.resize`) and
torchvision (`resize` of a uint8 tensor with antialias, what the torchvision-based HF
processors call), zero differences required."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms.v2 import InterpolationMode
from torchvision.transforms.v2 import functional as tvF

from mmserve import _mm

FILTERS = {
    "bicubic": (Image.Resampling.BICUBIC, InterpolationMode.BICUBIC),
    "lanczos": (Image.Resampling.LANCZOS, InterpolationMode.LANCZOS),
    "bilinear": (Image.Resampling.BILINEAR, InterpolationMode.BILINEAR),
}

# (in_w, in_h, out_w, out_h) where the two axes move in different directions or by very
# different amounts: Pillow 13 runs the vertical pass first when the height shrinks by more
# than twice as many pixels as the width, and the u8 intermediate makes the order visible.
MIXED_DIRECTION = [
    (640, 480, 644, 476),
    (1280, 960, 1288, 952),
    (480, 640, 476, 644),
    (640, 480, 620, 400),
    (640, 480, 600, 440),
    (640, 480, 639, 477),
    (1920, 1080, 1932, 1064),
    (300, 900, 320, 100),
    (901, 300, 100, 320),
]


def photo_like(width: int, height: int, seed: int) -> np.ndarray:
    """Smooth gradients, a hard edge and noise, so both flat and busy regions are covered."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack(
        [
            128 + 100 * np.sin(x / max(width, 1) * 6.0 + seed),
            128 + 100 * np.cos(y / max(height, 1) * 5.0),
            (x + y) / max(width + height, 1) * 255,
        ],
        axis=-1,
    )
    base[(x > width / 3) & (y < height / 2)] = (250, 10, 30)
    noisy = base + rng.normal(0, 25, size=base.shape)
    return np.clip(noisy, 0, 255).astype(np.uint8)


def pil_reference(image: np.ndarray, size: tuple[int, int], name: str) -> np.ndarray:
    return np.asarray(Image.fromarray(image).resize(size, FILTERS[name][0]))


def torch_reference(image: np.ndarray, size: tuple[int, int], name: str) -> np.ndarray:
    chw = torch.from_numpy(image).permute(2, 0, 1).contiguous()
    out = tvF.resize(chw, [size[1], size[0]], interpolation=FILTERS[name][1], antialias=True)
    return out.permute(1, 2, 0).numpy()


REFERENCES = {"pil": pil_reference, "torch": torch_reference}


def random_cases(seed: int, count: int) -> list[tuple[int, int, int, int]]:
    """Sides log-uniform in [1, 2000], input area capped to keep the suite fast."""
    rng = np.random.default_rng(seed)
    cases: list[tuple[int, int, int, int]] = []
    while len(cases) < count:
        w, h, ow, oh = (int(v) for v in np.exp(rng.uniform(0, np.log(2000), 4)))
        if w * h <= 1_200_000 and ow * oh <= 1_200_000:
            cases.append((w, h, ow, oh))
    return cases


def assert_exact(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert ours.shape == ref.shape, what
    diff = np.abs(ours.astype(np.int16) - ref.astype(np.int16))
    assert int(diff.max(initial=0)) == 0, f"{what}: {int((diff > 0).sum())} values differ"


@pytest.mark.parametrize("backend", ["pil", "torch"])
@pytest.mark.parametrize("name", list(FILTERS))
def test_mixed_direction_sizes_are_exact(backend: str, name: str) -> None:
    for i, (w, h, ow, oh) in enumerate(MIXED_DIRECTION):
        image = photo_like(w, h, i)
        ours = _mm.resize(image, ow, oh, filter=name, backend=backend)
        ref = REFERENCES[backend](image, (ow, oh), name)
        assert_exact(ours, ref, f"{backend} {name} {w}x{h}->{ow}x{oh}")


@pytest.mark.parametrize("backend", ["pil", "torch"])
@pytest.mark.parametrize("name", list(FILTERS))
def test_random_sizes_up_and_down_are_exact(backend: str, name: str) -> None:
    seed = 1000 * list(FILTERS).index(name) + (0 if backend == "pil" else 1)
    for i, (w, h, ow, oh) in enumerate(random_cases(seed, 24)):
        image = photo_like(w, h, seed + i)
        ours = _mm.resize(image, ow, oh, filter=name, backend=backend)
        ref = REFERENCES[backend](image, (ow, oh), name)
        assert_exact(ours, ref, f"{backend} {name} {w}x{h}->{ow}x{oh}")


def test_extreme_shapes_are_exact() -> None:
    rng = np.random.default_rng(7)
    shapes = [(1, 1, 1, 7), (1, 1, 9, 1), (7, 1, 1, 1), (2000, 1, 3, 5), (1, 1999, 4, 2)]
    for w, h, ow, oh in shapes:
        image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        for backend, reference in REFERENCES.items():
            for name in FILTERS:
                ours = _mm.resize(image, ow, oh, filter=name, backend=backend)
                assert_exact(ours, reference(image, (ow, oh), name), f"{backend} {name} {w}x{h}")


def test_non_contiguous_input_is_read_correctly() -> None:
    image = photo_like(120, 90, 3)
    flipped = image[:, ::-1]
    assert not flipped.flags.c_contiguous
    ours = _mm.resize(flipped, 61, 47)
    assert_exact(ours, pil_reference(np.ascontiguousarray(flipped), (61, 47), "bicubic"), "flip")


def test_errors_carry_stable_codes() -> None:
    image = photo_like(8, 8, 0)
    with pytest.raises(_mm.MediaError) as err:
        _mm.resize(image, 0, 4)
    assert err.value.args[0] == "resize.empty_target"
    with pytest.raises(_mm.MediaError) as err:
        _mm.resize(image, 4, 4, filter="nearest")
    assert err.value.args[0] == "resize.unknown_filter"
    with pytest.raises(_mm.MediaError) as err:
        _mm.resize(image, 4, 4, backend="cv2")
    assert err.value.args[0] == "resize.unknown_backend"
    with pytest.raises(ValueError, match="shape"):
        _mm.resize(np.zeros((4, 4, 4), np.uint8), 2, 2)
