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


@pytest.mark.parametrize(
    ("flags", "parsers"),
    [
        ([], (None, None)),
        (["--dyn-tool-call-parser", "qwen3_coder", "--dyn-reasoning-parser", "qwen3"],
         ("qwen3_coder", "qwen3")),
    ],
)  # fmt: skip
def test_the_chat_card_names_the_models_parsers_for_dynamos_frontend(
    flags: list[str], parsers: tuple[str | None, str | None]
) -> None:
    from mmserve.dynamo.cli import _parsers, build_parser

    config = _parsers(build_parser().parse_args(["--model-path", "/m", *flags]))
    assert (config.tool_call_parser, config.reasoning_parser) == parsers
