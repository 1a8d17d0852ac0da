"""Where a run's results go: CSV of its curves, a JSON summary, PNG plots when matplotlib is there.

matplotlib is an optional extra (`pip install 'pipeswarm[plots]'`); without it a run writes its CSV
and JSON and says in one line that the plots were skipped.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

Row = Mapping[str, Any]
PLOT_SIZE = (5.0, 3.2)  # inches at 100 dpi: small PNGs that sit in docs/results/
PLOT_DPI = 100


def write_csv(path: Path, rows: Sequence[Row]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_json(path: Path, data: Mapping[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)

    def plain(value: Any) -> Any:  # NaN/inf are not JSON: null
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, Mapping):
            return {str(k): plain(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        return value

    path.write_text(json.dumps(plain(data), indent=2, sort_keys=True) + "\n")
    return path


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_lines(
    path: Path,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    xlabel: str,
    ylabel: str,
    title: str,
    log_x: bool = False,
    log_y: bool = False,
) -> Path:
    """One PNG with a line per series name -> (xs, ys). Call only when have_matplotlib()."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server
    from matplotlib import pyplot as plt

    figure, axes = plt.subplots(figsize=PLOT_SIZE, dpi=PLOT_DPI)
    for name, (xs, ys) in series.items():
        axes.plot(xs, ys, label=name, linewidth=1.2)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.set_title(title, fontsize=9)
    if log_x:
        axes.set_xscale("log", base=2)
    if log_y:
        axes.set_yscale("log")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=6)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path)
    plt.close(figure)
    return path


def series_of(rows: Sequence[Row], group: str, x: str, y: str) -> dict[str, tuple[list[float], list[float]]]:
    """{group value: (xs, ys)} from rows that have a value for y."""
    out: dict[str, tuple[list[float], list[float]]] = {}
    for row in rows:
        if row.get(y) is None:
            continue
        xs, ys = out.setdefault(str(row[group]), ([], []))
        xs.append(float(row[x]))
        ys.append(float(row[y]))
    return out


@contextmanager
def progress_bar(total: int, enabled: bool) -> Iterator[Callable[[str], None]]:
    """A rich progress bar over `total` units; yields advance(description)."""
    if not enabled:
        yield lambda description: None
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task("simulating", total=total)
        yield lambda description: progress.update(task, advance=1, description=description)
