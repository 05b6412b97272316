"""Prints the extension's pool size and a digest of everything the driver returns for a fixed
request; run in a fresh process per `MMSERVE_MM_THREADS` value. Imports only what the
extension needs, so that a run takes a fraction of a second."""

from __future__ import annotations

import hashlib
import io
import json

import numpy as np
from PIL import Image

from mmserve import _mm

IMAGE_TOKEN, VISION_START, VISION_END = 151655, 151652, 151653
CONFIG = {
    "model_type": "qwen2_vl",
    "image_token_id": IMAGE_TOKEN,
    "vision_start_token_id": VISION_START,
    "vision_end_token_id": VISION_END,
}
PREPROCESSOR = {"min_pixels": 3136, "max_pixels": 12845056, "image_processor_type": "Pil"}


def digest_of_a_request(count: int = 6) -> str:
    rng = np.random.default_rng(9)
    images = []
    for w, h in rng.integers(30, 500, (count, 2)):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
        images.append(buf.getvalue())
    spec = _mm.spec_from_hf_configs(json.dumps(PREPROCESSOR), json.dumps(CONFIG))
    ids = [0] + [VISION_START, IMAGE_TOKEN, VISION_END, 1] * count
    result = _mm.process(spec, ids, images)
    assert result.positions is not None
    digest = hashlib.sha256(result.input_ids.tobytes() + result.positions.tobytes())
    for item in result.items:
        assert item.pixel_values is not None
        digest.update(item.pixel_values.tobytes() + item.image_grid_thw.tobytes())
        digest.update(item.hash.to_bytes(8, "little"))
    return digest.hexdigest()


if __name__ == "__main__":
    print(_mm.num_threads(), digest_of_a_request())
