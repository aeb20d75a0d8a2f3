"""Paired comparisons of a report's rows (:mod:`fedskew.results.stats` over the seeds two rows share): which row is
each row's reference, the per-cell differences with their intervals, and the notes that explain them."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedskew.results import stats as st
from fedskew.results.experiments import Experiment, Stat, identity_key, show_value

FOOTER_LABEL = f"detectable Δ (paired t, α={st.ALPHA:g}, power {st.POWER:g})"


# ---- paired comparisons --------------------------------------------------------------------------------------
class ReportError(ValueError):
    """A report that cannot be made as asked (``--against`` naming no row)."""


@dataclass(frozen=True)
class Paired:
    """A row's cell of paired difference: ``role`` "reference" (the row is its setting's reference), "compared"
    (``cmp`` holds the comparison, possibly "unpaired") or "none" (no reference row in its setting, or the metric
    missing from the row or its reference)."""

    role: str
    cmp: st.Comparison | None = None


def _setting_of(ident: dict[str, Any]) -> str:
    from fedskew.config import SETTING_KEYS

    return identity_key({k: ident.get(k) for k in SETTING_KEYS})


def _default_args(method: str) -> dict[str, Any] | None:
    from fedskew.methods import resolve_method

    try:
        return dict(resolve_method(method, {}).args)
    except Exception:  # noqa: BLE001 - not a method of this version: no default arguments known
        return None


def _canonical(method: str) -> str | None:
    from fedskew.methods import resolve_method

    try:
        return resolve_method(method, {}).name
    except Exception:  # noqa: BLE001 - not a method of this version
        return None


def _distance(a: dict[str, Any], b: dict[str, Any]) -> int:
    """How many settings two experiments differ in, method arguments they share included, the method excluded."""
    keys = (set(a) | set(b)) - {"method", "method_args"}
    n = sum(identity_key({"v": a.get(k)}) != identity_key({"v": b.get(k)}) for k in keys)
    aa, ba = a.get("method_args") or {}, b.get("method_args") or {}
    return n + sum(show_value(aa[k]) != show_value(ba[k]) for k in set(aa) & set(ba))


def _is_default(ident: dict[str, Any], method: str) -> bool:
    return ident.get("method") == method and dict(ident.get("method_args") or {}) == _default_args(method)


def _against_rows(against: str, exps: Sequence[Experiment], labels: Sequence[str]) -> list[bool]:
    """The rows ``against`` names: by their label as shown, else by method (as typed or its canonical name), those
    with the method's default arguments first."""
    text = against.strip()
    by_label = [text == lab for lab in labels]
    if any(by_label):
        return by_label
    name = _canonical(text) or text
    same = [e.identity.get("method") == name or e.name == text for e in exps]
    default = [hit and _is_default(e.identity, name) for hit, e in zip(same, exps, strict=True)]
    return default if any(default) else same


def choose_references(
    exps: Sequence[Experiment], labels: Sequence[str], against: str | None = None
) -> list[int | None]:
    """Per experiment, the index of its reference experiment among ``exps`` (its own index when it is a reference,
    None when its setting has none). Candidates come from the same setting (:data:`fedskew.config.SETTING_KEYS`):
    the rows ``against`` names (a label in ``labels`` or a method); by default FedAvg with its default arguments, or,
    for a ``host+plugin`` composition, the host (falling back to FedAvg). Of several candidates, the one differing
    from the row in the fewest other settings (then the first). Raises :class:`ReportError` when ``against`` names
    no row."""
    blocks: dict[str, list[int]] = defaultdict(list)
    for i, e in enumerate(exps):
        blocks[_setting_of(e.identity)].append(i)
    hit: list[bool] = []
    if against:
        hit = _against_rows(against, exps, labels)
        if not any(hit):
            raise ReportError(f"--against {against!r} names no row; rows: {'; '.join(dict.fromkeys(labels))}")
    fedavg = [_is_default(e.identity, "fedavg") for e in exps]
    refs: list[int | None] = []
    for e in exps:
        block = blocks[_setting_of(e.identity)]
        if against:
            cands = [j for j in block if hit[j]]
        else:
            cands = []
            method = str(e.identity.get("method"))
            if "+" in method:
                host = method.rsplit("+", 1)[0]
                cands = [j for j in block if exps[j].identity.get("method") == host]
            cands = cands or [j for j in block if fedavg[j]]
        refs.append(min(cands, key=lambda j: (_distance(exps[j].identity, e.identity), j)) if cands else None)
    return refs


def seed_values(
    exp: Experiment, metric: str, statistic: str, stat: Callable[[dict[str, Any], str], Stat | None]
) -> dict[int, float]:
    """Seed -> the metric's ``statistic`` ("best" or "last") in % for the latest run of each seed of ``exp``; NaN
    for a diverged run (left out of paired comparisons, with a note); seeds without the metric are absent."""
    out: dict[int, float] = {}
    for r in exp.latest:
        s = stat(r, metric)
        if r["summary"].get("diverged"):
            out[int(r["seed"])] = float("nan")
        elif s is not None:
            out[int(r["seed"])] = 100.0 * float(getattr(s, statistic))
    return out


def paired_cells(
    exps: Sequence[Experiment],
    refs: Sequence[int | None],
    metric: str,
    statistic: str,
    stat: Callable[[dict[str, Any], str], Stat | None],
) -> list[Paired]:
    """Each experiment's :class:`Paired` cell of ``metric``'s ``statistic`` against its reference (``refs`` from
    :func:`choose_references`)."""
    values = [seed_values(e, metric, statistic, stat) for e in exps]
    out = []
    for i, j in enumerate(refs):
        if j is None:
            out.append(Paired("none"))
        elif j == i:
            out.append(Paired("reference"))
        elif not values[i] or not values[j]:  # the metric is missing from one of the two rows: nothing to compare
            out.append(Paired("none"))
        else:
            out.append(Paired("compared", st.compare(values[j], values[i])))
    return out


