"""Run Flower's own NIID-Bench SCAFFOLD code on Flower's own FMNIST #C=2 partition, to see whether it collapses.

Flower's replication of NIID-Bench (adap/flower ``baselines/niid_bench``) prints SCAFFOLD on FMNIST #C=2 as
33.80 ± 41.22 (best round of 50, three runs): only 10.00, 10.00 and 81.40 give that, so two of its runs never rose
above a constant prediction. fedskew's SCAFFOLD never collapsed there (docs/reproduction.md). This script asks the
reference itself: it imports Flower's client (``client_scaffold.FlowerClientScaffold``, which calls its
``models.train_scaffold``), its model (``models.CNNMnist``), its test function and its strategy
(``strategy.ScaffoldStrategy.aggregate_fit``) from a checkout of adap/flower, feeds them Flower's partition (fedskew's
``--protocol niid-bench --partition pat --data-seed 42 --partition-rng raw``, client for client Flower's, as
tests/test_niid_bench.py checks) and applies Flower's server step (``server_scaffold.ScaffoldServer.fit_round``:
``x ← x + Δx``, ``c ← c + (|S|/N)·Δc``, with ``c`` starting at the initial weights as its
``_get_initial_parameters`` does). It runs without Ray, one client after another, on the CPU::

    python tools/flower_scaffold_probe.py --flower PATH/TO/adap-flower --data-dir ../shared/data --seed 0 \\
        --rounds 50 --out probe.jsonl
    # Flower's server accepts failed clients: --fail-client 7 drops client 7's round-1 fit (no result, no saved c_i)

One JSON line a round: the global model's test accuracy and loss (Flower's ``test``) and the L1 norm of ``c``.
Flower's code needs Hydra and OmegaConf only to build its objects, which this script does itself, so both are stood
in for by empty modules; ``strategy.py``'s ``from flwr.common.typing import Dict, ...`` (gone from newer Flower) is
given the names from ``typing``. Nothing of Flower's code is changed or copied.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import types
import typing
from pathlib import Path


def _import_flower(flower: Path) -> types.SimpleNamespace:
    package = flower / "baselines" / "niid_bench"
    if not (package / "niid_bench" / "client_scaffold.py").is_file():
        raise SystemExit(f"error: --flower {flower}: no baselines/niid_bench/niid_bench/client_scaffold.py in it")
    for name in ("hydra", "hydra.utils", "omegaconf"):  # used by Flower's modules only to build objects from configs
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["hydra.utils"].instantiate = sys.modules["hydra.utils"].call = None  # type: ignore[attr-defined]
    sys.modules["omegaconf"].DictConfig = dict  # type: ignore[attr-defined]
    import flwr.common.typing as flwr_typing

    for name in ("Dict", "List", "Optional", "Tuple", "Union", "Callable"):
        if not hasattr(flwr_typing, name):
            setattr(flwr_typing, name, getattr(typing, name))
    sys.path.insert(0, str(package))
    from niid_bench.client_scaffold import FlowerClientScaffold
    from niid_bench.models import CNNMnist, test
    from niid_bench.strategy import ScaffoldStrategy

    return types.SimpleNamespace(Client=FlowerClientScaffold, CNN=CNNMnist, test=test, Strategy=ScaffoldStrategy)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--flower", type=Path, required=True, help="a checkout of adap/flower")
    ap.add_argument("--data-dir", default="data", help="where FMNIST's official files are")
    ap.add_argument("--seed", type=int, default=0, help="torch's seed: initial model and shuffles")
    ap.add_argument("--rounds", type=int, default=50)
    ap.add_argument("--fail-client", type=int, default=-1, help="this client's round-1 fit fails (Flower goes on)")
    ap.add_argument("--out", type=Path, help="JSON lines, one a round (default: standard output only)")
    args = ap.parse_args(argv)

    import numpy as np
    import torch
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from torch.utils.data import DataLoader, TensorDataset

    from fedskew.config import make_config
    from fedskew.data.federated import build_federated

    fl = _import_flower(args.flower)
    torch.set_num_threads(1)
    values = {"protocol": "niid-bench", "dataset": "fmnist", "partition": "pat", "classes_per_client": 2}
    values |= {"data_dir": args.data_dir, "data_seed": 42, "partition_rng": "raw", "db": None, "skew_probes": 0}
    data = build_federated(make_config(None, values))
    torch.manual_seed(args.seed)

    def cnn():  # Flower's main.py for (F)MNIST: CNNMnist with input_dim 256, its config's hidden_dims and classes
        return fl.CNN(256, [120, 84], 10)

    params = [v.cpu().numpy() for v in cnn().state_dict().values()]
    server_cv = [torch.from_numpy(a.copy()) for a in params]  # Flower's c starts at the initial weights
    test_loader = DataLoader(TensorDataset(data.x_test.float(), data.y_test.long()), batch_size=64)
    cv_files = tempfile.TemporaryDirectory(prefix="flower-client-cvs-")  # where its clients save c_i; removed at exit
    cv_dir = cv_files.name
    clients = []
    for c in data.clients:
        loader = DataLoader(TensorDataset(c.x_train.float(), c.y_train.long()), batch_size=64, shuffle=True)
        # scaffold_base.yaml: 10 epochs, lr 0.01, momentum 0.9, weight decay 1e-5
        clients.append(fl.Client(str(c.cid), cnn(), loader, loader, "cpu", 10, 0.01, 0.9, 1e-5, cv_dir))
    strategy = fl.Strategy(fraction_fit=1e-5, fraction_evaluate=0.0, min_fit_clients=10, min_available_clients=10)
    out = args.out.open("w") if args.out else None
    for rnd in range(1, args.rounds + 1):
        results = []
        for client in clients:
            if rnd == 1 and int(client.cid) == args.fail_client:
                continue  # its fit raised: no result and no saved control variate
            update, n, _ = client.fit(params + [cv.numpy() for cv in server_cv], {})
            arrays = [u.detach().cpu().numpy() if torch.is_tensor(u) else np.asarray(u) for u in update]
            results.append((None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), n, {})))
        agg = parameters_to_ndarrays(strategy.aggregate_fit(rnd, results, [])[0])
        half = len(agg) // 2
        share = len(results) / len(clients)  # Flower's server: |S| / N
        server_cv = [torch.from_numpy(cv.numpy() + share * agg[half + i]) for i, cv in enumerate(server_cv)]
        params = [x + agg[i] for i, x in enumerate(params)]
        net = cnn()
        net.load_state_dict({k: torch.Tensor(v) for k, v in zip(net.state_dict().keys(), params, strict=True)})
        loss, acc = fl.test(net, test_loader, "cpu")
        norm = float(sum(np.abs(cv.numpy()).sum() for cv in server_cv))
        line = json.dumps({"round": rnd, "acc": acc, "loss": loss, "c_l1": norm})
        print(line, flush=True)
        if out:
            out.write(line + "\n")
            out.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
