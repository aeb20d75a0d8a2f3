"""The GPU run book: every GPU figure fedskew quotes, measured in resumable pieces on one device.

Pieces (each a subprocess with its own time limit; its result lands in ``OUT/<piece>.json`` and a piece already
there is skipped, so running the suite again continues where the last call stopped):

- ``env``: the card, the driver's CUDA, torch and fedskew versions.
- ``methods-on-device``: ``benchmarks/methods_on_device.py``, every registered method for 2 rounds on the device,
  sequential and batched, on the digits data: which keep their tensors on the run's device (CI has no GPU to see a
  tensor made on the CPU meet a CUDA one). The first piece to run on a GPU.
- ``methods-bf16``: the same with ``--precision bf16`` (bfloat16 autocast, ``client/precision.py``): CUDA's autocast
  lists differ from the CPU's CI runs under (a LayerNorm under vmap, say).
- ``methods-captured``: the same with ``--batched-clients --capture-steps`` (``--paths captured``): every method whose
  steps run at one shape, captured as CUDA graphs and replayed (CI runs those steps eagerly; a capture that fails
  falls back with a warning the piece reports); the others ``refused`` with the engine's reason.
- ``batched-<method>`` for every family of batched step (:data:`BATCHED_METHODS`): batched clients
  against the sequential loop on issue 15's workload (PFLlib's CNN, MNIST, PFLlib's Dir(0.1) split over 100
  clients, batch 10, 1 local epoch), through ``benchmarks/batched_clients.py`` (full float32, TF32 off): both times,
  the speedup (median of the timed repeats) and the largest difference between the two paths' uploads;
  ``batched-fedavg-vmap`` the same with the general ``vmap`` step instead of the stacked autograd graph;
  ``batched-<method>-captured`` (:data:`CAPTURED`) with the steps at padded shapes replayed as CUDA graphs
  (``--capture-steps``, engine/captured.py): the speed-up over the sequential loop and the device's busy share.
- ``pfl-batched`` / ``pfl-sequential``: the pfl-research-shaped workload (1,000 users, 50 per round, batch 10,
  1 local epoch, the 2-conv CNN on MNIST, IID) as a whole ``fedskew run``, batched for ``--pfl-rounds`` rounds
  (the goal: 1,500 rounds in under 2 minutes on an H100) and sequential for a thirtieth of them; the ratio of their
  round times; ``pfl-captured`` the batched run with ``--capture-steps`` (its other kernels: ``pfl-forms``).
- ``runs-per-gpu``: ``benchmarks/runs_per_gpu.py``, the same 8 runs one at a time and 2, 4, 8 at a time sharing the
  device: the speed-up per level and the best (what a sweep on CUDA should use).
- ``vs-flower``: ``benchmarks/vs_flower_sim.py``, the pfl-research-shaped FedAvg workload for ``--flower-rounds``
  rounds on Flower's Simulation Engine (a plain PyTorch ``ClientApp``, Flower's ``FedAvg``, Ray) and as fedskew
  sequential and batched, on the same device: steady round times, their ratios, accuracies after the same rounds,
  and each side's arithmetic rate as a fraction of a dense matmul's on the device in the same run.
- ``stacked-runs``: ``benchmarks/runs_per_gpu.py --jobs 1 --stacked``, the same 8 seeds as batched runs one at a time
  and as rows of one stacked computation (``fedskew sweep --stack-seeds``): the speed-up, and whether the records agree.
- ``stacked-vs-concurrent``: the same with the batched runs also 4 and 8 at a time sharing the device: whether
  stacking the seeds beats running them side by side on the GPU (what ``--stack-seeds auto`` chooses between).
- ``host-ops``: ``benchmarks/host_ops.py``, the operations a round of the pfl-research shape with captured steps
  dispatches outside its steps, by engine function, and on a GPU the round's time.
- ``pfl-forms``: ``benchmarks/pfl_forms.py``, the pfl-research-shaped captured run for 200 rounds under each kernel
  variant (the stacked convolutions grouped, unfolded, per client or per layer; TF32; cuDNN's benchmark mode;
  channels-last; bfloat16 autocast), each variant's steady round time against the default's, then ``--pfl-rounds``
  rounds with the fastest whose accuracy is within half a point of the default's.
- ``conv-forms``: ``benchmarks/conv_forms.py``, one step of the CNN's two convolutions for 50 and 100 stacked
  clients in each form (the engine's grouped convolution, with cuDNN's benchmark mode, unfold and a batched matmul,
  one convolution per client), TF32 off and on: each form's speed against the grouped one's.
- ``run100``: issue 15's ``fedskew run`` of the 100-client workload for ``--run-rounds`` rounds, batched.
- ``reproduce-<paper>``: ``fedskew reproduce PAPER --scale small`` on the given rows and seeds, with what time is
  left; ``reproduce`` is idempotent, so a later call finishes the runs a deadline cut (their run directories are
  under ``OUT/reproduce``). ``--papers niid-bench`` runs NIID-Bench's table at its published settings (scale
  ``paper``): ``--seeds 0,1,2`` for the benchmark's three seeds, over as many calls as it takes.

Every piece's figures are also in FLOP terms (``benchmarks/flops.py``): ``env`` measures the device's dense fp32
matmul rate (and its bfloat16 one), and each piece reports its arithmetic and that rate's fraction (a ``pfl-forms``
best run under ``--precision bf16`` also the bfloat16 rate's). ``OUT/suite.md`` collects every finished
piece's figures after each call. ``--smoke`` runs every piece at toy size
on the CPU with the embedded digits (CI runs it), ``--budget`` bounds the whole call: a piece whose estimate does not
fit is left for the next call.

    python benchmarks/gpu_suite.py --data-dir ../shared/data --out runs/gpu-suite            # on a GPU
    python benchmarks/gpu_suite.py --smoke --out /tmp/gpu-smoke                               # CI, CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from flops import matmul_gflops, run_arithmetic, run_fraction  # noqa: E402  (arithmetic in FLOP terms)

# one client part per family of batched step (each part's batched_step(), client/batched_form.py): plain SGD, a
# proximal term, a shift after the step, a pull after the backward pass, terms against frozen models, a term on drawn
# inputs, a start after begin, phases, prototype collection, uploads computed from the trained model, a map of the
# logits, SAM's second pass, a head trained beside the model, pieces on the representation, a mixture, an inner step,
# a model solved at every step, a per-client term under vmap with a decay of some parameters, a head's per-client draws
BATCHED_METHODS = (
    "fedavg",
    "fedprox",
    "scaffold",
    "feddyn",
    "moon",
    "fedntd",
    "fedgen",
    "fedala",
    "ditto",
    "fedbabu",
    "fedproto",
    "fedcac",
    "fedlc",
    "fedsam",
    "fedrod",
    "feddbe",
    "apfl",
    "perfedavg",
    "pfedme",
    "gpfl",
    "fedcp",
)


# the batched step at padded shapes, replayed as CUDA graphs (engine/captured.py, --capture-steps): plain SGD, a
# proximal term, a shift after the step, a logit shift, SAM's two passes, and what clients train beside the model (a
# side head, representation pieces, a mixture), per-sample terms against frozen models or the round's prototypes and
# class sums, inner steps (Per-FedAvg's slices, pFedMe's θ) and inputs drawn per step (FedGen); their plain batched
# steps kept the H200 27-40% busy (2026-12-04)
CAPTURED = ("fedavg", "fedprox", "scaffold", "fedlc", "fedsam", "fedrod", "feddbe", "apfl", "moon", "fedntd")
CAPTURED += ("fedproto", "perfedavg", "pfedme", "fedgen", "gpfl", "fedcp")


@dataclass(frozen=True)
class Piece:
    name: str
    argv: list[str]  # the command; empty for an in-process piece (env)
    estimate_s: float  # what the budget reserves for it
    limit_s: float  # killed after this long
    run_dir: Path | None = None  # a fedskew run directory to read summary.json from
    figures_file: Path | None = None  # a JSON file of figures the piece writes
    device: str = "cpu"  # env: the device whose matmul rate it measures


# what a batched piece's budget reserves beyond the 45 s of FedAvg's (warm-up and timed repeats of 100 clients), where
# the H200 measured more (2026-12-04: GPFL 96 s, FedCP 100 s, FedALA 59 s; FedSAM's warm-up and one repeat over 60 s)
# or the step does several times FedAvg's work (pFedMe's five inner steps, Per-FedAvg's two)
RESERVE_S = {"gpfl": 110, "fedcp": 110, "fedala": 70, "fedsam": 100, "pfedme": 150, "perfedavg": 90}


def fedskew(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedskew", *args]


def pieces(args: argparse.Namespace, out: Path) -> list[Piece]:
    smoke = args.smoke
    device = "cpu" if smoke else args.device
    mnist = (
        ["--dataset", "digits"] if smoke else ["--dataset", "mnist", "--data-dir", str(Path(args.data_dir) / "mnist")]
    )
    found: list[Piece] = []
    # every method on the device first: a crash there is a bug CI cannot see (FedDBE's, 2026-12-04)
    base = [sys.executable, str(HERE / "methods_on_device.py"), "--device", device]
    argv = [*base, *(["--methods", "fedavg,feddbe,fedfomo,fedavg+ccvr"] if smoke else [])]
    found.append(Piece("methods-on-device", argv, 30 if smoke else 150, 300 if smoke else 400))
    # the same under bfloat16 autocast (precision bf16): CUDA's autocast rules are not the CPU's that CI sees
    found.append(Piece("methods-bf16", [*argv, "--precision", "bf16"], 30 if smoke else 150, 300 if smoke else 400))
    # every method's captured steps (20 s for 48 methods on this CPU, 46 of them captured); in smoke one of each:
    # plain steps, a side head, a refusal (GPFL's head has no stacked form)
    captured_argv = [*base, *(["--methods", "fedavg,gpfl,fedcp"] if smoke else []), "--paths", "captured"]
    found.append(Piece("methods-captured", captured_argv, 30 if smoke else 90, 300 if smoke else 400))
    paths = [(m, "auto") for m in BATCHED_METHODS] + [("fedavg", "vmap")] + [(m, "captured") for m in CAPTURED]
    for m, path in paths:
        argv = [sys.executable, str(HERE / "batched_clients.py"), "--method", m, "--device", device, "--path", path]
        argv += ["--clients", "10", "--fraction", "0.03", "--repeats", "1"] if smoke else ["--clients", "100"]
        if smoke:  # the same random workload on every machine; FedBABU with one fine-tuning epoch (of 10) to stay small
            argv += ["--random-data", *(["-m", "fine_tuning_epochs=1"] if m == "fedbabu" else [])]
        else:
            argv += [
                "--data-dir",
                str(Path(args.data_dir) / "mnist"),
                "--fraction",
                "1",
                "--repeats",
                str(args.repeats),
            ]
        found.append(
            Piece(
                f"batched-{m}" + ("" if path == "auto" else f"-{path}"),
                argv,
                20 if smoke else RESERVE_S.get(m, 45),
                300 if smoke else 240,
            )
        )
    # what every whole-run piece shares: the CNN, batch 10, no probes, no database, a fresh run directory
    common = ["--batch-size", "10", "--model", "cnn", "--skew-probes", "0", "--device", device]
    common += ["--no-db", "--quiet", "--overwrite"]
    pfl = [*mnist, "--partition", "iid", "--clients", "100" if smoke else "1000", "--join-ratio", "0.05"]
    pfl += ["--local-epochs", "1", "--lr", "0.05", *common]
    rounds = 3 if smoke else args.pfl_rounds
    seq_rounds = 2 if smoke else max(1, args.pfl_rounds // 30)
    captured = ["--batched-clients", "--capture-steps"]
    for name, extra, r, reserve in (
        ("pfl-batched", ["--batched-clients"], rounds, 150),
        ("pfl-captured", captured, rounds, 90),  # 46 s on the H200 (2026-12-04); its other kernels: pfl-forms
        ("pfl-sequential", [], seq_rounds, 150),
    ):
        run_dir = out / "runs" / name
        argv = fedskew("run", *pfl, *extra, "--rounds", str(r), "--eval-every", str(r), "--out", str(run_dir))
        found.append(Piece(name, argv, 20 if smoke else reserve, 300 if smoke else 400, run_dir))
    run100_dir = out / "runs" / "run100"
    r100 = 2 if smoke else args.run_rounds
    run100 = [*mnist, "--protocol", "pfllib", "--partition", "dir", "--alpha", "0.1", "--lr", "0.005", *common]
    run100 += ["--clients", "10" if smoke else "100", "--batched-clients"]
    argv = fedskew("run", *run100, "--rounds", str(r100), "--eval-every", str(r100), "--out", str(run100_dir))
    found.append(Piece("run100", argv, 20 if smoke else 120, 300 if smoke else 400, run100_dir))
    # several runs sharing one device (issue 27, item 2): the same 8 seeds one at a time, then 2, 4 and 8 at a time
    argv = [sys.executable, str(HERE / "runs_per_gpu.py"), "--device", device]
    if smoke:
        argv += ["--smoke", "--jobs", "1,2", "--runs", "2"]
    else:
        argv += ["--data-dir", str(Path(args.data_dir) / "mnist"), "--jobs", "1,2,4,8", "--runs", "8", "--rounds", "10"]
    found.append(Piece("runs-per-gpu", argv, 30 if smoke else 300, 300 if smoke else 540))
    # the same seeds as rows of one stacked computation (sweep --stack-seeds) against one batched run at a time
    argv = [sys.executable, str(HERE / "runs_per_gpu.py"), "--device", device, "--jobs", "1", "--stacked"]
    if smoke:
        argv += ["--smoke", "--runs", "2"]
    else:
        argv += ["--data-dir", str(Path(args.data_dir) / "mnist"), "--runs", "8", "--rounds", "10"]
    found.append(Piece("stacked-runs", argv, 30 if smoke else 300, 300 if smoke else 540))
    # and against the same batched runs 4 and 8 at a time sharing the device: which --stack-seeds auto should pick
    argv = [sys.executable, str(HERE / "runs_per_gpu.py"), "--device", device, "--stacked"]
    if smoke:
        argv += ["--smoke", "--jobs", "1,2", "--runs", "2"]
    else:
        argv += ["--data-dir", str(Path(args.data_dir) / "mnist"), "--jobs", "1,4,8", "--runs", "8", "--rounds", "10"]
    found.append(Piece("stacked-vs-concurrent", argv, 40 if smoke else 330, 300 if smoke else 540))
    # the host's work in a round of the pfl-research shape with captured steps: the operations dispatched outside the
    # steps, by engine function, and the round's time (benchmarks/host_ops.py)
    argv = [sys.executable, str(HERE / "host_ops.py"), "--device", device]
    if smoke:
        argv += ["--clients", "100", "--join-ratio", "0.1", "--model", "mlp", "--rounds", "1", "--warmup", "1"]
    else:
        argv += ["--data-dir", str(Path(args.data_dir) / "mnist"), "--rounds", "5", "--warmup", "3"]
    found.append(Piece("host-ops", argv, 20 if smoke else 40, 300 if smoke else 180))
    # the pfl-shaped run under each kernel variant (convolution form, TF32, cuDNN's benchmark mode, channels-last,
    # bf16), then 1,500 rounds with the fastest: the <= 30 s target's figure (benchmarks/pfl_forms.py)
    figs = out / "pfl-forms-figures.json"
    argv = [sys.executable, str(HERE / "pfl_forms.py"), "--device", device, "--out", str(out / "runs" / "pfl-forms")]
    argv += ["--json", str(figs)]
    argv += ["--smoke"] if smoke else ["--data-dir", str(Path(args.data_dir) / "mnist"), "--best-rounds", str(rounds)]
    argv += [] if smoke else ["--rounds-each", "200"]  # nine variants in the piece's 200 s
    found.append(Piece("pfl-forms", argv, 60 if smoke else 200, 300 if smoke else 540, figures_file=figs))
    # the stacked convolution's form: what the pfl-shaped round's kernels could gain (benchmarks/conv_forms.py)
    argv = [sys.executable, str(HERE / "conv_forms.py"), "--device", device]
    argv += ["--clients", "3", "--batch", "2", "--repeats", "1"] if smoke else []
    found.append(Piece("conv-forms", argv, 15 if smoke else 40, 300 if smoke else 180))
    # the same FedAvg workload (1,000 MNIST users, 50 a round, batch 10, the CNN) on Flower's Simulation Engine with a
    # plain PyTorch ClientApp and on pfl-research's simulator, beside fedskew sequential, batched and captured on the
    # same device (benchmarks/vs_flower_sim.py)
    figs = out / "vs-flower-figures.json"
    argv = [sys.executable, str(HERE / "vs_flower_sim.py"), "--device", device, "--json", str(figs)]
    argv += (
        ["--smoke"]
        if smoke
        else ["--data-dir", str(Path(args.data_dir) / "mnist"), "--rounds", str(args.flower_rounds)]
    )
    found.append(Piece("vs-flower", argv, 60 if smoke else 240, 300 if smoke else 540, figures_file=figs))
    for paper in args.papers:
        # NIID-Bench is a benchmark, not a paper's reduced table: its cells run at the published settings (scale
        # paper, about 1.5 M sample passes per round-epoch sweep; the whole 2 x 7 x 4 table with 3 seeds takes
        # several calls, each continuing the runs the last one finished: --seeds 0,1,2 --rows fedavg,...)
        scale = "smoke" if smoke else "paper" if paper == "niid-bench" else "small"
        argv = fedskew("reproduce", paper, "--scale", scale, "--device", device)
        argv += ["--out", str(out / "reproduce" / paper), "--jobs", str(args.jobs), "--quiet"]
        if not smoke:
            argv += ["--data-dir", args.data_dir, "--seeds", args.seeds]
        if args.rows:
            argv += ["--rows", args.rows]
        found.append(Piece(f"reproduce-{paper}", argv, 60 if smoke else 120, 600, None))
    return found


def env_info(device: str = "cpu") -> dict:
    import torch

    import fedskew

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "fedskew": getattr(fedskew, "__version__", "?"),
        "cuda": torch.version.cuda,
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(
            gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), multiprocessors=p.multi_processor_count
        )
    info["matmul_gflops"] = matmul_gflops(device)  # the reference every piece's arithmetic rate is divided by
    info["matmul_gflops_bf16"] = matmul_gflops(device, dtype=torch.bfloat16)  # a bf16 run's (precision bf16)
    return info


def figures(piece: Piece, stdout: str, rate: float | None = None, rate_bf16: float | None = None) -> dict:
    """The numbers a piece's docs quote, read from its output (``rate``: the device's float32 matmul rate, GFLOP/s;
    ``rate_bf16``: its bfloat16 one, the reference of a run under ``precision: bf16``)."""
    got: dict = {}
    if piece.name.startswith("batched-"):
        for key, pattern in (
            ("speedup", r"speedup batched/sequential: ([\d.]+)x \(median; sequential ([\d.]+)s, batched ([\d.]+)s\)"),
            ("max_error", r"max equivalence error: ([\d.e+-]+)"),
            ("utilization", r"GPU utilization \(batched\) (mean [^\n|]*)"),
            ("kernel_busy", r"device busy \(batched, kernels' own times[^:]*\): ([^\n]*)"),
            ("workload", r"^(.*clients, \d+ training samples.*)$"),
            ("mask_flips", r"mask entries that differ: (\d+ of \d+)"),
            ("train_gflop", r"^arithmetic: ([\d.]+) GFLOP of training"),
            ("fraction_of_matmul_rate", r"^fraction of the matmul rate: batched ([\d.]+)%"),
        ):
            m = re.search(pattern, stdout, re.M)
            if m and key == "speedup":
                got.update(speedup=float(m[1]), sequential_s=float(m[2]), batched_s=float(m[3]))
            elif m and key == "fraction_of_matmul_rate":
                got[key] = float(m[1]) / 100
            elif m:
                got[key] = float(m[1]) if key in ("max_error", "train_gflop") else m[1].strip()
    if piece.name in ("stacked-runs", "stacked-vs-concurrent"):
        m = re.search(r"^stacked: .* speed-up ([\d.]+)x", stdout, re.M)
        got["stacked_speedup"] = float(m[1]) if m else None
        m = re.search(r"^stacked metrics: largest difference from the batched runs' ([\d.e+-]+|inf)", stdout, re.M)
        got["stacked_max_difference"] = float(m[1]) if m else None
    if piece.name == "conv-forms":  # {"K 50, TF32 off": {form: its speed over grouped's}}
        speeds: dict[str, dict[str, float]] = {}
        layers: dict[str, dict[str, dict[str, float]]] = {}
        for block in re.split(r"^(?=K \d+, TF32 \w+:)", stdout, flags=re.M)[1:]:
            head = block.split(":", 1)[0]
            speeds[head] = {f: float(x) for f, x in re.findall(r"^  (\S+) +[\d.]+ ms +([\d.]+)x", block, re.M)}
            layers[head] = {
                f"layer {i}": {f: float(x) for f, x in re.findall(r"(\S+) ([\d.]+)x", rest)}
                for i, rest in re.findall(r"^  layer (\d+) \([^)]*\): (.*)$", block, re.M)
            }
        got["speed_over_grouped"] = speeds
        got["per_layer_speed_over_grouped"] = layers  # each layer alone: whether the best form differs by layer
    if piece.name in ("methods-on-device", "methods-bf16", "methods-captured"):
        m = re.search(r"^methods on \S+: (\d+) ok, (\d+) refused, (\d+) failed of (\d+) runs", stdout, re.M)
        if m:
            got.update(ok_runs=int(m[1]), refused_runs=int(m[2]), failed_runs=int(m[3]), runs=int(m[4]))
        got["failed"] = [" ".join(line.split()[1:3]) for line in stdout.splitlines() if line.startswith("FAILED ")]
    if piece.name == "host-ops":
        m = re.search(r"^operations a round outside the steps: (\d+) \(inside the steps' bodies: (\d+)", stdout, re.M)
        if m:
            got.update(ops_outside_steps=int(m[1]), ops_inside_steps=int(m[2]))
        m = re.search(r"^round time \(unprofiled, median of \d+\): ([\d.]+) ms", stdout, re.M)
        got["round_ms"] = float(m[1]) if m else None
        got["by_function"] = re.findall(r"^ +([\d.]+)  (\S.*)$", stdout, re.M)[:8]
        m = re.search(r"^device busy \(one profiled round, kernels' own times\): ([\d.]+) ms, (\d+)% of", stdout, re.M)
        if m:  # the device's share of the round, and where its time went
            got.update(device_busy_ms=float(m[1]), device_busy_share=int(m[2]) / 100)
            got["top_kernels"] = re.findall(r"^ +([\d.]+) ms +\d+% +x\d+ +(\S.*)$", stdout, re.M)[:4]
    if piece.name in ("runs-per-gpu", "stacked-runs", "stacked-vs-concurrent"):
        got["speedup_by_jobs"] = {
            int(j): float(x) for j, x in re.findall(r"^jobs (\d+): .* speed-up ([\d.]+)x", stdout, re.M)
        }
        m = re.search(r"^best: jobs (\d+)", stdout, re.M)
        got["best_jobs"] = int(m[1]) if m else None
        m = re.search(r"^metrics identical whatever the concurrency: (\w+)", stdout, re.M)
        got["identical"] = m[1] == "True" if m else None
    if piece.run_dir is not None:
        s = json.loads((piece.run_dir / "summary.json").read_text())
        got.update({k: s.get(k) for k in ("rounds", "wall_time", "mean_time_round", "mean_time_train", "method")})
        got["global_acc"] = s.get("global_acc")
        if rate and s.get("mean_time_round"):  # the run's arithmetic against the device's matmul rate (env piece)
            got.update(run_fraction(run_arithmetic(piece.run_dir), s["mean_time_round"], rate))
    if piece.name.startswith("reproduce-"):
        got["tail"] = stdout[-1500:]
    if piece.figures_file is not None:
        got.update(json.loads(piece.figures_file.read_text()))
    best = got.get("best_run") if piece.name == "pfl-forms" else None
    if rate and best and "error" not in best:  # the target run's arithmetic rate
        s = json.loads((Path(best["run_dir"]) / "summary.json").read_text())
        arithmetic = run_arithmetic(best["run_dir"])
        best.update(run_fraction(arithmetic, s["mean_time_round"], rate))
        if "bf16" in best.get("settings", "") and rate_bf16:  # its matmuls ran in bfloat16: that rate's share too
            share = run_fraction(arithmetic, s["mean_time_round"], rate_bf16)["fraction_of_matmul_rate"]
            best["fraction_of_bf16_matmul_rate"] = share
    return got


def run_piece(piece: Piece, out: Path) -> dict:
    t0 = time.perf_counter()
    if not piece.argv:
        return {"piece": piece.name, "ok": True, **env_info(piece.device), "seconds": time.perf_counter() - t0}
    try:
        proc = subprocess.run(piece.argv, capture_output=True, text=True, timeout=piece.limit_s, check=False)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-2000:]
        return {"piece": piece.name, "ok": False, "error": f"timed out after {piece.limit_s:.0f}s", "tail": str(tail)}
    seconds = time.perf_counter() - t0
    (out / f"{piece.name}.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:  # what it printed before failing still counts (methods-on-device: which methods)
        seen = figures(piece, proc.stdout) if piece.run_dir is None else {}
        failed = {"piece": piece.name, "ok": False, "error": f"exit {proc.returncode}", "tail": proc.stderr[-2000:]}
        return {**failed, **seen}
    env = json.loads((out / "env.json").read_text()) if (out / "env.json").exists() else {}
    rate, rate_bf16 = env.get("matmul_gflops"), env.get("matmul_gflops_bf16")
    return {"piece": piece.name, "ok": True, "seconds": seconds, **figures(piece, proc.stdout, rate, rate_bf16)}


def _done(out: Path, name: str) -> dict | None:
    """A finished piece's result, or ``None`` (not run yet, or failed)."""
    f = out / f"{name}.json"
    found = json.loads(f.read_text()) if f.exists() else None
    return found if found and found.get("ok") else None


