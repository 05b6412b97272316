"""Tiny checkpoints for the engine tests (built once into the model cache dir)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mmserve.tiny.checkpoints import TINY_FAMILIES, build_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="session", params=TINY_FAMILIES)
def tiny_model(request: pytest.FixtureRequest) -> Path:
    return build_tiny_model(request.param)


# The families whose tiny model has linear-attention layers: they reuse no prefix blocks
# (`docs/engines.md`), so the prefix-cache tests take the others and these get their own.
HYBRID_FAMILIES = ("qwen3_5", "qwen3_5_moe")


@pytest.fixture(
    scope="session", params=[family for family in TINY_FAMILIES if family not in HYBRID_FAMILIES]
)
def prefix_reusing_model(request: pytest.FixtureRequest) -> Path:
    return build_tiny_model(request.param)


@pytest.fixture(scope="session", params=HYBRID_FAMILIES)
def hybrid_model(request: pytest.FixtureRequest) -> Path:
    return build_tiny_model(request.param)
