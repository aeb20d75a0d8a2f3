"""The library API (fedskew.run / from_arrays / from_clients / split_model / weighting) and the plug-in registry."""

import json
import sys

import numpy as np
import pytest
import torch
from torch import nn

import fedskew
from fedskew import registry
from fedskew.methods import resolve_method
from fedskew.models.custom import SplitError, split_model
from fedskew.registry import ClientPart, NoParams, ServerPlugin
from fedskew.schema import ConfigError, StrictSettings


@pytest.fixture(autouse=True)
def _clean_registry(one_thread):
    """Parts registered by a test are removed after it (the registry is process-wide)."""
    before = set(registry.ORIGIN)
    yield
    for name in set(registry.ORIGIN) - before:
        registry.unregister(name)


def _digits_features():
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images.astype(np.float32) / 16.0).reshape(-1, 64), d.target


class TwoLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


# ---- end to end -------------------------------------------------------------------------------------------------


def test_run_on_arrays_with_a_user_model_learns_and_is_reproducible(tmp_path):
    x, y = _digits_features()
    data = fedskew.from_arrays(x, y)
    kw = {"model": TwoLayer, "rounds": 4, "clients": 5, "alpha": 0.5, "seed": 1, "lr": 0.1}
    a = fedskew.run("fedavg", data, **kw)
    b = fedskew.run("fedavg", data, **kw)
    assert a.run_dir is None and a.config["model"] == "custom:TwoLayer" and a.config["dataset"] == "arrays"
    assert len(a.records) == 4 and a.records[-1]["global_acc"] > 0.5  # chance is 0.1
    strip = [{k: v for k, v in r.items() if not k.startswith("time_")} for r in a.records]
    assert strip == [{k: v for k, v in r.items() if not k.startswith("time_")} for r in b.records]


def test_run_keeps_the_run_directory_and_database_only_when_asked(tmp_path):
    x, y = _digits_features()
    data = fedskew.from_arrays(x, y)
    res = fedskew.run("fedavg", data, rounds=2, clients=4, out=tmp_path / "r", db=tmp_path / "d.db")
    assert res.run_dir == tmp_path / "r"
    lines = [json.loads(s) for s in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert lines == res.records
    assert json.loads((tmp_path / "r" / "summary.json").read_text()) == res.summary
    from fedskew.results.store import ResultsDB

    with ResultsDB(tmp_path / "d.db") as db:
        assert db.has_run(res.run_id)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.db", "d.db-shm", "d.db-wal", "r"] or (
        {"d.db", "r"} <= {p.name for p in tmp_path.iterdir()}
    )
    assert not (tmp_path / "runs").exists()  # no default output in the working directory


def test_api_on_the_builtin_digits_equals_the_cli(tmp_path):
    from fedskew.cli import main

    assert main(["run", "--rounds", "2", "--clients", "4", "--out", str(tmp_path / "cli"), "--no-db", "--quiet"]) == 0
    cli = [json.loads(s) for s in (tmp_path / "cli" / "metrics.jsonl").read_text().splitlines()]
    api = fedskew.run("fedavg", rounds=2, clients=4).records
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time_")}  # noqa: E731
    assert [drop(r) for r in api] == [drop(r) for r in cli]


