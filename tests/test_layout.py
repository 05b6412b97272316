"""The package layout the architecture relies on: no import cycle between mmserve's packages;
the engines reach the router's concepts only through `kv/`, and neither the engines nor that
contract depend on the NATS runtime; the runtime is transport alone (its retry policy included),
the deployment's topology (roles, endpoints, next hop) the ground everyone stands on, and only
the frontend routes."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "components" / "src" / "mmserve"


def _imports() -> dict[str, set[str]]:
    """Top-level package (or module) -> the other mmserve packages it imports, lazily or not."""
    edges: dict[str, set[str]] = {}
    for source in PACKAGE.rglob("*.py"):
        owner = source.relative_to(PACKAGE).parts[0].removesuffix(".py")
        for node in ast.walk(ast.parse(source.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "mmserve" and len(parts) > 1 and parts[1] not in (owner, "_mm"):
                    edges.setdefault(owner, set()).add(parts[1])
    return edges


def _reaches(edges: dict[str, set[str]], start: str, goal: str) -> bool:
    pending, seen = list(edges.get(start, ())), set()
    while pending:
        node = pending.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            pending.extend(edges.get(node, ()))
    return False


def test_no_import_cycle_between_packages() -> None:
    edges = _imports()
    assert "engines" in edges and "router" in edges  # the scan sees the packages
    cycles = sorted(
        (a, b) for a, targets in edges.items() for b in targets if _reaches(edges, b, a)
    )
    assert not cycles, f"packages that import each other: {cycles}"


def test_engines_do_not_import_the_router() -> None:
    assert "router" not in _imports()["engines"]


def test_the_engines_and_the_kv_contract_do_not_reach_the_runtime() -> None:
    edges = _imports()
    for package in ("engines", "kv"):
        assert not _reaches(edges, package, "runtime"), f"{package} reaches mmserve.runtime"


def test_importing_the_engine_base_does_not_load_nats() -> None:
    probe = "import sys, mmserve.engines.base; print('nats' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"


def test_the_runtime_imports_only_the_protocol() -> None:
    assert _imports()["runtime"] == {"protocol"}


def test_the_topology_imports_no_other_package() -> None:
    assert (PACKAGE / "topology.py").is_file()
    assert "topology" not in _imports()


def test_only_the_frontend_imports_the_router() -> None:
    importers = {owner for owner, targets in _imports().items() if "router" in targets}
    assert importers == {"frontend"}


def test_the_role_core_names_no_transport() -> None:
    """The roles' logic is written once: the NATS workers and the Dynamo backend adapt it, and
    it reaches neither of them, nor the NATS runtime beyond its error type."""
    edges = _imports()
    assert not edges["roles"] & {"worker", "dynamo", "frontend"}
    assert {"worker", "dynamo"} <= {owner for owner, targets in edges.items() if "roles" in targets}
    probe = "import sys, mmserve.roles; print('nats' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"


def test_the_dynamo_backend_shares_only_the_options_of_the_nats_workers() -> None:
    """Dynamo's adapters stand beside the NATS ones, not on them: of `worker` they use only the
    flags and engine loading every worker process shares."""
    modules = set()
    for source in (PACKAGE / "dynamo").rglob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if module is not None and module.startswith("mmserve.worker"):
                modules.add(module)
    assert modules == {"mmserve.worker.options"}


def test_the_models_package_holds_checkpoint_facts_not_test_model_builders() -> None:
    modules = sorted(p.name for p in (PACKAGE / "models").glob("*.py"))
    assert modules == ["__init__.py", "family.py", "tokenizer.py"]
    assert not _reaches(_imports(), "models", "tiny")


def test_the_command_line_loads_no_torch() -> None:
    """Every `mmserve` command builds the whole parser first: `mmserve nats`, which a launch
    script waits on before anything else starts, must not pay seconds of torch's import (more
    on a loaded machine) for the flags of the components that use it."""
    probe = (
        "import sys; from mmserve.cli import build_parser; build_parser(); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"
