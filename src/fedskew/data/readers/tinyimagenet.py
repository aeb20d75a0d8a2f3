"""Tiny-ImageNet-200: ``train/<wnid>/images/`` and ``val/`` (used as the test split), 64x64 RGB, cached on disk."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fedskew.data.readers.base import DataError, ImageDataset
from fedskew.data.readers.download import Remote
from fedskew.data.readers.images import disk_cached, images_in, read_images
from fedskew.data.readers.registry import DatasetSpec, register_reader


def load_tinyimagenet(d: Path) -> ImageDataset:
    """Tiny-ImageNet-200: 100k train / 10k val (used as the test split) 64x64 RGB; classes = sorted wnids."""

    def build() -> ImageDataset:
        wn = d / "wnids.txt"
        try:
            wnids = sorted({w.strip() for w in wn.read_text().splitlines() if w.strip()})
        except OSError as exc:
            raise DataError(f"{wn}: cannot read ({exc})") from exc
        if not wnids:
            raise DataError(f"{wn}: no class ids")
        paths, labels = [], []
        for i, w in enumerate(wnids):
            files = images_in(d / "train" / w)
            if not files:
                raise DataError(f"{d / 'train' / w}: no training images for class {w}")
            paths += files
            labels += [i] * len(files)
        xtr, ytr = read_images(paths, None), np.asarray(labels, dtype=np.int64)
        ann = d / "val" / "val_annotations.txt"
        index = {w: i for i, w in enumerate(wnids)}
        try:
            lines = [ln.split("\t") for ln in ann.read_text().splitlines() if ln.strip()]
        except OSError as exc:
            raise DataError(f"{ann}: cannot read ({exc})") from exc
        vpaths, vlabels = [], []
        for n, parts in enumerate(lines, 1):
            if len(parts) < 2 or parts[1] not in index:
                raise DataError(f"{ann}, line {n}: expected '<file>\\t<wnid>...' with a known wnid")
            vpaths.append(d / "val" / "images" / parts[0])
            vlabels.append(index[parts[1]])
        missing = [p for p in vpaths if not p.is_file()]
        if missing:
            raise DataError(f"{missing[0]}: listed in {ann} but missing ({len(missing)} missing)")
        xte = read_images(vpaths, None)
        return ImageDataset(
            "tinyimagenet", xtr, ytr, xte, np.asarray(vlabels, dtype=np.int64), len(wnids), tuple(wnids)
        )

    return disk_cached("tinyimagenet", d, (), build)


register_reader(
    DatasetSpec(
        "tinyimagenet",
        load_tinyimagenet,
        summary="Tiny-ImageNet-200 folder layout (val/ as the test split)",
        subdirs=(
            "tiny-imagenet-200",
            "tinyimagenet",
            "tinyimagenet/tiny-imagenet-200",
            "tiny_imagenet",
            "tiny-imagenet",
        ),
        probe=lambda d: (d / "wnids.txt").is_file(),
        expected="tiny-imagenet-200/ with wnids.txt, train/<wnid>/images/, val/val_annotations.txt",
        remote=(
            Remote(
                "tiny-imagenet-200.zip",
                ("http://cs231n.stanford.edu/tiny-imagenet-200.zip",),
                "90528d7ca1a48142e341f4ef8d21d0de",
                archive=True,
            ),
        ),
        aliases=("tiny-imagenet", "tiny_imagenet"),
    ),
    origin="fedskew",
)
