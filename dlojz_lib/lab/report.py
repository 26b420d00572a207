"""`dlojz_lab.py compare`: the runs of one or more sweeps side by side, from each run's metrics JSON and
--val-history.

- `rows(sweeps)`: one dict per run: the sweep, the run, its state, its swept settings, then the figures of COLUMNS;
- `table(rows)`: the terminal's table; `write_csv(rows, path)`: compare.csv, the same columns, one row per run;
- plots (PNG, matplotlib's Agg backend): `plot_throughput` (img/s and peak memory against each swept flag, one line
  per combination of the other flags), `plot_phases` (each run's step as stacked bars: load, forward, backward, the
  rest), `plot_accuracy` (a validation figure, top-1 or `--metric`'s, against wall-clock time, for runs that
  validated more than once); `best_run(rows, metric)`, the line naming the best run by that figure. Each
  returns its matplotlib Figure (what the tests read back) or None when no run has the figures it draws.
Runs that did not finish (queued, running, failed) are rows with their state and no figures.
`compare(sweeps, out)` writes compare.csv and the plots into `out` by the one output rule (`claimed_files`): each new,
or one an earlier compare wrote (its header, its figures' Software entry), or any file with --force.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from dlojz_lib.checks import claim_outputs_in, is_png_drawn_by, starts_with
from dlojz_lib.settings.flags import VALIDATION_METRICS

# (column, header, where in the metrics JSON: a key of the chronometer's dict, or of the metrics themselves)
COLUMNS = [
    ("img_s", "img/s", ("chrono", "throughput_img_s"), ("images_per_second",)),
    ("step_ms", "step ms", ("chrono", "step_median_s")),
    ("load_ms", "load ms", ("chrono", "load_median_s")),
    ("forward_ms", "fwd ms", ("chrono", "forward_median_s")),
    ("backward_ms", "bwd ms", ("chrono", "backward_median_s")),
    ("load_share", "load %", ("chrono", "load_share")),
    ("mfu", "MFU %", ("chrono", "mfu")),
    ("peak_memory_gib", "peak GiB", ("chrono", "peak_memory_bytes"), ("max_memory_bytes",)),
    ("energy_j_per_image", "J/img", ("chrono", "energy_per_image_j")),
    ("bubble", "bubble %", ("pipeline", "bubble")),
    ("expected_bubble", "formula %", ("pipeline", "expected_bubble")),
    ("val_top1", "top-1", ("val_accuracy",)),
    ("val_top5", "top-5", ("val_top5_accuracy",)),
    ("val_balanced_accuracy", "bal. acc.", ("val_balanced_accuracy",)),
    ("val_macro_f1", "macro-F1", ("val_macro_f1",)),
    ("time_to_target_s", "to target s", ("time_to_target_s",)),
]
FIGURES = [column for column, *_ in COLUMNS]
SCALE = {"step_ms": 1e3, "load_ms": 1e3, "forward_ms": 1e3, "backward_ms": 1e3, "peak_memory_gib": 2**-30}
PERCENT = {
    "bubble",
    "expected_bubble",
    "load_share",
    "mfu",
    "val_top1",
    "val_top5",
    "val_balanced_accuracy",
    "val_macro_f1",
}


def _lookup(metrics: dict, path: tuple):
    value = metrics
    for key in path:
        value = value.get(key) if isinstance(value, dict) else None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def figures(metrics: dict) -> dict:
    """The COLUMNS of one run's metrics JSON (None where absent: MFU and energy need a GPU, top-1 a validation)."""
    out = {}
    for column, _, *paths in COLUMNS:
        value = next((v for v in (_lookup(metrics, p) for p in paths) if v is not None), None)
        out[column] = None if value is None else value * SCALE.get(column, 1)
    return out


