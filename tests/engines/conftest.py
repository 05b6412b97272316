"""Tiny checkpoints for the engine tests (built once into the model cache dir)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from mmserve.models.tiny import TINY_FAMILIES, build_tiny_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)


@pytest.fixture(scope="session", params=TINY_FAMILIES)
def tiny_model(request: pytest.FixtureRequest) -> Path:
    return build_tiny_model(request.param)
