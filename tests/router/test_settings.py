"""The router's command-line options."""

from __future__ import annotations

import argparse

import pytest

from mmserve.kv.pad import PadScheme
from mmserve.router.scheduler import RouterMode
from mmserve.router.settings import RouterSettings


def parse(*argv: str) -> RouterSettings:
    parser = argparse.ArgumentParser()
    RouterSettings.add_cli_args(parser)
    return RouterSettings.from_args(parser.parse_args(argv))


def test_defaults() -> None:
    assert parse() == RouterSettings()


def test_options_reach_the_router() -> None:
    settings = parse(
        "--router-mode=kv",
        "--block-size=32",
        "--pad-scheme=sglang-wide",
        "--kv-overlap-weight=2",
        "--router-queue-weight=4",
        "--router-temperature=0.5",
    )
    assert settings.mode is RouterMode.KV
    assert settings.block_size == 32
    assert settings.pad_scheme is PadScheme.SGLANG_WIDE
    router = settings.build_router()
    assert router.mode is RouterMode.KV
    assert (router.block_size, router.pad_scheme) == (32, PadScheme.SGLANG_WIDE)
    assert (router.cost.overlap_weight, router.cost.queue_weight, router.cost.temperature) == (
        2.0,
        4.0,
        0.5,
    )


@pytest.mark.parametrize(
    "argv", [["--block-size=0"], ["--router-temperature=-1"], ["--kv-overlap-weight=-2"]]
)
def test_bad_values_exit_with_a_reason(argv: list[str]) -> None:
    with pytest.raises(SystemExit, match="must be"):
        parse(*argv)


def test_the_old_block_size_flag_still_works_with_a_warning() -> None:
    parser = argparse.ArgumentParser()
    RouterSettings.add_cli_args(parser)
    assert "--block-size TOKENS, --kv-block-size TOKENS" in parser.format_help()
    with pytest.warns(FutureWarning, match="--kv-block-size is deprecated; use --block-size"):
        assert parse("--kv-block-size=24").block_size == 24


def test_the_encode_router_mode_reaches_the_encode_router() -> None:
    from mmserve.router.encode_scheduler import EncodeRouterMode

    assert parse().build_encode_router().mode is EncodeRouterMode.EMBEDDING_CACHE
    settings = parse("--encode-router-mode=round-robin", "--router-queue-weight=3")
    router = settings.build_encode_router()
    assert router.mode is EncodeRouterMode.ROUND_ROBIN
    assert router.cost.queue_weight == 3.0
