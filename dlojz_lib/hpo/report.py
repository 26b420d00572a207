"""dlojz_hpo.py's report: every trial in a CSV, Optuna's figures, and the best trial as a recipe file that
`dlojz.py --config` runs (the shared flags and the sampled ones, where they differ from dlojz.py's defaults).
"""

import contextlib
import csv
import datetime
import os
import warnings
from pathlib import Path

from dlojz_lib.hpo.space import NOT_IN_RECIPE, flag_actions, flag_argv, long_flag
from dlojz_lib.settings.flags import get_args_parser
from dlojz_lib.settings.recipe import toml_value


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
        f"# Best trial of the dlojz_hpo.py study '{study.study_name}': trial {trial.number}, {objective} "
        f"{trial.value:.4f}",
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
        "number",
        "state",
        "value",
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
    for name, plot in (
        ("history", vis.plot_optimization_history),
        ("importances", vis.plot_param_importances),
        ("parallel_coordinate", vis.plot_parallel_coordinate),
        ("intermediate_values", vis.plot_intermediate_values),
    ):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                axes = plot(study)
            figure = (axes.flat[0] if hasattr(axes, "flat") else axes).figure
            figure.savefig(out / f"{name}.png", dpi=100, bbox_inches="tight")
            plt.close(figure)
            written.append(f"{name}.png")
        except Exception as err:
            print(f"report: no {name}.png ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})")
    return written
