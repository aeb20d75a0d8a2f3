"""``fedskew methods``: every method and plug-in, one line each; ``fedskew methods NAME``: one in full."""

from __future__ import annotations

import argparse
import shutil
import sys
import textwrap
from typing import Any


def add_parsers(sub: Any) -> None:
    me = sub.add_parser("methods", help="list the available methods and building blocks")
    me.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help="a method, plug-in or composition (fedprox+disco): its paper, summary, hyper-parameters with their "
        "defaults and tunable ranges, and whether it can run under DP",
    )
    me.add_argument(
        "--compositions",
        action="store_true",
        help="also list every valid two-part composition and every refused one with its reason (long)",
    )


def _one_line(text: str, cols: int) -> str:
    """``text`` cut at a word to fit ``cols`` columns, ending in " …" when cut."""
    if len(text) <= cols:
        return text
    cut = text[: cols - 2]
    return (cut[: cut.rfind(" ")] if " " in cut.strip() else cut).rstrip(" ,;(") + " …"


def cmd_methods(args: argparse.Namespace) -> int:
    if args.names:
        from fedskew.method_detail import describe

        cols = max(60, shutil.get_terminal_size((100, 24)).columns)
        try:
            print("\n\n".join(describe(name, cols) for name in args.names))
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return 0
    from fedskew.method_index import method_index

    index = method_index()  # without importing the methods (fedskew/method_index.py)
    rows, valid, refused = index["rows"], index["valid"], index["refused"]
    name_width = max(len(r[0]) for r in rows)
    # every line fits the terminal (piped: 100 columns); a summary wraps under its own column
    cols = max(60, shutil.get_terminal_size((100, 24)).columns)

    def fill(text: str, first: str = "", rest: str = "") -> str:
        return textwrap.fill(text, cols, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False)

    print(fill("Methods compose as CLIENT[+PLUGIN...]; a name without a client part uses fedavg's local SGD."))
    print(fill("Hyper-parameters: -m KEY=VALUE (see docs/methods.md).") + "\n")
    kinds: dict[str, list[tuple[str, str]]] = {}  # the parts by kind, in the registry's order
    for name, kind, summary in rows:
        kinds.setdefault(kind, []).append((name, summary))
    for kind, parts in kinds.items():
        print(f"{kind}:")
        for name, summary in parts:  # one line each, cut to the terminal: `fedskew methods NAME` has the rest
            print(_one_line(f"  {name:<{name_width}}  {summary}", cols))
    print(fill("The details of one (paper, hyper-parameters, defaults, DP): fedskew methods NAME [NAME ...]"))
    if args.compositions:
        print("\nvalid compositions:")
        print(fill(", ".join(valid), "  ", "  "))
        print("refused:")
        for line in refused:
            print(fill(line, "  ", "    "))
        private = index.get("private", [])
        print()
        print(fill(f"can run under user-level differential privacy (--dp-clip; docs/privacy.md), {len(private)}:"))
        print(fill(", ".join(private), "  ", "  "))
    else:
        print()
        print(
            fill(
                f"{len(valid)} valid compositions of a client part and a plug-in (or two plug-ins), {len(refused)} "
                f"refused with a reason; {len(index.get('private', []))} of the valid ones can run under --dp-clip: "
                "`fedskew methods --compositions` lists them"
            )
        )
    # the Flower apps run any composition with the simulator's own objects (docs/flower.md)
    import importlib.util

    extra = "" if importlib.util.find_spec("flwr") else ' (install the extra: pip install -e ".[flower]")'
    print()
    print(
        fill(
            f"on Flower (`fedskew flower`{extra}): every valid composition, with the simulator's metrics; "
            "`fedskew flower check [METHOD ...]` compares them"
        )
    )
    return 0


HANDLERS = {"methods": cmd_methods}
