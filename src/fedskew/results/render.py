"""A report rendered as markdown, CSV or LaTeX (:class:`fedskew.results.report.Report`)."""

from __future__ import annotations

import csv
import io
import textwrap
from typing import TYPE_CHECKING, Any

from fedskew.results.experiments import mean_std_text
from fedskew.results.paired import Paired, delta_text

if TYPE_CHECKING:
    from fedskew.results.report import Report


def _text(cell: Any, latex: bool = False, seeds: int | None = None) -> str:
    if isinstance(cell, Paired):
        return delta_text(cell, latex, seeds)
    if isinstance(cell, tuple):
        s = mean_std_text(cell[0], cell[1], latex)
        return s + (f" (N={cell[2]})" if len(cell) > 2 else "")
    return str(cell)


def _footer_text(cell: Any, kind: str) -> str:
    if cell is None:
        return "-"
    if kind == "delta" and isinstance(cell, tuple):
        mdd, sd, n = cell
        return f"{mdd:.2f} (n={n}, sd {sd:.2f})"
    if kind == "seeds":
        return str(cell)
    return str(cell)


WIDTH = 100  # the prose around a table (settings, notes) is wrapped to this many columns; a table row is one line


def _wrapped(text: str, indent: str = "") -> str:
    """``text`` as a markdown paragraph of lines of at most :data:`WIDTH` columns (a word longer stays whole)."""
    return textwrap.fill(
        text, WIDTH, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
    )


def markdown_text(rep: Report) -> str:
    lines = [_wrapped(f"settings common to every row: {'; '.join(rep.common) or '-'}")]
    lines += [_wrapped(f"evaluation protocol: {line}") for line in rep.evaluation] + [""]
    lines.append("| " + " | ".join(rep.columns) + " |")
    lines.append("|" + "---|" * len(rep.columns))
    for i, row in enumerate(rep.rows):
        seeds = rep.seeds[i] if i < len(rep.seeds) else None
        lines.append("| " + " | ".join(_text(c, seeds=seeds).replace("|", "\\|") for c in row) + " |")
    if rep.footer is not None:
        cells = [
            str(c) if j == 0 else _footer_text(c, rep.kind(j)) if rep.kind(j) in ("delta", "seeds") else ""
            for j, c in enumerate(rep.footer)
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [""] + [_wrapped(f"{i}. {n}", " " * len(f"{i}. ")) for i, n in enumerate(rep.notes, 1)]
    return "\n".join(lines)


_DELTA_FIELDS = (
    "delta",
    "delta lo",
    "delta hi",
    "delta method",
    "delta n",
    "delta sd",
    "delta detectable",
    "delta significant",
)


def csv_columns(rep: Report) -> list[str]:
    out = []
    for j, c in enumerate(rep.columns):
        kind = rep.kind(j)
        if kind == "stat":
            out += [f"{c} mean", f"{c} std"] + ([f"{c} n"] if c.endswith("last-N") else [])
        elif kind == "delta":
            base = c.removesuffix(" Δ")
            out += [f"{base} {f}" for f in _DELTA_FIELDS]
        elif c == "paired vs":
            out.append("reference")
        else:
            out.append(c.replace("Δ", "delta"))
    return out


def _csv_delta(cell: Paired) -> list[Any]:
    def f(v: float | None) -> str:
        return "" if v is None else f"{v:.4f}"

    if cell.role == "reference":
        return ["", "", "", "reference", "", "", "", ""]
    c = cell.cmp
    if c is None:
        return ["", "", "", "", "", "", "", ""]
    sig = "" if c.lo is None else str(c.significant).lower()
    return [f(c.mean), f(c.lo), f(c.hi), c.method, c.n, f(c.sd), f(c.detectable()), sig]


def csv_text(rep: Report) -> str:
    """Plain CSV, one value per cell (std empty for a single seed); the paired difference in columns delta, lo,
    hi, method, n, sd, detectable, significant; the common settings, notes and detectable-difference line are not
    in it."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(csv_columns(rep))
    for row in rep.rows:
        cells: list[Any] = []
        for j, (col, c) in enumerate(zip(rep.columns, row, strict=True)):
            kind = rep.kind(j)
            if isinstance(c, Paired):
                cells += _csv_delta(c)
            elif isinstance(c, tuple):
                cells += [f"{c[0]:.4f}", "" if c[1] is None else f"{c[1]:.4f}", *c[2:]]
            elif kind == "stat":
                cells += ["", ""] + ([""] if col.endswith("last-N") else [])
            else:
                cells.append(c)
        w.writerow(cells)
    return buf.getvalue().rstrip("\n")


_LATEX_ESCAPES = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "Δ": r"$\Delta$",
    "α": r"$\alpha$",
}


def _tex(s: str) -> str:
    return "".join(_LATEX_ESCAPES.get(ch, ch) for ch in s).replace("±", "$\\pm$")


def latex_text(rep: Report) -> str:
    """A booktabs tabular (a significant paired difference in bold); the common settings and the notes as LaTeX
    comments above it, the detectable differences as a last line below a rule."""
    lines = [f"% settings common to every row: {'; '.join(rep.common) or '-'}"]
    lines += [f"% evaluation protocol: {line}" for line in rep.evaluation]
    lines += [f"% {n}" for n in rep.notes]
    align = {"stat": "r", "seeds": "r"}
    lines.append("\\begin{tabular}{" + "".join(align.get(rep.kind(j), "l") for j in range(len(rep.columns))) + "}")
    lines.append("\\toprule")
    lines.append(" & ".join(_tex(c) for c in rep.columns) + " \\\\")
    lines.append("\\midrule")
    for i, row in enumerate(rep.rows):
        seeds = rep.seeds[i] if i < len(rep.seeds) else None
        lines.append(
            " & ".join(
                _text(c, latex=True, seeds=seeds) if isinstance(c, tuple | Paired) else _tex(str(c)) for c in row
            )
            + " \\\\"
        )
    if rep.footer is not None:
        lines.append("\\midrule")
        cells = [
            _tex(str(c)) if j == 0 else _footer_text(c, rep.kind(j)) if rep.kind(j) in ("delta", "seeds") else ""
            for j, c in enumerate(rep.footer)
        ]
        lines.append(" & ".join(cells) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}"]
    return "\n".join(lines)