def test_from_clients_accepts_torch_datasets_and_uses_them_as_given():
    from torch.utils.data import TensorDataset

    from fedskew.config import make_config
    from fedskew.data.federated import build_federated

    x, y = _digits_features()
    parts = [TensorDataset(torch.from_numpy(x[i::3]), torch.from_numpy(y[i::3])) for i in range(3)]
    data = fedskew.from_clients(parts)
    cfg = make_config(None, {"dataset": data.name, "partition": "given", "clients": 3, "train_ratio": 0.8})
    fed = build_federated(cfg, dataset=data)
    assert fed.num_clients == 3
    assert sum(len(c.y_train) + len(c.y_test) for c in fed.clients) == len(y)
    for i, c in enumerate(fed.clients):  # client i holds exactly its given samples
        got = torch.cat([c.x_train, c.x_test]).sort(0).values
        assert torch.equal(got, torch.from_numpy(x[i::3]).sort(0).values)
    res = fedskew.run("fedprox", data, model=TwoLayer(), rounds=2)
    assert res.config["clients"] == 3 and res.config["partition"] == "given" and len(res.records) == 2
    tests = [(x[i::3][:20], y[i::3][:20]) for i in range(3)]
    given = fedskew.from_clients([(x[i::3][20:], y[i::3][20:]) for i in range(3)], test=tests)
    fed = build_federated(cfg, dataset=given)
    assert [len(c.y_test) for c in fed.clients] == [20, 20, 20]


@pytest.mark.parametrize(
    ("x", "y", "message"),
    [
        (np.zeros((4, 3), np.float32), np.array([0, 1, 0]), "one label per sample"),
        (np.full((4, 3), np.nan, np.float32), np.array([0, 1, 0, 1]), "NaN"),
        (np.zeros((4, 3), np.float32), np.array([0.5, 1, 0, 1]), "integers"),
        (np.zeros((4, 3), np.float32), np.array([0, 0, 0, 0]), "at least 2 classes"),
        (np.zeros(4, np.float32), np.array([0, 1, 0, 1]), "feature dimension"),
        (np.zeros((4, 3), np.int32), np.array([0, 1, 0, 1]), "uint8"),
    ],
)
def test_bad_arrays_are_refused_with_the_problem_named(x, y, message):
    with pytest.raises(ConfigError, match=message):
        fedskew.from_arrays(x, y)


def test_labels_out_of_range_and_bad_settings_are_refused():
    with pytest.raises(ConfigError, match=r"\[0, 3\)"):
        fedskew.from_arrays(np.zeros((4, 2), np.float32), np.array([0, 1, 2, 3]), num_classes=3)
    x, y = _digits_features()
    with pytest.raises(ConfigError, match="rounds"):
        fedskew.run("fedavg", fedskew.from_arrays(x, y), rounds=0)
    with pytest.raises(ConfigError, match="from_arrays"):
        fedskew.run("fedavg", data=[1, 2, 3])


# ---- the body/head split ----------------------------------------------------------------------------------------


def test_split_is_inferred_from_the_last_linear_and_reproduces_the_model():
    torch.manual_seed(0)
    net = TwoLayer()
    model = split_model(net, example=torch.randn(3, 64))
    x = torch.randn(5, 64)
    assert torch.allclose(model.head(model.body(x)), net(x))
    assert sorted(model.state_dict()) == ["body.fc1.bias", "body.fc1.weight", "head.bias", "head.weight"]
    seq = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU(), nn.Linear(8, 3))
    m2 = split_model(seq, example=torch.randn(2, 8, 8))
    assert isinstance(m2.head, nn.Linear) and m2.head.out_features == 3


def test_split_refuses_what_it_cannot_infer():
    class Softmaxed(TwoLayer):
        def forward(self, x):
            return torch.softmax(super().forward(x), dim=1)

    class NoLinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(1, 2, 3)

        def forward(self, x):
            return self.conv(x).flatten(1)

    with pytest.raises(SplitError, match="softmax"):
        split_model(Softmaxed(), example=torch.randn(2, 64))
    with pytest.raises(SplitError, match="no nn.Linear"):
        split_model(NoLinear(), example=torch.randn(2, 1, 5, 5))
    with pytest.raises(SplitError, match="both"):
        split_model(TwoLayer(), body=nn.Identity())


