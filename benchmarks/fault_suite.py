"""The fault suite: careless-user probes of fedskew's commands, replayed (issue 46), each a fresh ``fedskew`` process
in its own folder, classified by what a user would see.

Every case says what should happen: a clean error (exit 2, or 4 after the compute, one ``error:`` line matching
``says``, no traceback), or a correct run (exit 0); an optional ``check`` looks at the files afterwards and names any
data loss (a file that was there is gone or changed) or silent wrong result. Outcomes:

- ``clean``: as expected;
- ``traceback``: Python's traceback reached the user;
- ``hang``: still running after the case's time limit (killed);
- ``lost``: data loss found by ``check``; ``wrong``: a silent wrong result found by ``check``;
- ``unexpected``: another exit status or message than the case expects.

    python benchmarks/fault_suite.py               # every case, a tally and one line per case that is not clean
    python benchmarks/fault_suite.py --only dup_yaml_key,foreign_db --verbose

``tests/test_fault_suite.py`` runs it in CI and requires every case clean. To probe a new surface, add cases here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

Check = Callable[[Path], "tuple[str, str] | None"]  # (outcome: lost | wrong, what) or None


@dataclass(frozen=True)
class Case:
    name: str
    argv: list[str]  # fedskew's arguments, run in the case's folder
    expect: str = "error"  # error (exit 2) | after (exit 4) | ok (exit 0)
    says: str = ""  # a regex the error line must match
    prepare: Callable[[Path], None] | None = None  # files the case needs, in its folder
    check: Check | None = None
    timeout: float = 180.0
    runner: Callable[[Case, Path], tuple[str, str]] | None = None  # a case that is more than one command


@dataclass(frozen=True)
class Outcome:
    case: str
    outcome: str
    detail: str
    seconds: float


QUICK = ["--rounds", "1", "--clients", "4", "--quiet"]


def fedskew(argv: list[str], cwd: Path, timeout: float) -> tuple[int | None, str, str]:
    """Run ``fedskew ARGV`` in ``cwd``: (exit status, or None when killed at the time limit; stdout; stderr)."""
    env = {**os.environ, "COLUMNS": "120", "PYTHONWARNINGS": "default"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedskew.cli", *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return None, out, err
    return proc.returncode, out, err


def classify(case: Case, code: int | None, err: str) -> tuple[str, str]:
    if code is None:
        return "hang", f"still running after {case.timeout:.0f}s"
    if "Traceback (most recent call last)" in err:
        return "traceback", err.strip().splitlines()[-1][:300]
    want = {"error": 2, "after": 4, "ok": 0}[case.expect]
    if code != want:
        return "unexpected", f"exit {code}, expected {want}: {err.strip()[-300:]}"
    if case.expect != "ok":
        lines = err.splitlines()
        errors = [i for i, ln in enumerate(lines) if ln.startswith("error:")]
        if len(errors) != 1:
            return "unexpected", f"{len(errors)} error lines: {err.strip()[-300:]}"
        message = "\n".join(lines[errors[0] :])  # an error may list its details on indented lines
        if case.says and not re.search(case.says, message):
            return "unexpected", f"the error does not say /{case.says}/: {message[:300]}"
    return "clean", ""


def run_case(case: Case, root: Path) -> Outcome:
    work = root / case.name
    work.mkdir(parents=True)
    t0 = time.perf_counter()
    if case.prepare is not None:
        try:
            case.prepare(work)
        except Exception as exc:  # the case's own set-up failed: reported as such, the others go on
            return Outcome(case.name, "unexpected", f"set-up failed: {type(exc).__name__}: {exc}", 0.0)
    if case.runner is not None:
        outcome, detail = case.runner(case, work)
    else:
        code, _, err = fedskew(case.argv, work, case.timeout)
        outcome, detail = classify(case, code, err)
        if outcome == "clean" and case.check is not None:
            found = case.check(work)
            if found is not None:
                outcome, detail = found
    return Outcome(case.name, outcome, detail, time.perf_counter() - t0)


# ---- helpers for the cases -------------------------------------------------------------------------------------------
def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write(name: str, data: bytes | str) -> Callable[[Path], None]:
    def prepare(work: Path) -> None:
        (work / name).write_bytes(data if isinstance(data, bytes) else data.encode())

    return prepare


def foreign_sqlite(work: Path) -> None:
    import sqlite3

    con = sqlite3.connect(work / "other.db")
    con.execute("create table runs (id integer, name text)")
    con.execute("insert into runs values (1, 'theirs')")
    con.commit()
    con.close()
    (work / "other.sha").write_text(digest(work / "other.db"))


def unchanged(name: str) -> Check:
    def check(work: Path) -> tuple[str, str] | None:
        if digest(work / name) != (work / f"{name.split('.')[0]}.sha").read_text():
            return "lost", f"{name} was changed"
        return None

    return check


def npz(name: str, y: np.ndarray, y_test: np.ndarray | None = None) -> Callable[[Path], None]:
    def prepare(work: Path) -> None:
        rng = np.random.default_rng(0)
        arrays = {"x": rng.integers(0, 255, (len(y), 8, 8), dtype=np.uint8), "y": y}
        if y_test is not None:
            arrays |= {"x_test": rng.integers(0, 255, (len(y_test), 8, 8), dtype=np.uint8), "y_test": y_test}
        (work / "data").mkdir()
        np.savez(work / "data" / name, **arrays)

    return prepare


def finished_run(work: Path, name: str = "r", *extra: str) -> Path:
    """A finished 2-round run in ``work/name`` with its client state on disk (the state a careless command meets)."""
    code, _, err = fedskew(["run", "--rounds", "2", "--clients", "4", "--method", "scaffold", "--quiet", "--no-db",
                            "--state-store", "disk", "--out", name, *extra], work, 300)  # fmt: skip
    if code != 0:
        raise RuntimeError(f"could not make the run the case starts from: {err[-500:]}")
    return work / name


def foreign_file_in_client_state(work: Path) -> None:
    run = finished_run(work)
    (run / "client_state").mkdir(exist_ok=True)
    (run / "client_state" / "notes.txt").write_text("mine")
    (work / "kept.json").write_text(json.dumps(sorted(p.name for p in run.iterdir())))


def old_run_kept(work: Path) -> tuple[str, str] | None:
    run = work / "r"
    kept = json.loads((work / "kept.json").read_text())
    now = sorted(p.name for p in run.iterdir()) if run.is_dir() else []
    if now != kept or not (run / "client_state" / "notes.txt").is_file():
        return "lost", f"the old run's files were {kept}, now {now}"
    return None


def kill_and_resume(case: Case, work: Path) -> tuple[str, str]:
    """kill -9 mid-run, resume: the records equal an uninterrupted run's (and the first run's files are spared)."""
    args = ["run", "--rounds", "6", "--clients", "6", "--method", "scaffold", "--checkpoint-every", "1", "--no-db",
            "--quiet", "--state-store", "disk", "--skew-probes", "0"]  # fmt: skip
    code, _, err = fedskew([*args, "--out", "whole"], work, case.timeout)
    if code != 0:
        return classify(case, code, err)
    env = {**os.environ}
    proc = subprocess.Popen([sys.executable, "-m", "fedskew.cli", *args, "--out", "cut"], cwd=work, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    metrics = work / "cut" / "metrics.jsonl"
    deadline = time.monotonic() + case.timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    code, _, err = fedskew(["run", "--resume", "cut", "--quiet"], work, case.timeout)
    outcome, detail = classify(Case(case.name, [], "ok"), code, err)
    if outcome != "clean":
        return outcome, detail

    def records(name: str) -> list[dict]:
        lines = (work / name / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(s).items() if not k.startswith("time")} for s in lines]

    if records("cut") != records("whole"):
        return "wrong", "the resumed run's records differ from the uninterrupted run's"
    return "clean", ""


def workers_die_with_their_parent(case: Case, work: Path) -> tuple[str, str]:
    """kill -9 of a --workers 2 run: its worker processes end too (none left after 10 s)."""
    proc = subprocess.Popen([sys.executable, "-m", "fedskew.cli", "run", "--workers", "2", "--rounds", "200",
                             "--clients", "6", "--no-db", "--quiet", "--out", "w"], cwd=work,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    metrics = work / "w" / "metrics.jsonl"
    deadline = time.monotonic() + case.timeout
    while time.monotonic() < deadline and not (metrics.is_file() and metrics.read_text().strip()):
        time.sleep(0.05)
    children = _children(proc.pid)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    if not children:
        return "unexpected", "the run had no worker processes to check"
    left = children
    for _ in range(100):
        left = [pid for pid in left if _alive(pid)]
        if not left:
            return "clean", ""
        time.sleep(0.1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return "hang", f"worker processes {left} outlived their killed parent"


def _children(pid: int) -> list[int]:
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = next(ln for ln in status.read_text().splitlines() if ln.startswith("PPid:"))
        except (OSError, StopIteration):
            continue
        if int(ppid.split()[1]) == pid:
            found.append(int(status.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = next(ln for ln in Path(f"/proc/{pid}/status").read_text().splitlines() if ln.startswith("State:"))
    except (OSError, StopIteration):
        return False
    return " Z" not in state  # a zombie has ended


def interrupted_run(work: Path, name: str, args: list[str], rounds: int = 2, timeout: float = 300) -> Path:
    """``fedskew run ARGS --out NAME`` killed with SIGKILL once ``rounds`` rounds are recorded."""
    proc = subprocess.Popen([sys.executable, "-m", "fedskew.cli", "run", *args, "--out", name], cwd=work,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    metrics = work / name / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= rounds:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if not metrics.is_file():
        raise RuntimeError(f"the run to interrupt wrote no round in {timeout:.0f}s")
    return work / name


LONG = ["--rounds", "50", "--clients", "6", "--checkpoint-every", "1", "--no-db", "--quiet", "--skew-probes", "0"]


def damaged_checkpoint(work: Path) -> None:
    run = interrupted_run(work, "r", LONG)
    for ckpt in run.glob("checkpoint*"):
        ckpt.write_bytes(ckpt.read_bytes()[: len(ckpt.read_bytes()) // 2])


def zeroed_checkpoint(work: Path) -> None:
    """64 zero bytes inside the checkpoint: torch still reads it (the damaged tensors), the recorded CRC-32 does not."""
    run = interrupted_run(work, "r", LONG)
    for ckpt in run.glob("checkpoint*"):
        data = bytearray(ckpt.read_bytes())
        data[len(data) // 2 : len(data) // 2 + 64] = bytes(64)
        ckpt.write_bytes(bytes(data))


def deleted_metrics(work: Path) -> None:
    (interrupted_run(work, "r", LONG) / "metrics.jsonl").unlink()


def node_data_app(work: Path) -> None:
    """A Flower app whose nodes read their own data directories (`fedskew flower new --node-data`)."""
    code, _, err = fedskew(["flower", "new", "--node-data", "app"], work, 120)
    if code != 0:
        raise RuntimeError(err[-500:])


# ---- the cases -------------------------------------------------------------------------------------------------------
CASES: tuple[Case, ...] = (
    # configuration
    Case("dup_yaml_key", ["run", "--config", "c.yaml"], says="line 2: key 'rounds' is given twice",
         prepare=write("c.yaml", "rounds: 2\nrounds: 3\n")),
    Case("non_utf8_yaml", ["run", "--config", "c.yaml"], says="not UTF-8",
         prepare=write("c.yaml", b"rounds: 2\n# caf\xe9\n")),
    Case("yaml_not_a_mapping", ["run", "--config", "c.yaml"], says="c.yaml", prepare=write("c.yaml", "- 1\n- 2\n")),
    Case("unknown_yaml_key", ["run", "--config", "c.yaml"], says="roundz", prepare=write("c.yaml", "roundz: 2\n")),
    Case("negative_lr", ["run", "--lr", "-1", *QUICK], says="lr"),
    Case("zero_clients", ["run", "--clients", "0", "--rounds", "1"], says="clients"),
    Case("alpha_zero", ["run", "--alpha", "0", *QUICK], says="alpha"),
    Case("unknown_method", ["run", "--method", "fedavgg", *QUICK], says="fedavgg"),
    Case("refused_composition", ["run", "--method", "fedsa+heal", *QUICK], says="fedsa"),
    Case("unknown_partition", ["run", "--partition", "zipf", *QUICK], says="zipf"),
    Case("impossible_pathological", ["run", "--partition", "pat", "--classes-per-client", "20", *QUICK], says="20"),
    Case("seed_too_large", ["run", "--seed", str(2**60), *QUICK], says="seed"),
    Case("bad_method_arg", ["run", "--method", "fedprox", "-m", "mu=-1", *QUICK], says="mu"),
    Case("dp_without_noise", ["run", "--dp-clip", "1", *QUICK], says="dp_noise"),
    Case("streaming_refused", ["run", "--method", "fedsa", "--aggregation", "streaming", "--skew-probes", "0", *QUICK],
         says="streaming"),
    # data
    Case("npz_one_class", ["run", "--dataset", "npz", "--data-dir", "data", *QUICK], says="class",
         prepare=npz("d.npz", np.zeros(200, dtype=np.int64))),
    Case("npz_huge_label", ["run", "--dataset", "npz", "--data-dir", "data", *QUICK], says="label",
         prepare=npz("d.npz", np.array([0, 1_000_000] * 100, dtype=np.int64))),
    Case("npz_empty_test", ["run", "--dataset", "npz", "--data-dir", "data", *QUICK], says="test",
         prepare=npz("d.npz", np.arange(200) % 4, np.zeros(0, dtype=np.int64))),
    Case("missing_mnist", ["run", "--dataset", "mnist", "--data-dir", "nowhere", *QUICK], says="mnist"),
    Case("corrupt_idx", ["run", "--dataset", "mnist", "--data-dir", "data", *QUICK], says="truncated IDX header",
         prepare=lambda w: [(w / "data").mkdir(), *((w / "data" / f).write_bytes(b"\x00\x00\x08\x03garbage") for f in (
             "train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
             "t10k-labels-idx1-ubyte"))][0]),  # fmt: skip
    # databases, run folders, resume
    Case("foreign_db_run", ["run", "--db", "other.db", *QUICK], says="not a fedskew results database",
         prepare=foreign_sqlite, check=unchanged("other.db")),
    Case("foreign_db_report", ["report", "--db", "other.db"], says="not a fedskew results database",
         prepare=foreign_sqlite, check=unchanged("other.db")),
    Case("report_missing_db", ["report", "--db", "none.db"], says="no results database"),
    Case("db_import_corrupt_summary", ["db", "import", "--db", "x.db", "r"], says="summary",
         prepare=lambda w: (finished_run(w) / "summary.json").write_text("{not json")),
    Case("overwrite_spares_a_foreign_file", ["run", "--out", "r", "--overwrite", *QUICK], says="does not delete",
         prepare=foreign_file_in_client_state, check=old_run_kept, timeout=300),
    Case("resume_damaged_checkpoint", ["run", "--resume", "r", "--quiet"], says="checkpoint",
         prepare=damaged_checkpoint, timeout=300),
    Case("resume_zeroed_checkpoint", ["run", "--resume", "r", "--quiet"], says="CRC-32",
         prepare=zeroed_checkpoint, timeout=300),
    Case("resume_without_metrics", ["run", "--resume", "r", "--quiet"], says="metrics.jsonl",
         prepare=deleted_metrics, timeout=300),
    Case("resume_nothing", ["run", "--resume", "nowhere", "--quiet"], says="nowhere"),
    Case("kill_9_then_resume", [], expect="ok", runner=kill_and_resume, timeout=300),
    Case("workers_die_with_their_parent", [], expect="ok", runner=workers_die_with_their_parent, timeout=120),
    # other commands
    Case("partition_plot_txt", ["partition", "--plot", "p.txt"], says="figure file"),
    Case("sweep_too_many_runs", ["sweep", "s.yaml", "--dry-run"], says="100,000,000",
         prepare=write("s.yaml", "base: {rounds: 1}\nmethods: [fedavg]\nseeds: 100000000\n"), timeout=60),
    Case("sweep_bad_key", ["sweep", "s.yaml", "--dry-run"], says="roundz",
         prepare=write("s.yaml", "base: {roundz: 1}\nmethods: [fedavg]\n")),
    Case("flower_loopback_node_data_app", ["flower", "loopback", "app"], says="each node's own data directory",
         prepare=node_data_app),
    Case("flower_new_node_wait_zero", ["flower", "new", "--node-wait", "0", "app"], says="node-wait"),
    Case("skew_not_a_run", ["skew", "nowhere"], says="nowhere"),
    Case("methods_unknown", ["methods", "nope"], says="nope"),
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="comma-separated case names")
    p.add_argument("--verbose", action="store_true", help="one line per case, clean ones too")
    p.add_argument("--json", help="write the outcomes to this file")
    args = p.parse_args(argv)
    cases = [c for c in CASES if not args.only or c.name in args.only.split(",")]
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="fedskew-faults-") as tmp:
        for case in cases:
            outcome = run_case(case, Path(tmp))
            outcomes.append(outcome)
            if args.verbose or outcome.outcome != "clean":
                print(f"{outcome.case:<34} {outcome.outcome:<10} {outcome.seconds:5.1f}s {outcome.detail}", flush=True)
    tally = Counter(o.outcome for o in outcomes)
    kinds = ("clean", "traceback", "hang", "lost", "wrong", "unexpected")
    print(f"{len(outcomes)} cases: " + ", ".join(f"{k} {tally.get(k, 0)}" for k in kinds))
    if args.json:
        Path(args.json).write_text(json.dumps([o.__dict__ for o in outcomes], indent=1))
    return 0 if tally.get("clean", 0) == len(outcomes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
