"""CINIC-10: image folders ``train/`` and ``test/`` with ten class sub-folders (``valid/`` unused), cached on disk."""

from __future__ import annotations

from pathlib import Path

from fedskew.data.readers.base import DataError, ImageDataset
from fedskew.data.readers.images import class_dirs, disk_cached, read_class_folders
from fedskew.data.readers.registry import DatasetSpec, register_reader


def load_cinic10(d: Path) -> ImageDataset:
    """CINIC-10: ``train/`` (90k) as the training split and ``test/`` (90k); ``valid/`` is not used."""

    def build() -> ImageDataset:
        classes = class_dirs(d / "train")
        if len(classes) != 10:
            raise DataError(f"{d / 'train'}: expected 10 class folders, found {len(classes)}")
        xtr, ytr = read_class_folders(d / "train", classes, None)
        xte, yte = read_class_folders(d / "test", classes, None)
        return ImageDataset("cinic10", xtr, ytr, xte, yte, 10, tuple(classes))

    return disk_cached("cinic10", d, (), build)


register_reader(
    DatasetSpec(
        "cinic10",
        load_cinic10,
        summary="CINIC-10 image folders train/ and test/",
        subdirs=("cinic10", "cinic-10", "CINIC-10", "CINIC10"),
        probe=lambda d: (d / "train").is_dir() and (d / "test").is_dir() and not (d / "wnids.txt").is_file(),
        expected="train/ and test/ folders with one subfolder per class",
        aliases=("cinic-10",),
    ),
    origin="fedskew",
)
