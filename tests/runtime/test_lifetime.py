"""The `mmserve` command exits without the interpreter's teardown, whichever way `main()` ends.

Why it matters: a component imports triton (transformers' masking_utils imports torch._dynamo,
which imports triton when it is installed) and then freezes its start-up heap (runtime/heap.py).
Frozen objects are never collected, so at teardown triton's nanobind extension finds its objects
still alive and prints a `nanobind: leaked ...` report, some thirty lines, after every stop."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="needs triton, whose teardown leaks"
)

# What a component does before it serves: triton loaded, the heap frozen; then `main()` ends
# the way the case says.
PRELUDE = "import gc, sys, triton; gc.freeze(); import mmserve.cli as cli\n"
ENDINGS = {
    "returns": ("cli.main = lambda: 0", 0),
    "exits": ("cli.main = lambda: sys.exit(3)", 3),
    "fails": ("def main():\n    raise RuntimeError('the engine broke')\ncli.main = main", 1),
    "interrupted": ("def main():\n    raise KeyboardInterrupt\ncli.main = main", 130),
}


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )


def test_the_teardown_of_a_frozen_heap_with_triton_does_print_the_leak_report() -> None:
    """The premise: a plain exit of such a process prints the report (if a triton stops leaking,
    the tests below prove nothing, and this says so)."""
    plain = _python(PRELUDE + "sys.exit(0)")
    if "nanobind: leaked" not in plain.stderr:
        pytest.skip("this triton's teardown prints no leak report")
    assert plain.returncode == 0


@pytest.mark.parametrize("ending", ENDINGS)
def test_the_command_exits_quietly_whichever_way_main_ends(ending: str) -> None:
    code, status = ENDINGS[ending]
    done = _python(f"{PRELUDE}{code}\ncli.run()")
    assert done.returncode == status, done.stderr
    assert "leaked" not in done.stderr, done.stderr
    if ending == "fails":  # the error itself is not hidden
        assert "Traceback" in done.stderr and "RuntimeError: the engine broke" in done.stderr
    else:
        assert done.stderr == ""