def pooled(cells: Iterable[Paired]) -> tuple[float, int] | None:
    """The pooled paired std (degrees of freedom weighted) of the comparisons with an sd, and their smallest number
    of common seeds: what a column's detectable difference is computed from. None without any."""
    cmps = [c.cmp for c in cells if c.cmp is not None and c.cmp.sd is not None]
    if not cmps:
        return None
    dof = sum(c.n - 1 for c in cmps)
    return float(np.sqrt(sum((c.n - 1) * c.sd**2 for c in cmps) / dof)), min(c.n for c in cmps)  # type: ignore[operator]


def _num(v: float) -> str:
    return f"{v:+.2f}"


def delta_text(cell: Paired, latex: bool = False, seeds: int | None = None) -> str:
    """``+0.52 [+0.10, +0.94]*`` (``*``: the interval excludes 0; in LaTeX bold), ``(reference)``, ``unpaired``,
    ``+0.52 (1 seed, no interval)`` or ``-`` (no reference); `` (n=2)`` after it when the common seeds are fewer
    than the row's ``seeds``."""
    if cell.role == "reference":
        return "(reference)"
    c = cell.cmp
    if cell.role == "none" or c is None:
        return "-"
    if c.method == st.UNPAIRED:
        return "unpaired (no common seed)"
    if c.mean is None:
        return "no finite pair"
    if c.lo is None or c.hi is None:
        return f"{_num(c.mean)} (1 seed, no interval)"
    text = f"{_num(c.mean)} [{_num(c.lo)}, {_num(c.hi)}]"
    if c.significant:
        text = f"\\textbf{{{text}}}" if latex else text + "*"
    return text + (f" (n={c.n})" if seeds is not None and c.n != seeds else "")


def seeds_cell(cell: Paired, d: float) -> Any:
    if cell.role == "reference":
        return "(reference)"
    if cell.cmp is None or cell.cmp.sd is None:
        return "-"
    n = cell.cmp.seeds_for(d)
    return n if n is not None else ">1000"


def paired_notes(
    labels: list[str],
    refs: list[int | None],
    paired: dict[tuple[str, str], list[Paired]],
    against: str | None,
    seeds_needed: float | None,
    footer: bool,
) -> list[str]:
    rule = (
        f"the row {against!r} of the same setting (data and federation)"
        if against
        else "FedAvg with its default arguments in the same setting (data and federation); a host+plug-in row "
        "against its host (fedprox+heal against fedprox), or against FedAvg when the host is not in the table "
        "(fedavg+heal, or a plug-in alone such as fedadam)"
    )
    no_ref = [labels[i] for i, j in enumerate(refs) if j is None]
    if not paired:
        if len(labels) > 1 and not no_ref:
            return [
                "no paired comparison: every row is the reference of its setting (rows of different settings "
                "are not compared)"
            ]
        if no_ref:
            return [f"no paired comparison: no reference row ({rule}); choose one with --against"]
        return []
    cmps = [c.cmp for cells in paired.values() for c in cells if c.cmp is not None]
    kinds = {c.method for c in cmps}
    methods = []
    if st.PAIRED_T in kinds:
        methods.append(f"paired t (fewer than {st.BOOTSTRAP_FROM} common seeds)")
    if st.BOOTSTRAP in kinds:
        methods.append(
            f"percentile bootstrap of the mean ({st.BOOTSTRAP_FROM} or more common seeds; {st.RESAMPLES} resamples, "
            "seed 0)"
        )
    notes = [
        "Δ: paired difference row − reference in points, the mean over the seeds both ran (n, when fewer than the "
        f"row's seeds), with its {st.LEVEL:.0%} interval: {' / '.join(methods) or 'none (single seeds)'}; "
        f"* marks an interval that excludes 0. Reference (paired vs): {rule}",
    ]
    if footer:
        notes.append(
            f"{FOOTER_LABEL} (last line): the smallest true difference a two-sided paired t-test detects with that "
            "power (exact, noncentral t), from the column's pooled paired std and its smallest number of common seeds"
        )
    if seeds_needed is not None:
        notes.append(
            f"seeds for Δ={seeds_needed:g}: the smallest number of seeds whose two-sided paired t-test (α={st.ALPHA:g})"
            f" detects a true difference of {seeds_needed:g} points with power ≥ {st.POWER:g} (exact, noncentral t), "
            "from the row's paired std against its reference (- : fewer than 2 common seeds; >1000: more than 1000)"
        )
    unpaired = list(
        dict.fromkeys(
            labels[i]
            for cells in paired.values()
            for i, c in enumerate(cells)
            if c.cmp is not None and c.cmp.method == st.UNPAIRED
        )
    )
    if unpaired:
        notes.append(f"unpaired, not compared (no seed in common with their reference): {'; '.join(unpaired)}")
    excluded = {
        (labels[i], s) for cells in paired.values() for i, c in enumerate(cells) if c.cmp for s in c.cmp.excluded
    }
    if excluded:
        shown = "; ".join(f"{lab} seed {s}" for lab, s in sorted(excluded, key=lambda x: (labels.index(x[0]), x[1])))
        notes.append(f"left out of paired comparisons (a diverged run, theirs or their reference's): {shown}")
    if no_ref:
        notes.append(f"no reference row in their setting ({rule}; choose one with --against): {'; '.join(no_ref)}")
    return notes
