"""dlojz_hpo.py's search space: the TOML file of ranges and choices, one table per dlojz.py flag, checked against
the flag's own type and bounds (`read_space`), the flags shared by every trial (`split_shared`, `check_shared`: the
whole command resolved once, before any trial), and a sampled value back into command-line words (`flag_argv`).
"""

import argparse

from dlojz_lib.checks import UserError, fail
from dlojz_lib.settings.config import resolve_config
from dlojz_lib.settings.flags import get_args_parser
from dlojz_lib.settings.recipe import flag_actions as recipe_flag_actions
from dlojz_lib.settings.recipe import read_toml, recipe_value, value_type

# Flags the worker sets for each trial: not in the search space nor after `--` (--output-dir is the trials' root).
PER_TRIAL = ("metrics_json", "val_history", "resume", "requeue", "wandb_group", "config")


NOT_IN_RECIPE = PER_TRIAL + ("output_dir", "help")


RANGE_KEYS = {"low", "high", "log", "step"}


# The search space and the trials' flags
def flag_actions(parser):
    return {action.dest: action for action in recipe_flag_actions(parser)}


def long_flag(action):
    return next(o for o in action.option_strings if o.startswith("--"))


def read_space(path):
    """{dest: (argparse action, optuna distribution)} from the search space file; UserError naming the key."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    tables = read_toml(path, "--space")
    if not tables:
        fail(f"--space {path}: no flag to search (one table per flag: [lr] low = 0.01, high = 1.0, log = true)")
    actions = flag_actions(get_args_parser())
    space = {}
    for key, table in tables.items():
        where = f"--space {path}: [{key}]"
        dest = key.replace("-", "_")
        action = actions.get(dest)
        if action is None:
            import difflib

            close = difflib.get_close_matches(dest, list(actions), n=1)
            fail(
                f"{where}: not a dlojz.py flag" + (f" (did you mean [{close[0].replace('_', '-')}]?)" if close else "")
            )
        if dest in PER_TRIAL or dest == "output_dir":
            fail(f"{where}: dlojz_hpo.py sets {long_flag(action)} for each trial itself")
        if not isinstance(table, dict):
            fail(f"{where} must be a table: [{key}] then low = ..., high = ... or choices = [...]")
        unknown = set(table) - RANGE_KEYS - {"choices"}
        if unknown or ("choices" in table and set(table) != {"choices"}):
            fail(
                f"{where}: unknown or mixed keys {sorted(set(table) - {'choices'} if 'choices' in table else unknown)} "
                f"(a range has low, high and optionally log or step; a list has choices only)"
            )
        if action.nargs not in (None, 0) and not isinstance(action, argparse.BooleanOptionalAction):
            fail(f"{where}: {long_flag(action)} takes several values: not searchable")
        if "choices" in table:
            choices = table["choices"]
            if not isinstance(choices, list) or not choices:
                fail(f"{where}: choices must be a non-empty list (got {choices!r})")
            values = [recipe_value(action, value, f"{where} choice") for value in choices]
            if len(set(map(repr, values))) != len(values):
                fail(f"{where}: a choice is repeated ({choices!r})")
            space[dest] = (action, CategoricalDistribution(values))
            continue
        if value_type(action) not in (int, float) or action.choices is not None:
            fail(f"{where}: {long_flag(action)} is not a number: give choices = [...]")
        if "low" not in table or "high" not in table:
            fail(f"{where}: a range needs low and high (or give choices = [...])")
        low, high = (recipe_value(action, table[k], f"{where} {k}") for k in ("low", "high"))
        if not low < high:
            fail(f"{where}: empty range, low {low} must be below high {high}")
        log, step = table.get("log", False), table.get("step")
        if not isinstance(log, bool):
            fail(f"{where}: log is true or false (got {log!r})")
        if log and low <= 0:
            fail(f"{where}: a log range needs low > 0 (got {low})")
        if step is not None:
            step = recipe_value(action, step, f"{where} step")
            if step <= 0 or log:
                fail(f"{where}: step must be > 0, and cannot go with log = true (got {step})")
        if value_type(action) is int:
            space[dest] = (action, IntDistribution(low, high, log=log, step=step or 1))
        else:
            space[dest] = (action, FloatDistribution(low, high, log=log, step=step))
    return space


def flag_argv(action, value):
    """The command-line words that give `value` to this flag."""
    if isinstance(action, argparse.BooleanOptionalAction):
        return [long_flag(action) if value else "--no-" + long_flag(action)[2:]]
    if action.nargs == 0:  # store_true / store_false: only the switched state has a word
        return [long_flag(action)] if value != action.default else []
    return [long_flag(action), str(value)]


def split_shared(shared):
    """(shared flags without --output-dir, the --output-dir given or None)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--output-dir", default=None)
    known, rest = parser.parse_known_args(shared)
    return rest, known.output_dir


def check_data_root(data_root, val_split):
    """The shared --data-root (or the variables' folder) is a data set's: train/ and val/ found, as a trial's
    build_data would find them; one line otherwise."""
    from dlojz_lib.checks import DataError
    from dlojz_lib.data.datasets import resolve_data_root
    from dlojz_lib.data.layout import find_layout

    try:
        root, _ = resolve_data_root(data_root)
        if root is not None:  # (None: the embedded data set, made by the first trial)
            find_layout(root, val_split)
    except DataError as err:
        fail(f"after --: {err}")


def check_shared(shared, space, direction, root):
    """Check the flags every trial shares, and each end of every range and every choice with them, as dlojz.py
    itself would: one line, before any trial. Returns the shared flags' Config."""
    actions = flag_actions(get_args_parser())
    given = set()
    for word in shared:
        if word.startswith("--"):
            name = word[2:].split("=")[0]
            if name.startswith("no-") and name[3:].replace("-", "_") in actions:
                name = name[3:]
            given.add(name.replace("-", "_"))
    for dest in sorted(given & set(PER_TRIAL)):
        fail(f"after --: dlojz_hpo.py sets {long_flag(actions[dest])} for each trial itself: leave it out")
    for dest in sorted(given & set(space)):
        fail(f"after --: {long_flag(actions[dest])} is also in --space: give it in one place")

    def config(extra, where):
        parser = get_args_parser()
        parser.error = lambda message: fail(f"{where}: {message}")  # one line, ours, not argparse's exit
        try:
            return resolve_config(parser.parse_args([*shared, *extra, "--output-dir", str(root)]))
        except UserError as err:
            fail(f"{where}: {str(err).removeprefix(where + ': ')}")

    cfg = config([], "after --")
    if not cfg.synthetic:  # the data every trial reads: there, once, before the first trial (not a failure a trial)
        check_data_root(cfg.data_root, cfg.val_split)
    for dest, (action, dist) in space.items():
        ends = dist.choices if hasattr(dist, "choices") else (dist.low, dist.high)
        for value in ends:
            config(flag_argv(action, value), f"--space [{long_flag(action)[2:]}] = {value!r} with the flags after --")
    if direction == "minimize" and cfg.target_accuracy is None and "target_accuracy" not in space:
        fail("--direction minimize is the time to --target-accuracy: give --target-accuracy after -- (or in --space)")
    return cfg
