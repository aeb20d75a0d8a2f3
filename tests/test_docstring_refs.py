"""Every fully qualified cross-reference in a docstring (``:func:`fedskew.x.y```, ``:class:``, ``:mod:``, ...) names
something that exists: a function moved to another module leaves no reference pointing at where it was."""

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ROLE = re.compile(r":(?:func|class|mod|meth|data|attr|exc|obj):`~?(fedskew(?:\.\w+)+)`")


def resolves(ref: str) -> bool:
    parts = ref.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    for name in parts[i:]:
        if obj is not None and hasattr(obj, name):
            obj = getattr(obj, name)
            continue
        # a dataclass field with a default factory, a pydantic field or an annotated attribute: not a class attribute
        fields = {**getattr(obj, "__dataclass_fields__", {}), **getattr(obj, "model_fields", {})}
        if obj is None or name not in fields and name not in getattr(obj, "__annotations__", {}):
            return False
        obj = None
    return True


def references() -> dict[str, str]:
    found: dict[str, str] = {}
    for path in sorted((ROOT / "src" / "fedskew").rglob("*.py")):
        for m in ROLE.finditer(path.read_text(encoding="utf-8")):
            found.setdefault(m.group(1), str(path.relative_to(ROOT)))
    return found


def test_every_qualified_docstring_reference_resolves():
    refs = references()
    assert len(refs) > 100, "the pattern no longer finds the docstrings' references"
    stale = {ref: where for ref, where in refs.items() if not resolves(ref)}
    assert not stale, f"references to names that do not exist (moved or renamed?): {stale}"


def test_a_stale_reference_is_caught():
    assert resolves("fedskew.engine.state_store.keep_model") and resolves("fedskew.registry.ClientPart.tunable")
    assert not resolves("fedskew.engine.state_store.store_copy")
    assert not resolves("fedskew.client.batched_form.batched_form")
