"""Readers of dataset files, returning uint8 (or, for user arrays, float) image arrays ``[N, C, H, W]`` (text:
int64 token ids ``[N, L]`` with their vocabulary).

One module per format family, each registering its datasets with :func:`register_reader`
(:mod:`fedskew.data.readers.registry` describes the registry and where files are looked for):

========================  ===================================================================================
``digits``                scikit-learn's bundled 8x8 digits (:mod:`.digits`)
``idx``                   MNIST, Fashion-MNIST: official IDX files (:mod:`.idx`)
``usps``                  USPS: LIBSVM text pair or HDF5 (:mod:`.usps`)
``cifar``                 CIFAR-10/100: python pickle batches, restricted unpickler (:mod:`.cifar`)
``svhn``                  SVHN: MATLAB .mat (:mod:`.svhn`)
``tinyimagenet``          Tiny-ImageNet-200 folder layout (:mod:`.tinyimagenet`)
``cinic``                 CINIC-10 image folders (:mod:`.cinic`)
``office``                Office-Caltech-10 domain folders (:mod:`.office`)
``ham10000``              HAM10000: metadata CSV and the two JPEG folders, uniform test split (:mod:`.ham10000`)
``ag_news``               AG News: the official CSV pair as token ids and a training vocabulary (:mod:`.ag_news`)
``folder``                your images, one sub-folder per class, cached (:mod:`.folder`)
``npz``                   your arrays: one .npz, or per-client files incl. PFLlib's format (:mod:`.npz`)
``domains``               the Digits domain suite built from the above (:func:`digits_domains`)
========================  ===================================================================================

No torchvision and no network are needed: every reader parses the files as their distributors publish them.
Downloads happen only when asked for (``download=True``), from the official URLs with MD5 verification, written
atomically. A new format is one module in this package (found and imported automatically) or in an installed
package declaring the ``fedskew.datasets`` entry point.
"""

from __future__ import annotations

from fedskew.data.readers import _formats  # noqa: F401  (imports and so registers every format module)
from fedskew.data.readers.base import (
    ClientDatasets,
    DataError,
    DatasetNotFoundError,
    ImageDataset,
    PathLike,
)
from fedskew.data.readers.domains import digits_domains, resize_bilinear, synth_digits
from fedskew.data.readers.download import Remote, download
from fedskew.data.readers.idx import read_idx
from fedskew.data.readers.office import OFFICE_DOMAINS, OFFICE_POOLED_SIZE, load_domain_folders
from fedskew.data.readers.registry import (
    _SPECS,
    ENTRY_POINT_GROUP,
    DatasetSpec,
    clear_cache,
    data_roots,
    dataset_names,
    find_spec,
    get_spec,
    load_dataset,
    load_source,
    locate,
    register_reader,
    unregister_reader,
)
from fedskew.data.readers.usps import read_libsvm

#: The built-in dataset names (:func:`dataset_names` adds those registered later and by plug-ins).
DATASETS: tuple[str, ...] = tuple(_SPECS)

# names kept from the single-module readers (tests and fedskew.reproduce use them)
_Remote = Remote
_Spec = DatasetSpec
_download = download
_resize = resize_bilinear
_locate = locate
_roots = data_roots


def _canonical(name: str) -> str:
    """The registered name of dataset ``name`` (case-insensitive, aliases accepted); :class:`DataError` if unknown."""
    return get_spec(name).name


__all__ = [
    "DATASETS",
    "ENTRY_POINT_GROUP",
    "OFFICE_DOMAINS",
    "OFFICE_POOLED_SIZE",
    "ClientDatasets",
    "DataError",
    "DatasetNotFoundError",
    "DatasetSpec",
    "ImageDataset",
    "PathLike",
    "clear_cache",
    "dataset_names",
    "digits_domains",
    "find_spec",
    "get_spec",
    "load_dataset",
    "load_domain_folders",
    "load_source",
    "read_idx",
    "read_libsvm",
    "register_reader",
    "synth_digits",
    "unregister_reader",
]
