"""Recipe files: a run's flags as TOML, one key per flag (its long name without the dashes). `read_recipe` reads
one for `--config FILE.toml`, checking every value as the command line would; `recipe_text`, its inverse, writes a
run's `args.toml` (and dlojz_hpo.py's best trial); `read_toml` is the one reader of TOML files, for recipes and
dlojz_hpo.py's search spaces. No torch. A flag's bounds are its parser type's (dlojz_lib.settings.flags.Number: `kind`,
`check`).
"""

import argparse
import dataclasses
import json
import math

from dlojz_lib.checks import fail, read_text


def read_toml(path, flag):
    """The TOML file that `flag` names, as a dict; UserError naming the flag and the file if it cannot be read."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        fail(f"{flag} {path}: reading TOML needs Python 3.11 or newer (tomllib)")
    text = read_text(path, flag, "give a TOML text file")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        fail(f"{flag} {path}: not valid TOML ({err})")


def flag_actions(parser):
    """The parser's flags, one action each: not --help, nor the hidden --no-FLAG forms that clear a flag's value
    (a row's `clearable=True` in dlojz_lib/settings/flags.py), which share its dest."""
    return [action for action in parser._actions if action.dest != "help" and action.help != argparse.SUPPRESS]


def read_recipe(parser, path):
    """The flag values of a recipe file: one TOML key per flag, its long name without the dashes (`-` or `_`).
    Raises UserError naming the file and the key for an unknown key or a value of the wrong type."""
    recipe = read_toml(path, "--config")
    actions = {action.dest: action for action in flag_actions(parser) if action.dest != "config"}
    values, keys = {}, {}
    for key, value in recipe.items():
        dest = key.replace("-", "_")
        if dest in keys:  # TOML itself allows batch-size and batch_size side by side
            fail(f"--config {path}: keys '{keys[dest]}' and '{key}' are the same flag: keep one")
        keys[dest] = key
        action = actions.get(dest)
        if action is None:
            import difflib

            close = difflib.get_close_matches(dest, list(actions), n=1)
            fail(
                f"--config {path}: unknown key '{key}', not a dlojz flag"
                + (f" (did you mean '{close[0].replace('_', '-')}'?)" if close else "")
            )
        values[dest] = recipe_value(action, value, f"--config {path}: key '{key}'")
    return values


def toml_value(value):
    """A TOML value: booleans, numbers (inf included), lists, strings (JSON's escapes are TOML's)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return ("inf" if value > 0 else "-inf") if isinstance(value, float) and math.isinf(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def recipe_text(cfg, parser, header=()):
    """`cfg`'s flag values as a recipe file that `--config` reads back (the inverse of read_recipe): every flag
    with a value once the recipe, the command line and the CPU/GPU profile are merged; unset ones left out."""
    values = vars(cfg) if not dataclasses.is_dataclass(cfg) else dataclasses.asdict(cfg)
    lines = [f"# {line}" for line in header]
    for action in flag_actions(parser):
        value = values.get(action.dest)
        if action.dest in ("help", "config") or value is None:
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value_type(action) is float:
            value = float(value)  # an int default of a float flag: written as the recipe reader reads it back
        lines.append(f"{action.dest.replace('_', '-')} = {toml_value(value)}")
    return "\n".join(lines) + "\n"


def value_type(action):
    """int, float or str: what a flag that takes a value is given."""
    return getattr(action.type, "kind", None) or action.type or str  # a Number's kind, or argparse's type


def recipe_value(action, value, where):
    """`value` checked against what the flag takes, as the command line would check it."""
    if action.nargs == 0 or isinstance(action, argparse.BooleanOptionalAction):  # switches
        if not isinstance(value, bool):
            fail(f"{where} is a switch: true or false (got {value!r})")
        return value
    one = argparse.Action([], action.dest, type=action.type, choices=action.choices)  # one of the flag's values
    if action.nargs == "?":  # --pretrained [WEIGHTS]: a value, or true for the bare flag's
        if value is True and action.const is not None:
            return action.const
        return recipe_value(one, value, where)
    if action.nargs in ("+", "*"):  # --lr-milestones E [E ...]: a list (or one value)
        values = value if isinstance(value, list) else [value]
        if action.nargs == "+" and not values:
            fail(f"{where} takes one value or more (got [])")
        return [recipe_value(one, v, where) for v in values]
    if action.nargs is not None:  # e.g. --randaugment N M
        if not isinstance(value, list) or len(value) != action.nargs:
            fail(f"{where} takes a list of {action.nargs} values (got {value!r})")
        return [recipe_value(one, v, where) for v in value]
    bounds = action.type if hasattr(action.type, "check") else None  # a Number
    expected = value_type(action)
    if expected is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, expected) or isinstance(value, bool):
        fail(
            f"{where} must be {'a number' if expected is float else 'an integer' if expected is int else 'a string'} "
            f"(got {value!r})"
        )
    if bounds:
        try:
            bounds.check(value)
        except argparse.ArgumentTypeError as err:
            fail(f"{where} {err}")
    if action.choices is not None and value not in action.choices:
        fail(f"{where} must be one of {', '.join(map(str, action.choices))} (got {value!r})")
    return value