def read_history(path: Path) -> list[dict]:
    """A run's validation history, one JSON object a line; a line cut by a killed run (the last) is left out."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    history = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            history.append(record)
    return history


def rows(sweeps) -> list[dict]:
    """sweeps: [(folder, sweep.json's dict, [(run, state)])] as dlojz_lab.py reads them."""
    out = []
    for folder, sweep, states in sweeps:
        for run, state in states:
            row = dict(sweep=sweep["name"], run=run["name"], state=state, **run["settings"])
            metrics = {}
            if state == "done":
                try:
                    metrics = json.loads((Path(folder) / run["name"] / "metrics.json").read_text())
                except (OSError, ValueError):
                    row["state"] = "done, no metrics JSON"
            row.update(figures(metrics))
            row["history"] = read_history(Path(folder) / run["name"] / "val_history.jsonl") if metrics else []
            out.append(row)
    return out


def swept(rows_: list[dict]) -> list[str]:
    """The settings' columns, in the order the sweeps give them."""
    names = []
    for row in rows_:
        for key in row:
            if key in ("sweep", "run", "state", "history") or key in FIGURES:
                continue
            if key not in names:
                names.append(key)
    return names


def cell(row: dict, column: str) -> str:
    value = row.get(column)
    if value is None:
        return ""
    if column in PERCENT:
        return f"{100 * value:.1f}"
    if column in ("img_s", "time_to_target_s"):
        return f"{value:.0f}"
    if column == "energy_j_per_image":
        return f"{value:.3f}"
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def table(rows_: list[dict]) -> str:
    """The runs' rows aligned: names left, figures right."""
    settings = swept(rows_)
    headers = ["sweep", *settings, "state", *(header for _, header, *_ in COLUMNS)]
    keys = ["sweep", *settings, "state", *FIGURES]
    body = [[cell(row, key) if key in FIGURES else str(row.get(key, "")) for key in keys] for row in rows_]
    widths = [max(len(h), *(len(line[i]) for line in body)) for i, h in enumerate(headers)]
    names = len(settings) + 2  # sweep, the settings, state
    return "\n".join(
        "  ".join(v.rjust(w) if i >= names else v.ljust(w) for i, (v, w) in enumerate(zip(line, widths)))
        for line in [headers, *body]
    )


def write_csv(rows_: list[dict], path: Path) -> None:
    """compare.csv: the settings, the state and every figure at full precision (units in the header)."""
    settings = swept(rows_)
    with open(path, "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["sweep", "run", "state", *settings, *FIGURES])
        for row in rows_:
            writer.writerow(
                [row["sweep"], row["run"], row["state"], *(row.get(s, "") for s in settings)]
                + ["" if row.get(c) is None else repr(row[c]) for c in FIGURES]
            )


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(rows_: list[dict]):
    """img/s and peak memory against each swept flag: one column of panels per flag, one line per combination of
    the other flags' values."""
    done = [row for row in rows_ if row.get("img_s") is not None]
    settings = swept(done)
    if not done or not settings:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(2, len(settings), figsize=(4.5 * len(settings), 6.5), squeeze=False)
    for column, flag in enumerate(settings):
        others = [s for s in settings if s != flag]
        values = list(dict.fromkeys(row.get(flag) for row in done))
        groups = {}
        for row in done:
            groups.setdefault(tuple(row.get(o) for o in others), []).append(row)
        for key, group in groups.items():
            label = ", ".join(f"{o}={v}" for o, v in zip(others, key)) or "runs"
            for ax, figure in ((axes[0][column], "img_s"), (axes[1][column], "peak_memory_gib")):
                points = [
                    (values.index(row.get(flag)), row.get(figure)) for row in group if row.get(figure) is not None
                ]
                if points:
                    points.sort()
                    ax.plot([x for x, _ in points], [y for _, y in points], marker="o", label=label)
        for ax, ylabel in ((axes[0][column], "images / s"), (axes[1][column], "peak memory (GiB)")):
            ax.set_xticks(range(len(values)), [str(v) for v in values])
            ax.set_xlabel(f"--{flag}")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0][column].legend(fontsize=7)
    fig.suptitle("throughput and memory against each swept flag")
    fig.tight_layout()
    return fig


def plot_phases(rows_: list[dict]):
    """Each run's median step as stacked bars: data loading, forward, backward, the rest (optimizer step, ...)."""
    done = [row for row in rows_ if row.get("step_ms") is not None]
    if not done:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(done) + 2), 4.5))
    names = [row["run"] for row in done]
    bottom = [0.0] * len(done)
    for phase, label in (("load_ms", "load"), ("forward_ms", "forward"), ("backward_ms", "backward"), ("rest", "rest")):
        if phase == "rest":
            heights = [max(0.0, row["step_ms"] + (row.get("load_ms") or 0) - b) for row, b in zip(done, bottom)]
        else:
            heights = [row.get(phase) or 0.0 for row in done]
        ax.bar(range(len(done)), heights, bottom=bottom, label=label)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_xticks(range(len(done)), names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("ms per step (medians)")
    ax.set_title("where each run's step goes")
    ax.legend()
    fig.tight_layout()
    return fig


def plot_accuracy(rows_: list[dict], metric: str = "top1"):
    """Validation top-1 (or another of METRICS) against wall-clock time, for the runs that validated at least
    twice (they trained)."""
    key, name = VALIDATION_METRICS[metric]
    trained = [row for row in rows_ if sum(key in point for point in row.get("history") or []) >= 2]
    if not trained:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    for row in trained:
        ax.plot(
            [point["elapsed_s"] for point in row["history"] if key in point],
            [100 * point[key] for point in row["history"] if key in point],
            marker="o",
            label=row["run"],
        )
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel(f"validation {name} (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def png(fig) -> bytes:
    """A figure as PNG bytes (for IPython.display.Image in a notebook), the figure closed."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    _pyplot().close(fig)
    return buffer.getvalue()


PLOTS = (("throughput_memory.png", plot_throughput), ("phases.png", plot_phases), ("accuracy.png", plot_accuracy))
PLOT_SOFTWARE = "dlojz_lab.py compare"  # each figure's PNG Software entry: how a later compare knows it


def claimed_files() -> dict:
    """{name: (kind, is_own)} of the files compare writes, as checks.claim_outputs_in takes them."""
    files = {
        "compare.csv": ("a compare.csv of dlojz_lab.py compare", lambda path: starts_with(path, b"sweep,run,state"))
    }
    for name, _ in PLOTS:
        files[name] = ("a figure of dlojz_lab.py compare", lambda path: is_png_drawn_by(path, PLOT_SOFTWARE))
    return files


def best_run(rows_: list[dict], metric: str = "top1") -> str | None:
    """The line naming the run with the best last validation by `metric` (the first of equals), or None."""
    column = next(column for column, _, *paths in COLUMNS if paths == [(VALIDATION_METRICS[metric][0],)])
    name = VALIDATION_METRICS[metric][1]
    scored = [row for row in rows_ if row.get(column) is not None]
    if not scored:
        return None
    best = max(scored, key=lambda row: row[column])
    return f"best {name}: {best['run']} ({100 * best[column]:.1f} %)"


def compare(sweeps, out: Path, metric: str = "top1", force: bool = False) -> int:
    """Print the table and the best run by `metric`, write compare.csv and the plots into `out` (`force`: over any
    regular file of those names); 0 when at least one run has figures. UserError before any work when a file there
    is not compare's."""
    claim_outputs_in(out, claimed_files(), "--out", force)  # (its default: the first sweep's folder, its own files)
    rows_ = rows(sweeps)
    print(table(rows_))
    if line := best_run(rows_, metric):
        print(line)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows_, out / "compare.csv")
    written = [str(out / "compare.csv")]
    for name, plot in PLOTS:
        fig = plot(rows_, metric) if plot is plot_accuracy else plot(rows_)
        if fig is not None:
            fig.savefig(out / name, dpi=110, metadata={"Software": PLOT_SOFTWARE})
            _pyplot().close(fig)
            written.append(str(out / name))
    print("written: " + ", ".join(written))
    unfinished = [row for row in rows_ if row["state"] != "done"]
    if unfinished:
        print(
            f"{len(unfinished)} run(s) without figures: " + ", ".join(f"{r['run']} ({r['state']})" for r in unfinished)
        )
    return 0 if len(unfinished) < len(rows_) else 1
