"""Components forked from a process that has already imported torch and transformers
(multiprocessing's forkserver with those modules preloaded), instead of each starting a fresh
interpreter: the child runs the same entry point (`mmserve.cli.main`, or the Dynamo worker's
`mmserve.dynamo.cli.main`) without the seconds of imports every component otherwise pays. The
e2e tests start hundreds of components, on two cores.

The forkserver imports modules, reads the two tokenizers most components serve and freezes its
heap (`forkserver_warm.py`), but runs nothing else (no torch op, no thread, no event loop), so
a fork of it is a clean start. What it cannot give a child is a different value of a variable
read while those modules were imported; `can_fork` says when a component needs its own
interpreter instead (the deployments in `tests/support/` fall back to one).
"""

from __future__ import annotations

import atexit
import functools
import importlib
import multiprocessing
import multiprocessing.context
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from multiprocessing import forkserver
from pathlib import Path

import numpy

from mmserve.runtime.lifetime import set_parent_death_signal

# The heavy third-party modules every component imports: what the forkserver imports once.
# mmserve's own modules (a fraction of a second) are imported in each child, so state they
# draw at import (a frontend's request-id prefix) is each process's own, as in production;
# the last entry imports a few that draw none (it reads tokenizers, `forkserver_warm.py`).
PRELOAD = [
    "torch",
    "numpy",
    "transformers",
    "transformers.activations",
    "transformers.masking_utils",
    "transformers.modeling_utils",
    "transformers.models.qwen2_vl.modeling_qwen2_vl",
    "transformers.models.qwen2_5_vl.modeling_qwen2_5_vl",
    "transformers.models.qwen3_vl.modeling_qwen3_vl",
    "transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe",
    "transformers.models.gemma3.modeling_gemma3",
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.qwen2_audio.modeling_qwen2_audio",
    "transformers.models.qwen2_5_omni.modeling_qwen2_5_omni",
    "transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe",
    "httpx",
    "msgspec",
    "nats",
    "uvicorn",
    "tests.support.forkserver_warm",
]
# Read while the modules above are imported (so fixed in the forkserver): a component whose
# value differs from the forkserver's gets an interpreter of its own.
IMPORT_TIME_VARIABLES = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",
        "DYN_NVTX",
        "HF_HOME",
        "HF_HUB_CACHE",
        "HF_HUB_OFFLINE",
        "LD_LIBRARY_PATH",
        "LD_PRELOAD",
        "MKL_NUM_THREADS",
        "OMP_NUM_THREADS",
        "PYTHONHASHSEED",
        "PYTHONPATH",
    }
)
FORKSERVER_ENV = {"HF_HUB_OFFLINE": "1"}
# The checkpoints whose tokenizers the forkserver reads (`forkserver_warm.py`), os.pathsep-joined.
WARM_TOKENIZERS_ENV = "MMSERVE_TESTS_WARM_TOKENIZERS"


@functools.cache
def _forkserver() -> tuple[multiprocessing.context.ForkServerContext, dict[str, str]]:
    """The context whose processes fork from the preloaded forkserver (started now, with this
    process's environment plus `FORKSERVER_ENV`), and that environment."""
    from mmserve.tiny.checkpoints import build_tiny_model
    from mmserve.tiny.trained import build_trained_model

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    # The two checkpoints most components serve (the tiny Qwen2-VL, the default model), built
    # here first so that the forkserver finds them on a fresh machine too.
    warm = [build_tiny_model("qwen2_vl"), build_trained_model()]
    server_only = {**FORKSERVER_ENV, WARM_TOKENIZERS_ENV: os.pathsep.join(map(str, warm))}
    saved = {name: os.environ.get(name) for name in server_only}
    os.environ.update(server_only)
    try:
        server_env = dict(os.environ)
        forkserver.ensure_running()
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value
    return context, server_env


def can_fork(env: Mapping[str, str]) -> bool:
    """Whether a component with this environment can start as a fork of the forkserver."""
    _, server_env = _forkserver()
    return all(env.get(name) == server_env.get(name) for name in IMPORT_TIME_VARIABLES)


def _run(entry: str, argv: list[str], env: dict[str, str], log_path: str) -> None:
    """The child: a session of its own (as `start_new_session`), ending with the forkserver,
    output to the (emptied) log, the component's environment, then `entry(argv)`."""
    os.setsid()
    set_parent_death_signal(signal.SIGTERM)
    numpy.random.seed()  # the forkserver's global state would be every child's
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(env)
    module, _, function = entry.partition(":")
    sys.argv = [module, *argv]
    main = getattr(importlib.import_module(module), function)
    try:
        code = main(argv)
    finally:
        # multiprocessing's children leave with os._exit, which skips these.
        atexit._run_exitfuncs()
    sys.exit(code)


class ForkedProcess:
    """A forked component behind the part of `subprocess.Popen`'s interface the tests use."""

    def __init__(
        self,
        argv: list[str],
        env: Mapping[str, str],
        log_path: Path,
        entry: str = "mmserve.cli:main",
    ) -> None:
        """`entry` ("module:function", the function taking argv and returning an exit code)
        is what `python -m module argv` would run."""
        # Emptied here, not in the child: whoever reads the log next must not find the
        # previous process's lines in it.
        log_path.write_bytes(b"")
        self._process = _forkserver()[0].Process(
            target=_run, args=(entry, argv, dict(env), str(log_path)), daemon=True
        )
        self._process.start()
        self.args = argv

    @property
    def pid(self) -> int:
        assert self._process.pid is not None
        return self._process.pid

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, signum)
