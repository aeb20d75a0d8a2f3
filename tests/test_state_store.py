"""Issue 25 item 1: per-client state off the heap. A disk-backed client-state store gives the numbers of the in-memory
one bit for bit (partial participation, drop-outs, resume, workers, batched clients), a killed run resumes with the
store intact, the store never takes or deletes a directory that is not its own, and the memory budget decides."""

import io
import json
import multiprocessing
import os
from pathlib import Path

import pytest
import torch
import yaml

from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.engine.checkpoint import capture, restore
from fedskew.engine.loop import Simulation
from fedskew.engine.state_store import (
    MAPS,
    STATE_DIR,
    ClientStateStore,
    DiskMap,
    StoreDirError,
    StoreFiles,
    choose_store,
    memory_budget,
    state_copies,
)
from fedskew.methods import resolve_method
from fedskew.protocol import TIMING_KEYS
from fedskew.runner import run_experiment
from fedskew.schema import ConfigError
from fedskew.sizes import parse_size

pytestmark = pytest.mark.usefixtures("one_thread")


def _cfg(method: str, store: str, **over):
    values = {
        "method": method,
        "clients": 10,
        "rounds": 4,
        "join_ratio": 0.5,
        "client_dropout": 0.2,
        "db": None,
        "skew_probes": 0,
        "seed": 3,
        "state_store": store,
        **over,
    }
    return make_config(None, values)


def _record(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in TIMING_KEYS}


def _same(a, b) -> bool:
    """Bit-for-bit equality of nested states: same keys in the same order, same dtypes, shapes, strides, values."""
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and a.stride() == b.stride()
            and a.requires_grad == b.requires_grad
            and torch.equal(a.detach(), b.detach())
        )
    return type(a) is type(b) and a == b


def _same_maps(x: Simulation, y: Simulation) -> None:
    for name in MAPS:
        mx, my = getattr(x, name), getattr(y, name)
        assert sorted(mx) == sorted(my), name
        for cid in mx:
            assert _same(mx.get(cid), my.get(cid)), (name, cid)


# ---- the round trip ---------------------------------------------------------------------------------------------
def _odd_state() -> dict:
    g = torch.Generator().manual_seed(0)
    conv = torch.randn(4, 3, 3, 3, generator=g).to(memory_format=torch.channels_last)
    return {
        "model": {
            "w": torch.randn(5, 7, generator=g),
            "conv": conv,
            "steps": torch.tensor(12, dtype=torch.int64),
            "mask": torch.rand(9, generator=g) > 0.5,
            "half": torch.randn(3, generator=g).to(torch.bfloat16),
            "d": torch.randn(2, 2, generator=g, dtype=torch.float64),
            "transposed": torch.randn(3, 5, generator=g).t(),
        },
        "c_i": torch.randn(6, generator=g).requires_grad_(True),
        "count": 3,
        "note": "text",
        "none": None,
        "empty": {},
        "nothing": torch.empty(0),
    }


def test_a_state_comes_back_bit_for_bit(tmp_path):
    store = ClientStateStore("disk", 4, tmp_path / "s")
    states = store.maps["client_states"]
    assert isinstance(states, DiskMap)
    value = _odd_state()
    states[2] = value
    states.commit()
    assert states.cached() == 0
    back = states[2]
    assert back is not value and _same(back, value)
    assert back["model"]["conv"].is_contiguous(memory_format=torch.channels_last)
    assert _same(states.peek_entry(2, "model"), value["model"]) and states.peek_entry(2, "missing") is None
    assert _same(states[0], {}) and len(states) == 4  # a client never written holds the default state
    states[3] = {"expanded": torch.arange(3.0).expand(4, 3)}  # overlapping elements: back as a contiguous copy
    states.release(3)
    assert torch.equal(states[3]["expanded"], torch.arange(3.0).expand(4, 3)) and states[3]["expanded"].is_contiguous()
    store.maps["trained"][1] = value["model"]
    store.commit()
    assert _same(store.maps["trained"].get(1), value["model"]) and 3 not in store.maps["trained"]
    assert store.maps["trained"].get(3) is None and list(store.maps["trained"]) == [1]


