"""The tune specs shipped under benchmarks/ stay valid as the settings evolve: each parses as a TuneSpec, its base is
a valid run configuration and every method resolves."""

from pathlib import Path

import pytest
import yaml

from fedskew.config import make_config
from fedskew.methods import resolve_method
from fedskew.tuning.spec import MethodEntry, TuneSpec

SPECS = sorted((Path(__file__).resolve().parents[1] / "benchmarks").glob("tune_*.yaml"))


@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_a_shipped_tune_spec_is_valid(path):
    spec = TuneSpec.model_validate(yaml.safe_load(path.read_text()))
    make_config(None, dict(spec.base))
    for entry in spec.methods:
        name, args = (entry.name, entry.args) if isinstance(entry, MethodEntry) else (entry, {})
        resolve_method(name, args)


def test_the_fedsa_cpu_specs_share_one_tuned_file():
    specs = [yaml.safe_load(p.read_text()) for p in SPECS if p.stem.startswith("tune_fedsa_cpu")]
    assert len(specs) == 2 and len({s["tuned"] for s in specs}) == 1
