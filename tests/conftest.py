"""Fixtures shared by every test suite."""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from mmserve.runtime.nats_server import NatsServer, nats_url_from_env_or_private

# The slow tier, in this one place: `make test` runs every test, `make test-fast` (`-m "not
# slow"`) leaves these out to stay under 3 minutes on 2 cores. Chosen from a `--durations=0` run:
# whole deployments and process kills, KV and tensors moved between processes, and the engines
# and the in-process patterns on every family but the first (the fast tier keeps one family;
# parity on each is in the full).
SLOW_PATHS = (
    "e2e/",
    "audio/test_audio_core.py",
    "audio/test_qwen2_5_omni_plan.py",
    "audio/test_qwen3_omni_moe_plan.py",
    "reliability/",
    "engines/test_grammar.py",
    "engines/test_kv_transfer.py",
    "engines/test_mock_engine.py",
    "frontend/test_migration.py",
    "frontend/test_qwen3_5_prompt.py",
    "runtime/test_liveness.py",
    "transfer/test_cross_process.py",
)
SLOW_TESTS = {
    "mm/test_qwen_vl.py::test_large_images",
    "grammar/test_generated_schemas.py::test_every_output_of_hundreds_of_schemas_validates",
}
# The modules that take the longest on CI's machine (a `--durations` run, 2 cores: 120 to
# 490 s each), longest first. Only the order of the run depends on this list.
LONGEST_MODULES = (
    "e2e/test_patterns.py",
    "e2e/test_dynamo.py",
    "e2e/test_launch.py",
    "e2e/test_multihost.py",
    "e2e/test_lm_eval.py",
    "reliability/test_migration.py",
    "engines/test_sglang_contract.py",
    "engines/test_hf_engine.py",
    "e2e/test_structured_outputs.py",
    "e2e/test_answers.py",
    "engines/test_grammar.py",
    "reliability/test_openapi_schemathesis.py",
    "e2e/test_tools.py",
    "e2e/test_routing.py",
)
PER_FAMILY_PATHS = ("engines/", "worker/test_video_patterns.py", "worker/test_audio_patterns.py")
FAST_FAMILY = "qwen2_vl"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    root = Path(__file__).parent
    for item in items:
        if not item.path.is_relative_to(root):
            continue
        path = item.path.relative_to(root).as_posix()
        name = getattr(item, "originalname", item.name)
        callspec = getattr(item, "callspec", None)
        # The family a test runs on: its `tiny_model`, or its module's `model_path` fixture's.
        params = callspec.params if callspec else {}
        family = params.get("tiny_model", params.get("model_path", FAST_FAMILY))
        if (
            path.startswith(SLOW_PATHS)
            or f"{path}::{name}" in SLOW_TESTS
            or (path.startswith(PER_FAMILY_PATHS) and family != FAST_FAMILY)
        ):
            item.add_marker(pytest.mark.slow)
    # The longest modules run first, then the others with slow tests, then the fast ones:
    # pytest-xdist hands out whole modules in this order (`--dist loadfile
    # --no-loadscope-reorder`), so short modules fill the end of the run and the workers finish
    # together, rather than one starting a four-minute module as the others run out of work.
    slow_modules = {item.path for item in items if item.get_closest_marker("slow")}
    longest = {root / path: rank for rank, path in enumerate(LONGEST_MODULES)}
    if missing := [path for path in longest if not path.exists()]:
        raise pytest.UsageError(f"LONGEST_MODULES names modules that do not exist: {missing}")
    items.sort(
        key=lambda item: (longest.get(item.path, len(longest)), item.path not in slow_modules)
    )


_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None]:
    """After a module's last test and its fixtures: the memory it freed goes back to the OS.
    A pytest-xdist worker runs a hundred modules, and glibc keeps what each freed (a module's
    clips or engines: up to a gigabyte) unless trimmed; three workers and their deployments
    share CI's 24 GB."""
    yield
    if nextitem is None or nextitem.path != item.path:
        _LIBC.malloc_trim(0)


@pytest.fixture(scope="session")
def nats_url() -> Iterator[str]:
    """`$NATS_URL` (CI starts one), else a private nats-server for the whole session."""
    with nats_url_from_env_or_private() as url:
        yield url


@pytest.fixture
def private_nats() -> Iterator[NatsServer]:
    """A nats-server of this test alone, which the test may stop, kill and restart."""
    with NatsServer() as server:
        yield server