def test_client_state_changed_in_place_is_written_back(tmp_path):
    states = ClientStateStore("disk", 3, tmp_path / "s").maps["client_states"]
    states[1]["c_i"] = torch.ones(4)  # as a client part does: into the state it was handed
    states.release(1)
    assert torch.equal(states.peek(1)["c_i"], torch.ones(4))
    states.peek(2)["x"] = torch.ones(1)  # peek: read only, never written back
    states.commit()
    assert "x" not in states[2]


def test_a_checkpointed_slot_is_never_overwritten(tmp_path):
    """Rows written after a checkpoint go to the other slot: a resume from it reads exactly what it referenced."""
    store = ClientStateStore("disk", 2, tmp_path / "s")
    states = store.maps["client_states"]
    states[0] = {"w": torch.full((3,), 1.0)}
    ref = store.capture()
    for v in (2.0, 3.0):  # two later versions: the second overwrites the first, never the pinned one
        states[0] = {"w": torch.full((3,), v)}
        states.commit()
    again = ClientStateStore("disk", 2, tmp_path / "s")
    maps = again.restore(ref)
    assert torch.equal(maps["client_states"][0]["w"], torch.full((3,), 1.0))
    maps["client_states"][0] = {"w": torch.full((3,), 4.0)}  # the resumed run writes the other slot again
    maps["client_states"].commit()
    assert torch.equal(
        ClientStateStore("disk", 2, tmp_path / "s").restore(ref)["client_states"][0]["w"], torch.full((3,), 1.0)
    )


def test_a_trained_model_that_is_the_clients_own_is_written_once(tmp_path):
    """Ditto's trained model is its own model: stored as an alias of that entry, and materialized before the entry
    changes without it (a client whose malformed upload was rejected keeps its trained view)."""
    store = ClientStateStore("disk", 2, tmp_path / "s")
    states, trained = store.maps["client_states"], store.maps["trained"]
    own = {"w": torch.ones(3)}
    states[0]["personal_model"] = own
    trained[0] = own
    store.release(0)
    one_copy = store.state_bytes()
    ref = store.capture()
    states[0]["personal_model"] = {"w": torch.full((3,), 2.0)}  # trained again, but the trained view stays
    store.commit()
    assert torch.equal(trained[0]["w"], torch.ones(3)) and torch.equal(states[0]["personal_model"]["w"], 2 * own["w"])
    assert store.state_bytes() == 2 * one_copy
    maps = ClientStateStore("disk", 2, tmp_path / "s").restore(ref)
    assert torch.equal(maps["trained"][0]["w"], torch.ones(3))
    assert torch.equal(maps["client_states"][0]["personal_model"]["w"], torch.ones(3))


# ---- identical numbers ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["ditto", "scaffold", "fedcac"])
def test_disk_store_equals_memory_bit_for_bit(tmp_path, method):
    """Partial participation and drop-outs over four rounds: identical records and identical final client state."""
    mem_cfg, disk_cfg = _cfg(method, "memory"), _cfg(method, "disk")
    mem = Simulation(mem_cfg, build_federated(mem_cfg))
    disk = Simulation(disk_cfg, build_federated(disk_cfg), state_dir=tmp_path / STATE_DIR)
    assert disk.state_store.backend == "disk" and isinstance(disk.client_states, DiskMap)
    dropped = []
    for rnd in range(1, 5):
        record = _record(mem.round(rnd).record)
        assert record == _record(disk.round(rnd).record)
        assert all(m.cached() == 0 for m in disk.state_store.maps.values())  # nothing stays in RAM between rounds
        dropped += record["dropped_out"]
    assert dropped  # the drop-outs happened
    _same_maps(mem, disk)
    assert disk.state_store.state_bytes() > 0
    assert (tmp_path / STATE_DIR / "store.json").is_file()


