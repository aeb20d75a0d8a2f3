"""The pfl-research-shaped run under each kernel variant, then the whole run with the fastest.

The GPU run book's question for the ≤ 30 s target (docs/design.md, issue 47): the pfl-shaped round's time is mostly
its convolutions' kernels, so which way of computing them is fastest on this device, as a whole ``fedskew run`` (not
a micro-benchmark: ``conv_forms.py`` times the convolutions alone)? Each variant is the same run (1,000 IID MNIST
users, 50 a round, batch 10, one local epoch, PFLlib's CNN, lr 0.05, ``--batched-clients --capture-steps``) with
other run settings:

* ``grouped``: the defaults (one grouped convolution; torch's TF32 flags: in cuDNN's convolutions, not in matmuls);
* ``grouped-tf32``: ``--tf32 on`` (the linear layers in TF32 too);
* ``grouped-bench``: ``--cudnn-benchmark`` (cuDNN times its algorithms for each shape);
* ``grouped-nhwc``: ``--channels-last`` (the grouped convolution on channels-last tensors);
* ``unfold-tf32``: ``--stacked-conv unfold --tf32 on`` (im2col and batched matmuls, in TF32 as the grouped
  convolutions are by default);
* ``per-client``: ``--stacked-conv per_client`` (one convolution per client, replayed by the captured graph);
* ``per-layer``: ``--stacked-conv per_client,grouped`` (the first convolution, one input channel, one client at a
  time; the second grouped: the fastest form of each layer on this development CPU, ``conv_forms.py``);
* ``grouped-bf16``, ``unfold-bf16``: ``--precision bf16`` (the forward passes under bfloat16 autocast, on the tensor
  cores; parameters, optimizer and evaluation float32), grouped and unfolded.

Each runs ``--rounds-each`` rounds; its figure is the median of its rounds' ``time_round`` after the first
``--skip`` (the captures' warm-up), against ``grouped``'s in the same call. Then the fastest variant whose accuracy
after those rounds is within ``--acc-tolerance`` points of ``grouped``'s (a faster arithmetic that learns worse does not
count) runs ``--best-rounds`` rounds, evaluated after the last as the target asks: its wall time is the target's
figure. Every
variant's run directory is kept under ``--out``; a variant whose run has finished is read, not run again, so a call
cut short continues where it stopped. ``--json`` writes the figures.

    python benchmarks/pfl_forms.py --device cuda --data-dir ../shared/data --out runs/pfl-forms
    python benchmarks/pfl_forms.py --device cpu --smoke --out /tmp/pfl-forms      # every variant, 3 rounds, 100 users
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

VARIANTS: dict[str, list[str]] = {
    "grouped": [],
    "grouped-tf32": ["--tf32", "on"],
    "grouped-bench": ["--cudnn-benchmark"],
    "grouped-nhwc": ["--channels-last"],
    "unfold-tf32": ["--stacked-conv", "unfold", "--tf32", "on"],
    "per-client": ["--stacked-conv", "per_client"],
    "per-layer": ["--stacked-conv", "per_client,grouped"],
    "grouped-bf16": ["--precision", "bf16"],
    "unfold-bf16": ["--stacked-conv", "unfold", "--precision", "bf16"],
}


def run_argv(args: argparse.Namespace, extra: list[str], rounds: int, out: Path) -> list[str]:
    users = "100" if args.smoke else "1000"
    ratio = "0.1" if args.smoke else "0.05"
    data = ["--dataset", "digits"] if args.smoke and not args.data_dir else ["--dataset", "mnist"]
    if args.data_dir:
        data += ["--data-dir", args.data_dir]
    argv = [sys.executable, "-m", "fedskew.cli", "run", *data, "--partition", "iid", "--clients", users]
    argv += ["--join-ratio", ratio, "--local-epochs", "1", "--lr", "0.05", "--batch-size", "10", "--model", "cnn"]
    argv += ["--skew-probes", "0", "--device", args.device, "--no-db", "--quiet", "--overwrite"]
    argv += ["--batched-clients", "--capture-steps", *extra, "--rounds", str(rounds), "--eval-every", str(rounds)]
    return [*argv, "--out", str(out)]


def finished(run_dir: Path, rounds: int) -> dict | None:
    """The summary of a finished run of ``rounds`` rounds in ``run_dir``, else ``None``."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if summary.get("rounds") == rounds else None