def report(out: Path, order: list[str]) -> str:
    lines = ["# fedskew GPU suite", ""]
    for name in order:
        f = out / f"{name}.json"
        if not f.exists():
            lines.append(f"- **{name}**: not run yet")
            continue
        r = json.loads(f.read_text())
        shown = {k: v for k, v in r.items() if k not in ("piece", "tail")}
        lines.append(f"- **{name}**: {json.dumps(shown)}")
    b, s, c = (_done(out, f"pfl-{side}") for side in ("batched", "sequential", "captured"))
    if b and s:
        lines.append(
            f"- pfl-research workload: {b['rounds']} rounds batched in {b['wall_time']:.1f}s; round time "
            f"sequential/batched {s['mean_time_round'] / b['mean_time_round']:.2f}x"
        )
    if b and c:
        lines.append(
            f"- pfl-research workload with --capture-steps: {c['rounds']} rounds in {c['wall_time']:.1f}s; round "
            f"time batched/captured {b['mean_time_round'] / c['mean_time_round']:.2f}x"
        )
    if f := _done(out, "pfl-forms"):
        speeds = ", ".join(
            f"{k} {x['speed_over_first']:.2f}x" if "error" not in x else f"{k} failed" for k, x in f["variants"].items()
        )
        lines.append(f"- pfl-research workload, each kernel variant's round against grouped's: {speeds}")
        if (b := f.get("best_run")) and "error" not in b:
            lines.append(
                f"- pfl-research workload with the fastest ({f['best']}: {b['settings']}): {b['rounds']} rounds in "
                f"{b['wall_time_s']:.1f}s, accuracy {b['final_acc'] * 100:.2f}"
            )
    if v := _done(out, "vs-flower"):
        ratios = ", ".join(f"{k} {x['vs_flower']:.2f}x" for k, x in v["sides"].items() if "vs_flower" in x)
        accs = ", ".join(f"{k} {x['final_acc'] * 100:.2f}" for k, x in v["sides"].items())
        lines.append(f"- fedskew vs Flower's Simulation Engine (steady round time): {ratios}; accuracy: {accs}")
        if ratios := ", ".join(f"{k} {x['vs_pfl']:.2f}x" for k, x in v["sides"].items() if "vs_pfl" in x):
            lines.append(f"- fedskew vs pfl-research's simulator (steady round time): {ratios}")
        for peer, why in v.get("not_run", {}).items():
            lines.append(f"- vs-flower: the {peer} side did not run: {why}")
    text = "\n".join(lines) + "\n"
    (out / "suite.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="results folder; pieces already there are skipped")
    p.add_argument("--data-dir", default="../shared/data", help="folder with mnist/ (and the papers' datasets)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--budget", type=float, default=540, help="seconds this call may spend (pieces that fit start)")
    p.add_argument("--only", default="", help="comma-separated piece names (default: all)")
    p.add_argument("--order", default="", help="comma-separated piece names to run first, in this order")
    p.add_argument("--pfl-rounds", type=int, default=1500)
    p.add_argument("--run-rounds", type=int, default=100)
    p.add_argument("--flower-rounds", type=int, default=30, help="vs-flower: rounds of each side")
    p.add_argument("--repeats", type=int, default=2, help="batched-<method>: timed repeats after a warm-up")
    p.add_argument("--papers", default="", help="comma-separated papers for reproduce-<paper> pieces")
    p.add_argument("--rows", default="", help="reproduce: only these rows")
    p.add_argument("--seeds", default="0", help="reproduce: seeds")
    p.add_argument("--jobs", type=int, default=4, help="reproduce: runs at a time on the device")
    p.add_argument("--smoke", action="store_true", help="every piece at toy size on the CPU (digits)")
    p.add_argument("--redo", action="store_true", help="run pieces again even when their result exists")
    args = p.parse_args(argv)
    args.papers = [x for x in args.papers.split(",") if x]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = [Piece("env", [], 1, 60, device="cpu" if args.smoke else args.device), *pieces(args, out)]
    if args.order:
        first = [n for n in args.order.split(",") if n]
        todo.sort(key=lambda pc: first.index(pc.name) if pc.name in first else len(first))
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {pc.name for pc in todo}
        if unknown:
            p.error(f"unknown pieces {sorted(unknown)}; known: {[pc.name for pc in todo]}")
        todo = [pc for pc in todo if pc.name in wanted]
    start = time.perf_counter()
    for piece in todo:
        result_file = out / f"{piece.name}.json"
        if result_file.exists() and not args.redo and json.loads(result_file.read_text()).get("ok"):
            print(f"{piece.name}: done earlier, skipped", flush=True)
            continue
        left = args.budget - (time.perf_counter() - start)
        if piece.estimate_s > left:
            print(f"{piece.name}: needs ~{piece.estimate_s:.0f}s, {left:.0f}s left: run the suite again", flush=True)
            continue
        piece = dataclasses.replace(piece, limit_s=min(piece.limit_s, max(left, 1)))
        print(f"{piece.name}: running (limit {piece.limit_s:.0f}s)", flush=True)
        result = run_piece(piece, out)
        result_file.write_text(json.dumps(result, indent=1))
        status = "ok" if result["ok"] else f"FAILED: {result['error']}"
        print(f"{piece.name}: {status} {json.dumps({k: v for k, v in result.items() if k != 'tail'})}", flush=True)
    print(report(out, [pc.name for pc in todo]))
    return (
        0
        if all(
            json.loads((out / f"{pc.name}.json").read_text()).get("ok")
            for pc in todo
            if (out / f"{pc.name}.json").exists()
        )
        else 1
    )


if __name__ == "__main__":
    raise SystemExit(main())