def test_declared_split_and_moon_projection_on_a_user_model():
    body = nn.Sequential(nn.Linear(64, 16), nn.ReLU())
    model = split_model(nn.Module(), body=body, head=nn.Linear(16, 10))
    assert model.head(model.body(torch.randn(2, 64))).shape == (2, 10)
    x, y = _digits_features()
    res = fedskew.run("moon", fedskew.from_arrays(x, y), model=TwoLayer, rounds=2, clients=4)
    assert len(res.records) == 2  # the projection head (width 256) was added to the user's model


# ---- user plug-ins ----------------------------------------------------------------------------------------------


def test_user_weighting_composes_with_a_builtin_client_part():
    calls = []

    @fedskew.weighting("invloss_test")
    def inverse_loss(rin, params):
        """weights ∝ 1 / local training loss"""
        calls.append(rin.metrics["train_loss"].clone())
        return 1.0 / rin.metrics["train_loss"]

    m = resolve_method("fedprox+invloss_test", {"mu": 0.1})
    assert m.name == "fedprox+invloss_test" and m.args["mu"] == 0.1
    x, y = _digits_features()
    res = fedskew.run("fedprox+invloss_test", fedskew.from_arrays(x, y), rounds=2, clients=4)
    w = torch.tensor(res.records[-1]["diagnostics"]["weights"], dtype=torch.float64)
    inv = 1.0 / calls[-1]
    assert torch.allclose(w, inv / inv.sum())
    with pytest.raises(ConfigError, match="weights"):  # the base server's weights key is refused with a weighting
        resolve_method("fedprox+invloss_test", {"weights": "uniform"})


def test_user_combine_with_parameters():
    class Shrink(StrictSettings):
        factor: float = 1.0

    @fedskew.combine("shrunk_mean_test", params=Shrink)
    def shrunk(rin, weights, p):
        w = weights.to(torch.float64)
        return {
            n: (torch.einsum("k,k...->...", w, t.to(torch.float64)) * p.factor).to(t.dtype)
            if t.is_floating_point()
            else t[0]
            for n, t in rin.params.items()
        }

    m = resolve_method("fedavg+shrunk_mean_test", {"factor": 0.5})
    assert m.args["factor"] == 0.5
    with pytest.raises(ConfigError, match="no hyper-parameter 'scale'"):
        resolve_method("fedavg+shrunk_mean_test", {"scale": 0.5})


def test_registry_refuses_bad_parts():
    base = {"summary": "s", "paper": "p", "params": NoParams, "build": lambda p: {}}
    with pytest.raises(ConfigError, match="clashes"):
        fedskew.register(ServerPlugin("disco", roles=("weighting",), **base))
    with pytest.raises(ConfigError, match="roles"):
        fedskew.register(ServerPlugin("odd_roles", roles=("reweighting",), **base))
    with pytest.raises(ConfigError, match="StrictSettings"):
        fedskew.register(ServerPlugin("loose", roles=("weighting",), **{**base, "params": dict}))
    with pytest.raises(ConfigError, match="lower-case"):
        fedskew.register(ServerPlugin("Bad+Name", roles=("weighting",), **base))
    with pytest.raises(ConfigError, match="built-in"):
        registry.unregister("fedprox")
    fedskew.register(ServerPlugin("empty_build", roles=("weighting",), **base))
    with pytest.raises(ConfigError, match="declares roles"):  # a build must return exactly its declared roles
        resolve_method("fedavg+empty_build", {})
    fedskew.register(ServerPlugin("second_weights", roles=("weighting",), **{**base, "build": _uniform_build}))
    with pytest.raises(ConfigError, match="two plug-ins both set the server's weighting"):
        resolve_method("fedavg+disco+second_weights", {})


def _uniform_build(p):
    from fedskew.server.weights import UniformWeights

    return {"weighting": UniformWeights()}


