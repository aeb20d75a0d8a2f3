"""Upload stacks on disk (issue 46, ``aggregation disk``): a round's ``[K, ...]`` uploads in unnamed files, mapped,
their pages handed back as the server reads them. The server pieces read them unchanged, so a run's records are the
in-memory stack's, bit for bit; what stays resident is about one column block, not the stack."""

import json
import os
from pathlib import Path

import pytest
import torch

import fedskew.engine.round_server as rs
from fedskew.config import make_config
from fedskew.protocol import TIMING_KEYS, ServerContext, Upload
from fedskew.runner import run_experiment
from fedskew.schema import ConfigError
from fedskew.server.dispersion import column_stats
from fedskew.server.paging import _LIVE, DiskBuffers, is_on_disk, release_pages
from fedskew.server.uploads import UploadStack


def _status_kib(field):
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/self/status has no {field}")


def test_disk_buffers_are_unnamed_files_whose_data_outlive_released_pages(tmp_path):
    buffers = DiskBuffers(tmp_path / "scratch")
    t = buffers.empty("w", (5, 3, 4), torch.float32, "cpu")
    mask = buffers.empty("extra:m", (5, 7), torch.bool, "cpu")
    t.copy_(torch.arange(60, dtype=torch.float32).reshape(5, 3, 4))
    mask.copy_(torch.arange(35).reshape(5, 7) % 3 == 0)
    release_pages()  # the pages go back to the kernel; the data stays in the files
    assert torch.equal(t, torch.arange(60, dtype=torch.float32).reshape(5, 3, 4))
    assert torch.equal(mask, torch.arange(35).reshape(5, 7) % 3 == 0)
    assert is_on_disk(t[2]) and is_on_disk(mask) and not is_on_disk(torch.zeros(3))
    assert list((tmp_path / "scratch").iterdir()) == []  # nothing named: a crash leaves nothing behind
    live = len(_LIVE)
    del t, mask
    assert len(_LIVE) == live - 2  # a mapping lives as long as a tensor over it
    empty = buffers.empty("e", (0, 4), torch.float32, "cpu")
    assert empty.shape == (0, 4) and not is_on_disk(empty)
    with pytest.raises(ValueError, match="lives on the CPU, not on meta"):
        buffers.empty("w", (2, 2), torch.float32, "meta")


def test_the_stack_stays_out_of_resident_memory_and_reads_like_the_in_memory_one(tmp_path):
    k, m = 32, 1 << 20  # 128 MiB of float32 uploads
    template = {"w": torch.zeros(m)}
    on_disk, in_ram = UploadStack(k, template, DiskBuffers(tmp_path).empty), UploadStack(k, template)
    g = torch.Generator().manual_seed(0)
    row = torch.empty(m)
    rss_file = _status_kib("RssFile")
    for cid in range(k):
        row.normal_(generator=g).mul_(cid + 1)
        upload = Upload(cid, {"w": row}, 10 + cid)
        assert on_disk.add(upload) is None and in_ram.add(upload) is None
        assert _status_kib("RssFile") - rss_file < 16 * 1024  # the rows written go back: not 4 MiB per client
    x_disk, x_ram = on_disk.params["w"], in_ram.params["w"]
    assert is_on_disk(x_disk) and torch.equal(x_disk, x_ram)
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the present
    before = _status_kib("VmRSS")
    stats = column_stats(x_disk)
    peak = _status_kib("VmHWM") - before
    expected = column_stats(x_ram)
    for name in ("mean", "var", "constant", "skew"):
        assert torch.equal(getattr(stats, name), getattr(expected, name))
    # one K × block float64 pair (2 × 32 MiB) and the [M] results, not the 128 MiB stack
    assert peak < 112 * 1024, f"peak {peak} KiB over the pass"
    assert _status_kib("RssFile") - rss_file < 16 * 1024


def _records(run_dir):
    rows = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS and k != "time"} for r in rows]


@pytest.mark.parametrize(
    ("method", "args"),
    [("fedsa", {}), ("fedavg+heal", {}), ("fedcac", {}), ("fedavg+disco", {}), ("fedamp", {})],
)
def test_a_disk_run_gives_the_in_memory_runs_records_exactly(tmp_path, monkeypatch, method, args):
    made = []
    empty = DiskBuffers.empty
    monkeypatch.setattr(DiskBuffers, "empty", lambda self, key, *a: made.append(key) or empty(self, key, *a))
    base = {"method": method, "method_args": args, "clients": 5, "rounds": 3, "db": None, "seed": 4}
    for mode in ("stacked", "disk"):
        run_experiment(make_config(None, {**base, "aggregation": mode, "out": str(tmp_path / mode)}))
        assert bool(made) == (mode == "disk")
    assert _records(tmp_path / "disk") == _records(tmp_path / "stacked")
    names = [sorted(p.name for p in (tmp_path / mode).iterdir()) for mode in ("disk", "stacked")]
    assert names[0] == names[1]  # nothing left behind in the run directory


