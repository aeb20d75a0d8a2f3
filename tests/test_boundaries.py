"""The architecture's import boundaries: client and server code meet only in the registry and the engine, through
the neutral protocol module (fedskew/protocol.py)."""

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "fedskew"


def _imports(path: Path) -> set[str]:
    """Every fedskew module a file imports, at any depth (function-level imports count too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fedskew"):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("fedskew"))
    return out


def _package(name: str) -> list[Path]:
    return sorted((SRC / name).glob("*.py"))


@pytest.mark.parametrize("side, other", [("client", "fedskew.server"), ("server", "fedskew.client")])
def test_client_and_server_never_import_each_other(side, other):
    files = _package(side)
    assert files
    for f in files:
        bad = sorted(m for m in _imports(f) if m == other or m.startswith(other + "."))
        assert not bad, f"{f.relative_to(SRC)} imports {bad}; exchange types through fedskew.protocol"


def test_protocol_imports_neither_side():
    assert _imports(SRC / "protocol.py") == set()


def test_no_import_cycle_between_config_and_methods():
    assert not any(m.startswith("fedskew.config") for m in _imports(SRC / "methods.py"))


def test_results_store_does_not_reach_into_the_engine():
    for f in _package("results"):
        assert not any(m.startswith("fedskew.engine.loop") for m in _imports(f)), f