def test_a_rejected_upload_keeps_the_trained_view_on_disk_too(tmp_path, monkeypatch):
    """Ditto, client 1's upload malformed in round 2 and dropped: its own model advanced, its trained view did not
    (the alias of the trained model is materialized before the own model is overwritten)."""
    import dataclasses

    from fedskew.engine import rounds

    real = rounds.local_train

    def faulty(algo, ctx, *args, **kwargs):
        update = real(algo, ctx, *args, **kwargs)
        if ctx.cid == 1 and ctx.round == 2:
            return dataclasses.replace(update, params={k: v for k, v in list(update.params.items())[1:]})
        return update

    monkeypatch.setattr(rounds, "local_train", faulty)
    over = {"join_ratio": 1.0, "client_dropout": 0.0, "on_bad_update": "drop", "clients": 5}
    mem_cfg, disk_cfg = _cfg("ditto", "memory", **over), _cfg("ditto", "disk", **over)
    mem = Simulation(mem_cfg, build_federated(mem_cfg))
    disk = Simulation(disk_cfg, build_federated(disk_cfg), state_dir=tmp_path / STATE_DIR)
    for rnd in (1, 2, 3):
        record = _record(mem.round(rnd).record)
        assert record == _record(disk.round(rnd).record)
        if rnd == 2:
            assert [d["client"] for d in record["dropped"]] == [1]
            assert mem.trained[1] is not mem.client_states[1]["personal_model"]
            _same_maps(mem, disk)
    _same_maps(mem, disk)


@pytest.mark.parametrize("method", ["ditto", "scaffold"])
def test_resume_from_a_disk_checkpoint_after_later_rounds_wrote(tmp_path, method):
    """Capture after round 2, run rounds 3-4 (they write the store), then resume a fresh simulation from the round-2
    checkpoint into the same directory: rounds 3-4 again give the same numbers as the uninterrupted run."""
    cfg = _cfg(method, "disk")
    data = build_federated(cfg)
    first = Simulation(cfg, data, state_dir=tmp_path / STATE_DIR)
    whole = [_record(first.round(r).record) for r in (1, 2)]
    buf = io.BytesIO()
    torch.save(capture(first), buf)
    whole += [_record(first.round(r).record) for r in (3, 4)]
    first.close()
    resumed = Simulation(cfg, data, state_dir=tmp_path / STATE_DIR)
    buf.seek(0)
    restore(resumed, torch.load(buf, weights_only=False))
    assert [_record(resumed.round(r).record) for r in (3, 4)] == whole[2:]
    _same_maps(first, resumed)


def test_a_memory_checkpoint_continues_on_disk_and_back(tmp_path):
    cfg_mem, cfg_disk = _cfg("ditto", "memory"), _cfg("ditto", "disk")
    data = build_federated(cfg_mem)
    mem = Simulation(cfg_mem, data)
    for r in (1, 2):
        mem.round(r)
    on_disk = Simulation(cfg_disk, data, state_dir=tmp_path / "a")
    restore(on_disk, capture(mem))
    ref = capture(on_disk)
    back = Simulation(cfg_mem, data)
    restore(back, ref)
    assert isinstance(back.client_states, dict)
    want = [_record(mem.round(r).record) for r in (3, 4)]
    assert [_record(on_disk.round(r).record) for r in (3, 4)] == want
    assert [_record(back.round(r).record) for r in (3, 4)] == want


def test_workers_and_batched_clients_use_the_store(tmp_path):
    """Forked workers and batched clients read and advance client_states through the disk store's mapping."""
    for over in ({"workers": 2}, {"batched_clients": True}):
        mem_cfg, disk_cfg = _cfg("scaffold", "memory", rounds=3, **over), _cfg("scaffold", "disk", rounds=3, **over)
        mem, disk = Simulation(mem_cfg, build_federated(mem_cfg)), Simulation(disk_cfg, build_federated(disk_cfg))
        try:
            for rnd in (1, 2, 3):
                assert _record(mem.round(rnd).record) == _record(disk.round(rnd).record), over
            _same_maps(mem, disk)
        finally:
            mem.close()
            disk.close()


# ---- a killed run resumes with the store intact ---------------------------------------------------------------------
def _killed_child(values: dict, kill_after: int) -> None:
    def die(result):
        if result.record["round"] == kill_after:
            os._exit(137)

    run_experiment(make_config(None, values), on_round=die)
    os._exit(0)


