"""`fedskew partition`: the label table and the bubble plot."""

import numpy as np

from fedskew.cli import main
from fedskew.config import make_config
from fedskew.data.federated import build_federated
from fedskew.results.partition_view import bubble_plot, label_table


def _rows(text):
    return [ln.strip("|").split("|") for ln in text.splitlines() if ln.startswith("| ") and "client" not in ln]


def test_table_matches_histograms():
    train = np.array([[3, 0, 1], [0, 5, 0]])
    test = np.array([[1, 0, 0], [0, 2, 0]])
    rows = _rows(label_table(train, test))
    assert [int(x) for x in rows[0]] == [0, 4, 1, 3, 0, 1]
    assert [int(x) for x in rows[1]] == [1, 5, 2, 0, 5, 0]
    assert rows[2][0].strip() == "total" and [int(x) for x in rows[2][1:]] == [9, 3, 3, 5, 1]
    assert "training classes per client mean 1.50" in label_table(train, test)
    # protocol niid-bench deals every client a share of the whole test split: the count stays the training one
    assert "training classes per client mean 1.50" in label_table(train, np.ones_like(test))


def test_cli_partition_prints_the_federation_and_plots(tmp_path, capsys):
    png = tmp_path / "p.png"
    assert main(["partition", "--clients", "4", "--seed", "2", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    data = build_federated(make_config(None, {"clients": 4, "seed": 2, "db": None}))
    rows = _rows(out)
    for cid in range(4):
        assert [int(x) for x in rows[cid][3:]] == data.train_hists[cid].tolist()
    assert png.stat().st_size > 5_000
    assert main(["partition", "--alpha", "-1"]) == 2


def test_bubble_plot_writes_png(tmp_path):
    out = bubble_plot(np.array([[10, 0], [3, 7]]), tmp_path / "sub" / "b.png", "t")
    assert out.is_file() and out.stat().st_size > 5_000


def test_a_plot_file_that_is_no_figure_is_refused_before_the_partition_is_built(tmp_path, capsys):
    assert main(["partition", "--clients", "4", "--plot", str(tmp_path / "p.txt")]) == 2
    assert "a figure file ends in one of .png" in capsys.readouterr().err and not (tmp_path / "p.txt").exists()