def test_auto_stacks_on_disk_above_the_memory_budget_and_disk_is_refused_for_streaming_needs():
    ctx = ServerContext(4, 10, {"w": torch.zeros(1000)}, frozenset({"w"}), torch.full((4,), 10).numpy())

    def decide(method="fedsa", **over):
        cfg = make_config(None, {"method": method, "clients": 4, "skew_probes": 0, **over})
        return rs.stacks_on_disk(cfg.round_settings(), ctx)

    assert not decide()  # 4 × 4 KB against a quarter of the RAM
    assert decide(state_memory="8KB")  # 16 KB of uploads above an 8 KB budget
    assert not decide(state_memory="1MB")
    assert decide(aggregation="disk") and not decide(aggregation="stacked", state_memory="8KB")
    cfg = make_config(None, {"method": "fedsa", "aggregation": "disk"})
    assert cfg.aggregation == "disk"
    with pytest.raises(ConfigError, match="aggregation"):
        make_config(None, {"aggregation": "tape"})


def test_a_stack_file_that_cannot_be_made_names_the_directory(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(OSError, match="not-a-dir"):
        DiskBuffers(blocker).empty("w", (4, 4), torch.float32, "cpu")
    assert os.path.isfile(blocker)


def test_a_pieces_own_per_client_result_goes_where_the_uploads_are(tmp_path):
    from fedskew.catalog.heal import HealMasks

    template = {"w": torch.zeros(6, 5), "b": torch.zeros(5)}
    g = torch.Generator().manual_seed(1)
    state = {}
    for rnd in (1, 2):  # FedHEAL's masks: all kept at a first participation, then by sign consistency
        stacks = {"disk": UploadStack(3, template, DiskBuffers(tmp_path).empty), "ram": UploadStack(3, template)}
        for cid in range(3):
            upload = Upload(cid, {"w": torch.randn(6, 5, generator=g), "b": torch.randn(5, generator=g)}, 10)
            assert all(stack.add(upload) is None for stack in stacks.values())
        out = {}
        for name, stack in stacks.items():
            out[name] = HealMasks()(stack.round_input(rnd=rnd, trainable=frozenset(template)), state)
        (disk_masks, _), (ram_masks, state) = out["disk"], out["ram"]
        assert all(is_on_disk(m) for m in disk_masks.values()) and not any(is_on_disk(m) for m in ram_masks.values())
        assert all(torch.equal(disk_masks[n], ram_masks[n]) for n in template)
    assert not all(bool(m.all()) for m in ram_masks.values())  # the second round masked something


def test_mixing_matches_the_dense_formula_and_copies_when_nobody_mixes(tmp_path):
    from fedskew.catalog.fedcac import customized_mixing
    from fedskew.server.personal import mix

    g = torch.Generator().manual_seed(3)
    k = 7
    x = torch.randn(k, 3, 50, generator=g)
    collab = torch.zeros(k, k, dtype=torch.bool)
    collab[0, 2] = collab[2, 0] = collab[4, 2] = True
    a = customized_mixing(collab)
    dense = (a @ x.reshape(k, -1).double()).to(torch.float32).reshape(x.shape)
    assert torch.equal(mix(a, x), dense)  # the same product as the plain formula, bit for bit
    for i in (1, 3, 5, 6):
        assert torch.equal(mix(a, x)[i], x[i])
    keep = torch.rand(x.shape, generator=g) < 0.5
    wbar = torch.randn(3, 50, generator=g)
    out = DiskBuffers(tmp_path).empty("cac:w", tuple(x.shape), torch.float32, "cpu")
    got = mix(a, x, out=out, keep=keep, otherwise=wbar)
    assert got.data_ptr() == out.data_ptr() and is_on_disk(got)
    assert torch.equal(got, torch.where(keep, dense, wbar.expand_as(x)))
    alone = customized_mixing(torch.zeros(k, k, dtype=torch.bool))  # nobody mixes: each keeps its own, exactly
    assert torch.equal(mix(alone, x), x)
    assert torch.equal(mix(alone, x, keep=keep, otherwise=wbar), torch.where(keep, x, wbar.expand_as(x)))


def test_overlaps_counted_in_float32_blocks_are_exact():
    from fedskew.catalog.fedcac import overlap_matrix

    g = torch.Generator().manual_seed(5)
    masks = [torch.rand(9, 40, 30, generator=g) < p for p in (0.3, 0.7)]
    flat = torch.cat([m.reshape(9, -1) for m in masks], 1).double()
    gram = flat @ flat.T
    count = gram.diagonal()
    expected = 1 - (count[:, None] + count[None, :] - 2 * gram) / (2 * count[:, None])
    assert torch.equal(overlap_matrix(masks), expected)


def test_personalized_models_are_kept_without_the_rounds_stack_or_all_at_once(tmp_path):
    from fedskew.engine.state_store import ClientStateStore, keep_model

    stack = torch.arange(24, dtype=torch.float32).reshape(3, 8)
    ram: dict = {}
    own = torch.ones(8)
    keep_model(ram, 0, {"w": stack[1], "b": own})
    assert ram[0]["b"] is own  # a tensor of its own is kept as it is
    assert torch.equal(ram[0]["w"], stack[1]) and ram[0]["w"].untyped_storage().nbytes() == 32  # a row: copied
    personal = ClientStateStore("disk", 3, tmp_path / "s").maps["personal"]
    for cid in range(3):
        keep_model(personal, cid, {"w": stack[cid]})
        assert personal.cached() == 0  # written through, not held until the round's end
    stack.zero_()
    assert torch.equal(personal[2]["w"], torch.arange(16, 24, dtype=torch.float32))