def round_times(run_dir: Path) -> list[float]:
    return [json.loads(line)["time_round"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]


def run(args: argparse.Namespace, name: str, extra: list[str], rounds: int, out: Path) -> dict:
    """One variant's run (or its finished one): its median steady round time, wall time and accuracy."""
    summary = finished(out, rounds)
    if summary is None:
        done = subprocess.run(run_argv(args, extra, rounds, out), capture_output=True, text=True)
        if done.returncode != 0:
            return {"settings": " ".join(extra), "error": f"exit {done.returncode}: {done.stderr[-1500:]}"}
        summary = finished(out, rounds)
        if summary is None:
            return {"settings": " ".join(extra), "error": f"no summary of {rounds} rounds in {out}"}
    times = round_times(out)
    steady = times[min(args.skip, len(times) - 1) :]
    return {
        "settings": " ".join(extra),
        "rounds": rounds,
        "median_round_ms": statistics.median(steady) * 1e3,
        "wall_time_s": float(summary["wall_time"]),
        "final_acc": float(summary["global_acc"]["final"]),
        "run_dir": str(out),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder of the variants' run directories")
    p.add_argument("--device", default="cuda")
    p.add_argument("--data-dir", default=None, help="folder with mnist/ (default: fedskew's own data search)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--rounds-each", type=int, default=300)
    p.add_argument("--skip", type=int, default=20, help="first rounds left out of a variant's median (warm-up)")
    p.add_argument("--best-rounds", type=int, default=1500, help="rounds of the fastest variant's whole run (0: none)")
    p.add_argument(
        "--acc-tolerance",
        type=float,
        default=0.5,
        help="a variant whose accuracy is more than this many points below grouped's is not chosen as the fastest",
    )
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--smoke", action="store_true", help="100 users, 3 rounds each (a pipeline check)")
    args = p.parse_args(argv)
    names = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown or not names:
        p.error(f"--variants: unknown {unknown or 'none given'}; known: {', '.join(VARIANTS)}")
    if args.smoke:
        args.rounds_each, args.skip, args.best_rounds = 3, 1, min(args.best_rounds, 3)
    if args.rounds_each < 1 or args.skip < 0 or args.best_rounds < 0:
        p.error("--rounds-each must be at least 1, --skip and --best-rounds at least 0")
    out = Path(args.out)
    found: dict[str, dict] = {}
    figures: dict = {"variants": found, "device": args.device}

    def save() -> None:  # after every variant: a call cut short keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2))

    for name in names:
        f = found[name] = run(args, name, VARIANTS[name], args.rounds_each, out / name)
        if "error" in f:  # reported, the others still run
            print(f"{name:13s} FAILED [{f['settings']}]: {f['error']}", flush=True)
            save()
            continue
        ref = "grouped" if "error" not in found.get("grouped", {"error": 1}) else name
        f["speed_over_first"] = found[ref]["median_round_ms"] / f["median_round_ms"]
        print(
            f"{name:13s} {f['median_round_ms']:8.2f} ms a round (median after {args.skip}), "
            f"{f['speed_over_first']:.2f}x {ref}'s speed, "
            f"accuracy {f['final_acc'] * 100:.2f} after {f['rounds']} rounds  [{f['settings'] or '(defaults)'}]",
            flush=True,
        )
        save()
    ran = [n for n in found if "error" not in found[n]]
    if not ran:
        print("no variant ran", file=sys.stderr)
        return 1
    eligible = _eligible(found, ran, args.acc_tolerance)
    best = figures["best"] = min(eligible, key=lambda n: found[n]["median_round_ms"])
    print(f"fastest: {best} ({found[best]['settings'] or '(defaults)'})")
    if args.best_rounds:
        whole = figures["best_run"] = run(args, best, VARIANTS[best], args.best_rounds, out / f"best-{best}")
        save()
        if "error" in whole:
            print(f"best run FAILED: {whole['error']}", file=sys.stderr)
            return 1
        print(
            f"best run: {best}, {whole['rounds']} rounds in {whole['wall_time_s']:.1f}s, "
            f"{whole['median_round_ms']:.2f} ms a round, accuracy {whole['final_acc'] * 100:.2f}"
        )
    return 1 if len(ran) < len(names) else 0


def _eligible(found: dict[str, dict], ran: list[str], tolerance: float) -> list[str]:
    """The variants that may be chosen as the fastest: those within ``tolerance`` points of ``grouped``'s accuracy
    (every one that ran when ``grouped`` did not); the others are marked and said."""
    if "grouped" not in ran:
        return ran
    floor = found["grouped"]["final_acc"] - tolerance / 100
    for n in ran:
        if found[n]["final_acc"] < floor:
            found[n]["not_chosen"] = f"accuracy more than {tolerance} points below grouped's"
            print(f"{n:13s} not chosen: accuracy {found[n]['final_acc'] * 100:.2f} < grouped's - {tolerance}")
    return [n for n in ran if "not_chosen" not in found[n]]


if __name__ == "__main__":
    raise SystemExit(main())
