"""Run Flower's own NIID-Bench code (FedAvg, FedProx, SCAFFOLD or FedNova) on Flower's own partition, here.

Flower's replication of NIID-Bench (adap/flower ``baselines/niid_bench``) prints cells that fedskew does not reproduce
(docs/reproduction.md): SCAFFOLD on FMNIST #C=2 as 33.80 ± 41.22 (two of three runs collapsed to 10.00) and FedNova
on MNIST Dir(0.5) as 98.03 ± 0.06 (0.86 below its own FedAvg). This script asks the reference itself. It imports,
unchanged, from a checkout of adap/flower: the method's client (``client_fedavg.FlowerClientFedAvg``,
``client_fedprox.FlowerClientFedProx``, ``client_scaffold.FlowerClientScaffold`` or
``client_fednova.FlowerClientFedNova``, which call its ``models.train_*``), its model (``models.CNNMnist``, as its
``main.py`` picks for (F)MNIST), its ``models.test`` and its strategy (Flower's ``FedAvg.aggregate_fit`` for FedAvg and
FedProx, ``strategy.ScaffoldStrategy.aggregate_fit``, ``strategy.FedNovaStrategy.aggregate_fit_custom``). It feeds
them Flower's partition (fedskew's ``--protocol niid-bench --data-seed 42 --partition-rng raw``, client for client
Flower's, as tests/test_niid_bench_flower_partitions.py checks for #C=k, Dir(α) and IID) and applies the server
step Flower's server does: the aggregate replaces the model (FedAvg, FedProx, FedNova); for SCAFFOLD
``server_scaffold.ScaffoldServer.fit_round``'s
``x ← x + Δx``, ``c ← c + (|S|/N)·Δc`` with ``c`` starting at the initial weights. The settings are the configs' in
``conf/*_base.yaml``: 10 clients, all every round, 10 local epochs, batch 64, lr 0.01, momentum 0.9, weight decay
1e-5, μ 0.01 for FedProx. It runs without Ray, one client after another, on the CPU::

    python tools/flower_niid_probe.py --flower PATH/TO/adap-flower --data-dir ../shared/data --method fednova \\
        --dataset mnist --partition dir --alpha 0.5 --seed 0 --rounds 50 --out probe.jsonl
    # Flower's server accepts failed clients: --fail-client 7 drops client 7's round-1 fit (no result, no saved c_i)

One JSON line a round: the global model's test accuracy and loss (Flower's ``test``), and for SCAFFOLD the L1 norm
of ``c``. Flower's code needs Hydra and OmegaConf only to build its objects, which this script does itself, so where
they are not installed both are stood in for by empty modules; ``from flwr.common.typing import Dict, ...`` (gone
from newer Flower) is given the names from ``typing``. Nothing of Flower's code is changed or copied.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import tempfile
import types
import typing
from pathlib import Path

METHODS = {  # the method: its client module and class
    "fedavg": ("client_fedavg", "FlowerClientFedAvg"),
    "fedprox": ("client_fedprox", "FlowerClientFedProx"),
    "scaffold": ("client_scaffold", "FlowerClientScaffold"),
    "fednova": ("client_fednova", "FlowerClientFedNova"),
}
EPOCHS, BATCH, LR, MOMENTUM, WEIGHT_DECAY = 10, 64, 0.01, 0.9, 1e-5  # conf/*_base.yaml


def import_flower(flower: Path, method: str) -> types.SimpleNamespace:
    """The method's client class, Flower's CNNMnist, test and strategies, imported from a checkout of adap/flower."""
    import importlib
    import importlib.util

    package = flower / "baselines" / "niid_bench"
    module, cls = METHODS[method]
    if not (package / "niid_bench" / f"{module}.py").is_file():
        raise SystemExit(f"error: --flower {flower}: no baselines/niid_bench/niid_bench/{module}.py in it")
    # Flower's modules use Hydra and OmegaConf only to build objects from configs: empty stand-ins where not installed
    if importlib.util.find_spec("hydra") is None:
        utils = types.ModuleType("hydra.utils")
        utils.instantiate = utils.call = None  # type: ignore[attr-defined]
        sys.modules["hydra"], sys.modules["hydra.utils"] = types.ModuleType("hydra"), utils
    if importlib.util.find_spec("omegaconf") is None:
        sys.modules["omegaconf"] = types.ModuleType("omegaconf")
        sys.modules["omegaconf"].DictConfig = dict  # type: ignore[attr-defined]
    import flwr.common.typing as flwr_typing

    for name in ("Dict", "List", "Optional", "Tuple", "Union", "Callable"):
        if not hasattr(flwr_typing, name):
            setattr(flwr_typing, name, getattr(typing, name))
    sys.path.insert(0, str(package))
    from niid_bench import models, strategy

    client = getattr(importlib.import_module(f"niid_bench.{module}"), cls)
    return types.SimpleNamespace(Client=client, CNN=models.CNNMnist, test=models.test, strategy=strategy)


def load_federation(args: argparse.Namespace):
    """Flower's partition of the dataset (the ``--data-seed 42 --partition-rng raw`` federation)."""
    from fedskew.config import make_config
    from fedskew.data.federated import build_federated

    values = {"protocol": "niid-bench", "dataset": args.dataset, "partition": args.partition, "alpha": args.alpha}
    values |= {"classes_per_client": args.classes_per_client, "data_dir": args.data_dir, "data_seed": 42}
    values |= {"partition_rng": "raw", "db": None, "skew_probes": 0}
    return build_federated(make_config(None, values))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flower", type=Path, required=True, help="a checkout of adap/flower")
    ap.add_argument("--method", choices=sorted(METHODS), default="scaffold")
    ap.add_argument("--dataset", choices=["mnist", "fmnist"], default="fmnist")
    ap.add_argument("--partition", choices=["pat", "dir", "iid"], default="pat", help="#C=k, Dir(alpha) or IID")
    ap.add_argument("--classes-per-client", type=int, default=2, help="k of #C=k (--partition pat)")
    ap.add_argument("--alpha", type=float, default=0.5, help="alpha of Dir(alpha) (--partition dir)")
    ap.add_argument("--mu", type=float, default=0.01, help="FedProx's proximal mu (conf/fedprox_base.yaml: 0.01)")
    ap.add_argument("--data-dir", default="data", help="where the dataset's official files are")
    ap.add_argument("--seed", type=int, default=0, help="torch's seed: initial model and shuffles")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--fail-client", type=int, default=-1, help="this client's round-1 fit fails (Flower goes on)")
    ap.add_argument("--out", type=Path, help="JSON lines, one a round (default: standard output only)")
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import FedAvg
    from torch.utils.data import DataLoader, TensorDataset

    fl = import_flower(args.flower, args.method)
    torch.set_num_threads(1)
    data = load_federation(args)
    if args.fail_client >= len(data.clients):
        raise SystemExit(f"error: --fail-client {args.fail_client}: the clients are 0 to {len(data.clients) - 1}")
    torch.manual_seed(args.seed)

    def cnn():  # Flower's main.py for (F)MNIST: CNNMnist with input_dim 256, its config's hidden_dims and classes
        return fl.CNN(256, [120, 84], 10)

    params = [v.cpu().numpy() for v in cnn().state_dict().values()]
    server_cv = [torch.from_numpy(a.copy()) for a in params]  # SCAFFOLD: Flower's c starts at the initial weights
    test_loader = DataLoader(TensorDataset(data.x_test.float(), data.y_test.long()), batch_size=64)
    cv_files = tempfile.TemporaryDirectory(prefix="flower-client-cvs-")  # where SCAFFOLD's clients save c_i
    clients = []
    for c in data.clients:
        loader = DataLoader(TensorDataset(c.x_train.float(), c.y_train.long()), batch_size=BATCH, shuffle=True)
        if args.method == "scaffold":
            hyper = (EPOCHS, LR, MOMENTUM, WEIGHT_DECAY, cv_files.name)
            clients.append(fl.Client(str(c.cid), cnn(), loader, loader, "cpu", *hyper))
        elif args.method == "fedprox":
            clients.append(fl.Client(cnn(), loader, loader, "cpu", EPOCHS, args.mu, LR, MOMENTUM, WEIGHT_DECAY))
        else:
            clients.append(fl.Client(cnn(), loader, loader, "cpu", EPOCHS, LR, MOMENTUM, WEIGHT_DECAY))
    # every config: fraction_fit 1e-5 and min_fit_clients 10, so all ten clients fit every round
    every = {"fraction_fit": 1e-5, "fraction_evaluate": 0.0, "min_fit_clients": 10, "min_available_clients": 10}
    if args.method == "scaffold":
        strategy = fl.strategy.ScaffoldStrategy(**every)
    elif args.method == "fednova":
        strategy = fl.strategy.FedNovaStrategy(**every)
    else:  # Flower 1.5.0's FedAvg (the baseline's pin) aggregates out of place; newer ones may in place
        out_of_place = {"inplace": False} if "inplace" in inspect.signature(FedAvg).parameters else {}
        strategy = FedAvg(**every, **out_of_place)
    out = args.out.open("w") if args.out else None
    for rnd in range(1, args.rounds + 1):
        results = []
        for i, client in enumerate(clients):
            if rnd == 1 and i == args.fail_client:
                continue  # its fit raised: no result (and for SCAFFOLD no saved control variate)
            sent = params + [cv.numpy() for cv in server_cv] if args.method == "scaffold" else params
            update, n, metrics = client.fit(sent, {})
            arrays = [u.detach().cpu().numpy() if torch.is_tensor(u) else np.asarray(u) for u in update]
            results.append((None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, metrics)))
        line: dict = {}  # what the method adds to the round's record
        if args.method == "fednova":  # FedNovaServer.fit_round: the strategy steps from the server's parameters
            params = parameters_to_ndarrays(strategy.aggregate_fit_custom(rnd, params, results, [])[0])
        elif args.method == "scaffold":  # ScaffoldServer.fit_round: x ← x + Δx, c ← c + (|S|/N)·Δc
            agg = parameters_to_ndarrays(strategy.aggregate_fit(rnd, results, [])[0])
            half = len(agg) // 2
            share = len(results) / len(clients)
            server_cv = [torch.from_numpy(cv.numpy() + share * agg[half + i]) for i, cv in enumerate(server_cv)]
            params = [x + agg[i] for i, x in enumerate(params)]
            line["c_l1"] = float(sum(np.abs(cv.numpy()).sum() for cv in server_cv))
        else:  # Server.fit_round: the aggregate is the new model
            params = parameters_to_ndarrays(strategy.aggregate_fit(rnd, results, [])[0])
        net = cnn()
        net.load_state_dict({k: torch.Tensor(v) for k, v in zip(net.state_dict().keys(), params, strict=True)})
        loss, acc = fl.test(net, test_loader, "cpu")
        line = {"round": rnd, "acc": acc, "loss": loss, **line}
        print(json.dumps(line), flush=True)
        if out:
            out.write(json.dumps(line) + "\n")
            out.flush()
    cv_files.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
