"""The Digits domain-skew suite (FedHEAL): MNIST, USPS, SVHN and a synthetic colour-digit domain, all RGB at one
size; plus the bilinear resize it uses."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fedskew.data.readers.base import DataError, DatasetNotFoundError, ImageDataset, PathLike
from fedskew.data.readers.registry import data_roots, load_dataset, on_clear


def interp_matrix(n_in: int, n_out: int) -> np.ndarray:
    """[n_out, n_in] bilinear weights, pixel-centre aligned; a widened triangle filter when shrinking
    (antialiased bilinear, as PIL and ``torch.nn.functional.interpolate(antialias=True)`` do)."""
    scale = n_in / n_out
    support = max(scale, 1.0)
    centres = (np.arange(n_out) + 0.5) * scale - 0.5
    w = np.maximum(0.0, 1.0 - np.abs(np.arange(n_in)[None, :] - centres[:, None]) / support)
    return (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def resize_bilinear(x: np.ndarray, size: int, chunk: int = 8192) -> np.ndarray:
    """Bilinear resize of uint8 ``[N, C, H, W]`` to ``size`` x ``size`` (antialiased when shrinking)."""
    if x.shape[2:] == (size, size):
        return x
    ah, aw = interp_matrix(x.shape[2], size), interp_matrix(x.shape[3], size).T
    out = np.empty((len(x), x.shape[1], size, size), dtype=np.uint8)
    for s in range(0, len(x), chunk):
        r = ah @ x[s : s + chunk].astype(np.float32) @ aw
        out[s : s + chunk] = np.clip(np.rint(r), 0, 255).astype(np.uint8)
    return out


def to_rgb(x: np.ndarray) -> np.ndarray:
    return np.repeat(x, 3, axis=1) if x.shape[1] == 1 else x


def synth_digits(x: np.ndarray, rng: np.random.Generator, size: int = 28, chunk: int = 8192) -> np.ndarray:
    """Synthetic colour-digit domain from grayscale digits ``x`` ``[N, 1, H, W]`` -> ``[N, 3, size, size]``.

    Per image, all randomness from ``rng`` (deterministic for a seeded generator):
    1. geometry: random affine warp of the digit stroke -- rotation U(-20, 20) degrees, scale U(0.8, 1.1),
       shift U(-0.1, 0.1) of the half-width per axis (bilinear, zero fill), output at ``size`` x ``size``;
    2. colours: background luminance L_b ~ U(0, 255); stroke luminance L_f = L_b +/- U(96, 160) (towards the
       side with room, clipped), each turned into an RGB colour by adding U(-64, 64) per channel;
    3. texture: background + a smooth colour noise field (4x4 Gaussian noise, std 40, bilinearly upsampled);
    4. composite: bg * (1 - m) + fg * m with m the warped stroke in [0, 1], plus pixel noise N(0, 6^2) taken
       from a bank of 64 noise images drawn once per call.
    The result stands in for SYN digits (rendered-font digits on textured backgrounds) when no copy is around.
    """
    import torch
    import torch.nn.functional as F

    n = len(x)
    out = np.empty((n, 3, size, size), dtype=np.uint8)
    # every per-image draw is made up front, so the result does not depend on ``chunk``
    ang = np.deg2rad(rng.uniform(-20.0, 20.0, n))
    scale = rng.uniform(0.8, 1.1, n)
    shift = rng.uniform(-0.1, 0.1, (n, 2))
    lb = rng.uniform(0.0, 255.0, n)
    gap = rng.uniform(96.0, 160.0, n)
    lf = np.where(lb < 128, np.minimum(lb + gap, 255.0), np.maximum(lb - gap, 0.0))
    cb = np.clip(lb[:, None] + rng.uniform(-64, 64, (n, 3)), 0, 255).astype(np.float32)
    cf = np.clip(lf[:, None] + rng.uniform(-64, 64, (n, 3)), 0, 255).astype(np.float32)
    low = rng.standard_normal((n, 3, 4, 4), dtype=np.float32) * 40.0
    pick = rng.integers(64, size=n)
    bank = rng.standard_normal((64, 3, size, size), dtype=np.float32) * 6.0
    up = interp_matrix(4, size)
    kron = np.kron(up, up)  # [size*size, 16]: separable bilinear upsampling of the 4x4 noise
    # output pixel centres in [-1, 1] (align_corners=False convention of grid_sample)
    c = ((np.arange(size, dtype=np.float32) + 0.5) / size * 2.0 - 1.0).astype(np.float32)
    gx, gy = c[None, None, :], c[None, :, None]
    cos = (np.cos(ang) / scale).astype(np.float32)[:, None, None]
    sin = (np.sin(ang) / scale).astype(np.float32)[:, None, None]
    sh = shift.astype(np.float32)[:, :, None, None]
    for s in range(0, n, chunk):
        e = min(s + chunk, n)
        xb = np.ascontiguousarray(x[s:e], dtype=np.float32) / 255.0
        if xb.shape[1] != 1:
            xb = xb.mean(axis=1, keepdims=True)
        grid = np.stack(
            [cos[s:e] * gx - sin[s:e] * gy + sh[s:e, 0], sin[s:e] * gx + cos[s:e] * gy + sh[s:e, 1]], axis=-1
        )
        m = F.grid_sample(
            torch.from_numpy(xb),
            torch.from_numpy(grid),
            mode="bilinear",
            padding_mode="zeros",
            align_corners=False,
        ).numpy()
        img = (low[s:e].reshape(-1, 16) @ kron.T).reshape(e - s, 3, size, size)  # smooth background texture
        img += cb[s:e, :, None, None]
        img += (cf[s:e, :, None, None] - img) * m
        img += bank[pick[s:e]]
        np.rint(img, out=img)
        out[s:e] = np.clip(img, 0, 255).astype(np.uint8)
    return out


_DOMAIN_CACHE: dict[tuple[object, ...], dict[str, ImageDataset]] = {}
_LOCK = threading.RLock()
on_clear(_DOMAIN_CACHE.clear)


def _as_domain(ds: ImageDataset, name: str, size: int) -> ImageDataset:
    assert ds.x_test is not None and ds.y_test is not None
    return ImageDataset(
        name,
        to_rgb(resize_bilinear(ds.x_train, size)),
        ds.y_train,
        to_rgb(resize_bilinear(ds.x_test, size)),
        ds.y_test,
        10,
    )


def digits_domains(
    data_dir: PathLike | None = None, size: int = 28, *, seed: int = 0, download: bool = False
) -> dict[str, ImageDataset]:
    """The Digits domain-skew suite (FedHEAL): domains ``mnist``, ``usps``, ``svhn``, ``synth`` in that order.

    Every domain is RGB uint8 ``[N, 3, size, size]`` (grayscale MNIST/USPS replicated to 3 channels, as
    FedHEAL does; SVHN keeps its colour; bilinear resizing) with its own official train/test split. ``synth``
    is :func:`synth_digits` applied to MNIST train and test, with generators seeded ``[seed, 0x5EED, 0]`` and
    ``[seed, 0x5EED, 1]``. Domains whose files are missing are skipped (``synth`` needs MNIST); fewer than 2
    domains is a :class:`DataError`.
    """
    if size < 1:
        raise DataError(f"size must be >= 1, got {size}")
    key = (tuple(str(r.resolve()) for r in data_roots(data_dir)), int(size), int(seed))
    with _LOCK:
        if key in _DOMAIN_CACHE:
            return dict(_DOMAIN_CACHE[key])
    out: dict[str, ImageDataset] = {}
    missing: dict[str, str] = {}
    base: dict[str, ImageDataset] = {}
    for name in ("mnist", "usps", "svhn"):
        try:
            base[name] = load_dataset(name, data_dir, download=download)
        except DatasetNotFoundError as exc:
            missing[name] = str(exc)
    for name, ds in base.items():
        out[name] = _as_domain(ds, name, size)
    if "mnist" in base:
        mn = base["mnist"]
        assert mn.x_test is not None and mn.y_test is not None
        r_train, r_test = (np.random.default_rng([int(seed), 0x5EED, split]) for split in (0, 1))
        out["synth"] = ImageDataset(
            "synth",
            synth_digits(mn.x_train, r_train, size),
            mn.y_train.copy(),
            synth_digits(mn.x_test, r_test, size),
            mn.y_test.copy(),
            10,
        )
    if len(out) < 2:
        raise DataError(
            f"the Digits domain suite needs at least 2 domains, found {sorted(out)}; missing: "
            + " | ".join(f"{k}: {v}" for k, v in missing.items())
        )
    with _LOCK:
        _DOMAIN_CACHE[key] = dict(out)
    return out


@dataclass(frozen=True)
class DomainSuite:
    """A multi-domain dataset for ``partition: domain``: ``load(data_dir, size=, seed=, download=)`` returns the
    domains whose files are present, in the order of ``domains`` (the suite's full list, e.g. FedHEAL's four)."""

    name: str
    domains: tuple[str, ...]
    load: Callable[..., dict[str, ImageDataset]]
    every_class: bool = False  # repair each client to hold every class of its domain (FedHEAL, Office-Caltech)


DOMAIN_SUITES: dict[str, DomainSuite] = {}


def register_domain_suite(suite: DomainSuite) -> None:
    DOMAIN_SUITES[suite.name] = suite


def domain_suite(name: str) -> DomainSuite:
    if name not in DOMAIN_SUITES:
        raise DataError(f"{name!r} is not a domain suite; domain suites: {', '.join(DOMAIN_SUITES)}")
    return DOMAIN_SUITES[name]


register_domain_suite(DomainSuite("digits_domains", ("mnist", "usps", "svhn", "synth"), digits_domains))
