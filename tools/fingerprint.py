"""Fingerprint every composition's numbers on the embedded digits, to prove a refactor changes no result.

A refactor of the engine or of a server piece must leave every number bit-identical. This runs each client part
alone, ``fedavg`` with each server plug-in, every client part with the plug-ins of the four papers (``disco``,
``heal``, ``fedsa``, ``fedcac``) and every plug-in on ``fedprox`` and ``scaffold`` for a few rounds on digits, and
writes, per composition, the SHA-256 of its round records (every number at full precision, timings and byte counts
left out) or the error that refused it::

    python tools/fingerprint.py --out before.json            # on the old code
    python tools/fingerprint.py --out after.json --compare before.json   # exit 1 on any difference
    python tools/fingerprint.py --batched --out before-batched.json      # the same on the batched path

Run both on the same machine and torch build: float results are reproducible there, not across CPUs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

PAPER_PLUGINS = ("disco", "heal", "fedsa", "fedcac")
HOSTS = ("fedprox", "scaffold")
VOLATILE = ("time_", "bytes_", "mean_time_")
SETTINGS: dict[str, Any] = {
    "rounds": 3,
    "clients": 5,
    "local_epochs": 1,
    "batch_size": 16,
    "partition": "dir",
    "alpha": 0.3,
    "join_ratio": 0.8,
    "seed": 7,
}


def compositions() -> list[str]:
    from fedskew.methods import CLIENTS, SERVER_PLUGINS

    names = list(CLIENTS) + [f"fedavg+{p}" for p in SERVER_PLUGINS]
    names += [f"{c}+{p}" for c in CLIENTS if c != "fedavg" for p in PAPER_PLUGINS]
    names += [f"{h}+{p}" for h in HOSTS for p in SERVER_PLUGINS if p not in PAPER_PLUGINS]
    return list(dict.fromkeys(names))


def _clean(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if not k.startswith(VOLATILE)}


def fingerprint(name: str, batched: bool = False) -> str:
    import fedskew
    from fedskew.schema import ConfigError

    try:
        result = fedskew.run(name, **SETTINGS, batched_clients=batched)
    except ConfigError as exc:
        if "validation split" not in str(exc):
            return f"refused: {exc}"
        try:  # a method that scores each client's validation split (FedFomo): with one
            result = fedskew.run(name, **SETTINGS, validation=0.2, batched_clients=batched)
        except ConfigError as again:
            return f"refused: {again}"
    payload = json.dumps([_clean(r) for r in result.records], sort_keys=True, default=repr)
    return hashlib.sha256(payload.encode()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="where to write {composition: fingerprint}")
    ap.add_argument("--compare", type=Path, help="a fingerprint file to compare with (exit 1 on a difference)")
    ap.add_argument("--only", nargs="*", help="these compositions only")
    ap.add_argument(
        "--batched",
        action="store_true",
        help="train on the batched path (batched_clients; a method it cannot batch falls back to the sequential loop)",
    )
    args = ap.parse_args(argv)
    names = args.only or compositions()
    start = time.perf_counter()
    prints = {}
    for i, name in enumerate(names, 1):
        prints[name] = fingerprint(name, args.batched)
        print(f"[{i}/{len(names)}] {name}: {prints[name][:64]}", flush=True)
    args.out.write_text(json.dumps(prints, indent=1) + "\n")
    print(f"{len(prints)} compositions in {time.perf_counter() - start:.0f} s -> {args.out}")
    if args.compare is None:
        return 0
    before = json.loads(args.compare.read_text())
    differ = [n for n in prints if n in before and before[n] != prints[n]]
    missing = sorted(set(before) - set(prints)) if not args.only else []
    new = sorted(set(prints) - set(before))
    for n in differ:
        print(f"DIFFERS {n}: {before[n][:60]} -> {prints[n][:60]}")
    for n in missing:
        print(f"MISSING {n}")
    for n in new:
        print(f"NEW {n} (no fingerprint to compare)")
    same = len(prints) - len(differ) - len(new)
    print(f"{same} identical, {len(differ)} differ, {len(missing)} missing, {len(new)} new")
    return 1 if differ or missing else 0


if __name__ == "__main__":
    sys.exit(main())
