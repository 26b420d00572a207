"""dlojz_hpo.py's report: every trial in a CSV, Optuna's figures, and the best trial as a recipe file that
`dlojz.py --config` runs (the shared flags and the sampled ones, where they differ from dlojz.py's defaults).
`claimed_files()`: those files, each with how an earlier report's is known (the CSV's header, the figures' PNG
Software entry, the recipe's first comment), for the one output rule.
"""

import contextlib
import csv
import datetime
import os
import warnings
from pathlib import Path

from dlojz_lib.checks import is_png_drawn_by, starts_with
from dlojz_lib.hpo.space import NOT_IN_RECIPE, flag_actions, flag_argv, long_flag
from dlojz_lib.settings.flags import get_args_parser
from dlojz_lib.settings.recipe import toml_value

PLOTS = ("history", "importances", "parallel_coordinate", "intermediate_values")  # Optuna's figures, as NAME.png
PLOT_SOFTWARE = "dlojz_hpo.py report"
CSV_HEADER = "number,state,value"
RECIPE_HEAD = "# Best trial of the dlojz_hpo.py study"


def claimed_files() -> dict:
    """{name: (kind, is_own)} of the files the report writes, as checks.claim_outputs_in takes them."""
    files = {
        "trials.csv": ("a trials.csv of dlojz_hpo.py report", lambda path: starts_with(path, CSV_HEADER.encode())),
        "best.toml": ("a best.toml of dlojz_hpo.py report", lambda path: starts_with(path, RECIPE_HEAD.encode())),
    }
    for name in PLOTS:
        files[f"{name}.png"] = ("a figure of dlojz_hpo.py report", lambda path: is_png_drawn_by(path, PLOT_SOFTWARE))
    return files


def best_trial(study):
    with contextlib.suppress(ValueError):
        return study.best_trial
    return None


def recipe_values(study, trial):
    """{flag long name without dashes: value} of the best trial's run, as a recipe file gives them: the shared
    flags and the sampled ones, wherever they differ from dlojz.py's defaults."""
    actions = flag_actions(get_args_parser())
    argv = list(study.user_attrs.get("shared_flags", []))
    argv += [word for dest, value in trial.params.items() for word in flag_argv(actions[dest], value)]
    chosen = vars(get_args_parser().parse_args(argv))
    defaults = vars(get_args_parser().parse_args([]))
    return {
        long_flag(actions[dest])[2:]: value
        for dest, value in chosen.items()
        if dest not in NOT_IN_RECIPE and value != defaults[dest] and value is not None
    }


def write_recipe(path, study, trial, objective):
    lines = [
        f"{RECIPE_HEAD} '{study.study_name}': trial {trial.number}, {objective} {trial.value:.4f}",
        f"# written {datetime.datetime.now().isoformat(timespec='seconds')}; run it with",
        f"#     python dlojz.py --config {path}",
        "",
    ]
    lines += [f"{key} = {toml_value(value)}" for key, value in recipe_values(study, trial).items()]
    tmp = Path(f"{path}.tmp{os.getpid()}")
    tmp.write_text("\n".join(lines) + "\n")
    os.replace(tmp, path)


def write_csv(path, study):
    trials = study.get_trials(deepcopy=False)
    names = sorted({name for t in trials for name in t.params})
    columns = [
        *CSV_HEADER.split(","),
        *[name.replace("_", "-") for name in names],
        "epochs_validated",
        "epochs",
        "wall_s",
        "gpu_hours",
        "energy_j",
        "retry_of",
        "worker",
        "output_dir",
    ]
    with open(path, "w", newline="") as file:
        out = csv.writer(file)
        out.writerow(columns)
        for t in trials:
            a = t.user_attrs
            out.writerow(
                [
                    t.number,
                    t.state.name,
                    "" if t.value is None else t.value,
                    *[t.params.get(name, "") for name in names],
                    len(t.intermediate_values),
                    a.get("epochs", ""),
                    a.get("wall_s", ""),
                    a.get("gpu_hours", ""),
                    a.get("energy_j", ""),
                    t.system_attrs.get("failed_trial", ""),
                    a.get("worker", ""),
                    a.get("output_dir", ""),
                ]
            )


def write_plots(out, study):
    """Optuna's matplotlib figures; a figure that cannot be drawn yet (too few trials) is a line, not a failure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as vis

    written = []
    drawers = (
        vis.plot_optimization_history,
        vis.plot_param_importances,
        vis.plot_parallel_coordinate,
        vis.plot_intermediate_values,
    )
    for name, plot in zip(PLOTS, drawers):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                axes = plot(study)
            figure = (axes.flat[0] if hasattr(axes, "flat") else axes).figure
            figure.savefig(out / f"{name}.png", dpi=100, bbox_inches="tight", metadata={"Software": PLOT_SOFTWARE})
            plt.close(figure)
            written.append(f"{name}.png")
        except Exception as err:
            print(f"report: no {name}.png ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
    return written