def _metrics(run_dir: Path) -> list[dict]:
    return [_record(json.loads(line)) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_killed_run_resumes_from_its_store(tmp_path):
    values = {
        "method": "ditto",
        "clients": 6,
        "join_ratio": 0.5,
        "client_dropout": 0.2,
        "rounds": 5,
        "checkpoint_every": 2,  # killed after round 3: the checkpoint is round 2's, round 3 already wrote the store
        "skew_probes": 0,
        "db": None,
        "seed": 4,
    }
    run_experiment(make_config(None, {**values, "state_store": "memory", "out": str(tmp_path / "whole")}))
    killed = {**values, "state_store": "disk", "out": str(tmp_path / "killed")}
    child = multiprocessing.get_context("fork").Process(target=_killed_child, args=(killed, 3))
    child.start()
    child.join(120)
    assert child.exitcode == 137
    store = tmp_path / "killed" / STATE_DIR
    assert json.loads((store / "store.json").read_text())["owner"]  # the run's id
    out = run_experiment(make_config(None, killed))  # the same command resumes
    assert out.summary["rounds"] == 5
    assert _metrics(tmp_path / "killed") == _metrics(tmp_path / "whole")
    assert not store.exists()  # like the checkpoint, removed once the run has ended


@pytest.mark.parametrize("damage", ["flip", "zero"])
def test_a_resume_refuses_client_state_changed_on_disk_by_its_checksum(tmp_path, capsys, damage):
    """Issue 46: client-state rows zeroed or altered on disk were loaded on resume and the run finished with other
    numbers (or "diverged"). Each row carries a CRC-32 of its data, checked when a resumed run first reads it."""
    from fedskew.cli import main

    values = {
        "method": "ditto", "clients": 6, "join_ratio": 1.0, "rounds": 4, "checkpoint_every": 2, "skew_probes": 0,
        "db": None, "seed": 4, "state_store": "disk", "out": str(tmp_path / "run"),
    }  # fmt: skip
    child = multiprocessing.get_context("fork").Process(target=_killed_child, args=(values, 2))
    child.start()
    child.join(120)
    assert child.exitcode == 137
    store = tmp_path / "run" / STATE_DIR
    marker = json.loads((store / "store.json").read_text())
    assert all(a["checksum"] for a in marker["arrays"])
    arrays = sorted(store.glob("*.bin"))
    for path in arrays:  # every row written: whichever the resume reads first is damaged
        data = bytearray(path.read_bytes())
        row = len(data) // (6 * 2)  # [clients, 2 slots, row_bytes]
        for start in range(0, len(data), row):
            if any(data[start : start + row]):
                if damage == "flip":
                    data[start + row // 3] ^= 0xFF
                else:
                    data[start : start + row] = bytes(row)
        path.write_bytes(bytes(data))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump({k: v for k, v in values.items() if k != "db"}))
    assert main(["run", "--config", str(tmp_path / "run.yaml"), "--no-db", "--quiet"]) == 2
    err = capsys.readouterr().err
    said = "fails its checksum" if damage == "flip" else "is all zeros"
    assert said in err and any(a.name in err for a in arrays) and "--overwrite" in err and "Traceback" not in err


def test_resume_refuses_a_store_that_is_not_the_checkpoints(tmp_path):
    values = {"method": "scaffold", "clients": 4, "rounds": 3, "checkpoint_every": 1, "skew_probes": 0, "db": None}
    killed = {**values, "state_store": "disk", "out": str(tmp_path / "run")}
    child = multiprocessing.get_context("fork").Process(target=_killed_child, args=(killed, 2))
    child.start()
    child.join(120)
    marker = tmp_path / "run" / STATE_DIR / "store.json"
    saved = marker.read_text()
    marker.write_text(saved.replace(json.loads(saved)["store_id"], "0" * 32))
    with pytest.raises(ConfigError, match="another client-state store"):
        run_experiment(make_config(None, killed))
    marker.write_text(saved)
    (tmp_path / "run" / STATE_DIR / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="not its client-state store's: notes.txt"):
        run_experiment(make_config(None, killed))
    (tmp_path / "run" / STATE_DIR / "notes.txt").unlink()
    assert run_experiment(make_config(None, killed)).summary["rounds"] == 3


def test_overwrite_removes_the_replaced_runs_store(tmp_path):
    values = {"method": "ditto", "clients": 4, "rounds": 2, "checkpoint_every": 1, "skew_probes": 0, "db": None}
    killed = {**values, "state_store": "disk", "out": str(tmp_path / "run")}
    child = multiprocessing.get_context("fork").Process(target=_killed_child, args=(killed, 1))
    child.start()
    child.join(120)
    old = json.loads((tmp_path / "run" / STATE_DIR / "store.json").read_text())["store_id"]
    created = []
    out = run_experiment(
        make_config(None, killed),
        overwrite=True,
        on_round=lambda r: created.append((tmp_path / "run" / STATE_DIR / "store.json").read_text()),
    )
    assert out.summary["rounds"] == 2 and old not in created[0]
    assert not (tmp_path / "run" / STATE_DIR).exists()


# ---- ownership ------------------------------------------------------------------------------------------------------
def test_the_store_refuses_a_directory_that_is_not_its_own(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "data.bin").write_bytes(b"x")
    store = ClientStateStore("disk", 3, foreign)
    with pytest.raises(StoreDirError, match="not a client-state store's"):
        store.maps["client_states"][0] = {"w": torch.ones(2)}
        store.commit()
    with pytest.raises(StoreDirError, match="not a client-state store"):
        StoreFiles.remove_dir(foreign)
    assert (foreign / "data.bin").read_bytes() == b"x"  # never deleted

    mine = ClientStateStore("disk", 3, tmp_path / "mine", owner="run-a")
    mine.maps["client_states"][0] = {"w": torch.ones(2)}
    mine.commit()
    other = ClientStateStore("disk", 3, tmp_path / "mine", owner="run-b")
    with pytest.raises(StoreDirError, match=r"another run \(run-a\)"):
        other.create()
    with pytest.raises(StoreDirError, match="another client-state store"):
        StoreFiles.open(tmp_path / "mine", "f" * 32, 3)


def test_removing_a_store_deletes_only_its_own_files(tmp_path):
    store = ClientStateStore("disk", 3, tmp_path / "s")
    store.maps["client_states"][1] = {"w": torch.ones(2)}
    store.commit()
    (tmp_path / "s" / "keep.txt").write_text("mine")
    store.remove()
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["keep.txt"]
    store2 = ClientStateStore("disk", 3, tmp_path / "t")
    store2.maps["trained"][0] = {"w": torch.ones(2)}
    store2.commit()
    store2.remove()
    assert not (tmp_path / "t").exists()  # it made the directory, and nothing else was in it


def test_a_store_without_a_directory_cleans_up_its_temporary_one():
    store = ClientStateStore("disk", 2)
    store.maps["client_states"][0] = {"w": torch.ones(2)}
    store.commit()
    where = store.files.directory
    assert where.is_dir()
    store.close()
    assert not where.exists()


# ---- the budget ------------------------------------------------------------------------------------------------------
def test_the_memory_budget_picks_the_backend():
    assert choose_store("auto", parse_size("2GB"), 10**6, 1000) == "memory"  # 1 GB of state
    assert choose_store("auto", parse_size("2GB"), 10**6, 10_000) == "disk"  # 10 GB
    assert choose_store("memory", 1, 10**9, 10**6) == "memory" and choose_store("disk", 10**12, 1, 1) == "disk"
    assert memory_budget("512MiB") == 512 * 2**20 and memory_budget(None) > 0
    assert state_copies(resolve_method("fedavg", {})) == 0
    assert state_copies(resolve_method("ditto", {})) == state_copies(resolve_method("scaffold", {})) == 2
    assert state_copies(resolve_method("fedper", {})) >= 1
    cfg = _cfg("ditto", "auto", clients=10, state_memory="1kB")
    assert Simulation(cfg, build_federated(cfg)).state_store.backend == "disk"
    cfg = _cfg("ditto", "auto", clients=10)
    assert Simulation(cfg, build_federated(cfg)).state_store.backend == "memory"


def test_sizes():
    assert parse_size("2GB") == 2 * 10**9 and parse_size("1.5g") == 1_500_000_000
    assert parse_size("64KiB") == 65536 and parse_size(1234) == 1234 and parse_size("10 MB") == 10**7
    for bad in ("", "GB", "2XB", "1iB", "-3", True):
        with pytest.raises(ValueError):
            parse_size(bad)
    with pytest.raises(ConfigError, match="state_memory"):
        make_config(None, {"state_memory": "lots"})
    assert "state_store" not in make_config(None, {"state_store": "disk"}).identity()


def test_overwrite_that_cannot_replace_the_client_state_deletes_nothing(tmp_path):
    """Issue 46: --overwrite of a run whose client_state/ held a file fedskew did not write deleted the old run
    (checkpoint, metrics) and then refused to run, leaving neither run. Now it refuses first and deletes nothing."""
    values = {"method": "ditto", "clients": 4, "rounds": 2, "checkpoint_every": 1, "skew_probes": 0, "db": None}
    cfg = make_config(None, {**values, "state_store": "disk", "out": str(tmp_path / "run")})
    child = multiprocessing.get_context("fork").Process(target=_killed_child, args=(cfg.model_dump(), 1))
    child.start()
    child.join(120)
    run_dir = tmp_path / "run"
    (run_dir / STATE_DIR / "notes.txt").write_text("mine")
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*") if p.is_file() and p.name != "run.lock")
    assert (run_dir / "checkpoint.pt").is_file() and (run_dir / "metrics.jsonl").is_file()
    with pytest.raises(ConfigError, match=r"holds files fedskew did not write \(notes.txt\); nothing was deleted"):
        run_experiment(cfg, overwrite=True)
    after = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*") if p.is_file() and p.name != "run.lock")
    assert after == before
    (run_dir / STATE_DIR / "notes.txt").unlink()
    assert run_experiment(cfg, overwrite=True).summary["rounds"] == 2


def test_a_resume_refuses_a_record_that_lacks_rounds_the_checkpoint_holds(tmp_path):
    """Issue 46: a deleted metrics.jsonl (or a lost line of it) went unnoticed on resume and the run finished with a
    summary of part of its rounds; now the resume is refused, naming what is missing, and nothing is changed."""
    from fedskew.results.rundir import RunDirError

    values = {"method": "fedavg", "clients": 3, "rounds": 4, "checkpoint_every": 1, "skew_probes": 0, "db": None}
    cfg = make_config(None, {**values, "out": str(tmp_path / "run")})
    child = multiprocessing.get_context("fork").Process(target=_killed_child, args=(cfg.model_dump(), 2))
    child.start()
    child.join(120)
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines(keepends=True)
    assert len(lines) == 2
    metrics.write_text(lines[1])  # round 1 lost
    with pytest.raises(RunDirError, match=r"metrics.jsonl lacks round\(s\) 1 of the 2 the checkpoint holds"):
        run_experiment(cfg, resume=True)
    metrics.unlink()
    with pytest.raises(RunDirError, match="metrics.jsonl is gone but the checkpoint is after round 2"):
        run_experiment(cfg, resume=True)
    metrics.write_text("".join(lines))
    assert run_experiment(cfg, resume=True).summary["rounds"] == 4  # restored: the lock was released each time


def test_a_damaged_status_file_blocks_neither_resume_nor_overwrite(tmp_path):
    values = {"method": "fedavg", "clients": 3, "rounds": 3, "checkpoint_every": 1, "skew_probes": 0, "db": None}
    cfg = make_config(None, {**values, "out": str(tmp_path / "run")})
    child = multiprocessing.get_context("fork").Process(target=_killed_child, args=(cfg.model_dump(), 1))
    child.start()
    child.join(120)
    status = tmp_path / "run" / "status.json"
    status.write_text('{"run_id": "x", "stat')  # truncated by a crash of the disk, say
    out = run_experiment(cfg, resume=True)
    assert out.summary["rounds"] == 3 and json.loads(status.read_text())["status"] == "finished"
    status.write_text("[]")
    assert run_experiment(cfg, overwrite=True).summary["rounds"] == 3
