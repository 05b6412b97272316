"""`python -m mmserve.dynamo`'s refusals before it loads anything."""

from __future__ import annotations

import pytest

from mmserve.dynamo.cli import main


@pytest.mark.parametrize("mode", ["encode", "decode"])
def test_only_workers_that_run_prompts_route_to_an_encoder(
    mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--model-path", "/nonexistent", "--disaggregation-mode", mode, "--route-to-encoder"]
    assert main(argv) == 2
    assert f"not --disaggregation-mode {mode}" in capsys.readouterr().err