def test_user_client_part_runs_on_the_one_loop():
    class Smooth(StrictSettings):
        eps: float = 0.1

    class LabelSmoothing(fedskew.LocalAlgorithm):
        name = "smooth"

        def __init__(self, eps: float) -> None:
            self.eps = eps

        def loss(self, ctx, logits, features, y, x):
            return nn.functional.cross_entropy(logits, y, label_smoothing=self.eps)

    fedskew.register(ClientPart("smooth_test", "label smoothing", "user", Smooth, lambda p: LabelSmoothing(p.eps)))
    res = fedskew.run("smooth_test+disco", rounds=2, clients=4, method_args={"eps": 0.2})
    assert res.config["method_args"] == {"eps": 0.2} and len(res.records) == 2


def test_an_installed_plugin_package_is_discovered_through_its_entry_point(tmp_path, monkeypatch):
    """A real distribution on sys.path (a dist-info with entry_points.txt, as pip writes it): its part appears in
    the registry, `fedskew methods` and method names."""
    pkg = tmp_path / "site"
    (pkg / "fedskew_plugin_test").mkdir(parents=True)
    (pkg / "fedskew_plugin_test" / "__init__.py").write_text(
        "import torch\n"
        "from fedskew.registry import NoParams, ServerPlugin\n"
        "from fedskew.server.api import Weighting\n"
        "class Uniformish(Weighting):\n"
        "    def __call__(self, rin, masks, state):\n"
        "        k = rin.num_participants\n"
        "        return torch.full((k,), 1.0 / k, dtype=torch.float64), None\n"
        "PLUGIN = ServerPlugin('plugged_uniform', 'uniform weights from a plug-in package', 'test', NoParams,\n"
        "                      ('weighting',), lambda p: {'weighting': Uniformish()})\n"
    )
    info = pkg / "fedskew_plugin_test-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fedskew-plugin-test\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fedskew.methods]\nplugged = fedskew_plugin_test:PLUGIN\n")
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setattr(registry, "_loaded_entry_points", False)
    assert "plugged_uniform" not in registry.SERVER_PLUGINS
    m = resolve_method("fedprox+plugged_uniform", {})  # resolving loads the entry points
    assert registry.ORIGIN["plugged_uniform"].startswith("entry point fedskew_plugin_test")
    assert m.name == "fedprox+plugged_uniform"
    from fedskew.cli import main

    monkeypatch.setattr(sys, "argv", ["fedskew"])
    assert main(["methods"]) == 0


def test_a_broken_entry_point_is_reported_by_name(tmp_path, monkeypatch):
    pkg = tmp_path / "site"
    info = pkg / "broken_plugin-0.1.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fedskew.methods]\nbroken = no_such_module_xyz:PART\n")
    monkeypatch.syspath_prepend(str(pkg))
    monkeypatch.setattr(registry, "_loaded_entry_points", False)
    with pytest.raises(ConfigError, match="broken"):
        resolve_method("fedavg", {})


def test_class_names_and_a_too_narrow_model_are_named_errors(tmp_path):
    """Issue 46: string labels and a user model with fewer outputs than classes were tracebacks."""
    from fedskew.api import from_arrays, from_clients

    x = np.random.default_rng(0).random((60, 1, 8, 8)).astype("float32")
    with pytest.raises(ConfigError, match=r"labels must be integers 0 \.\. C-1, got dtype <U3 \(class names\?"):
        from_arrays(x, np.array(["cat", "dog", "owl"] * 20))
    with pytest.raises(ConfigError, match="got dtype object"):
        from_clients([(x[:30], np.array(["a"] * 30, dtype=object)), (x[30:], np.array(["b"] * 30, dtype=object))])

    class Narrow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 8))
            self.head = nn.Linear(8, 3)

        def forward(self, v):
            return self.head(self.body(v))

    data = from_arrays(x, np.arange(60) % 5)
    with pytest.raises(ConfigError, match="the model outputs 3 logits per sample but 'arrays' has 5 classes"):
        fedskew.run("fedavg", data, model=Narrow(), rounds=1, clients=2, db=None, out=str(tmp_path / "r"))
