"""Write docs/flags.md, the reference of dlojz.py's flags, from its parser (dlojz_lib.settings.flags.get_args_parser): each
group of `--help` as a table of flag, value, default and help. tests/test_docs.py fails when the page differs from
what this writes, so a flag added or changed is documented by running it:

    python docs/make_flags.py
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dlojz_lib.settings.flags import Number, get_args_parser  # noqa: E402

PAGE = ROOT / "docs" / "flags.md"


def cell(text):
    return " ".join(str(text).split()).replace("|", "\\|")


def value_of(action):
    """What the flag takes: its choices, its bounds, or nothing for a switch."""
    if action.nargs == 0:
        return "switch"
    if action.choices:
        return " \\| ".join(f"`{choice}`" for choice in action.choices)
    if isinstance(action.type, Number):
        return f"{action.type.kind.__name__} {action.type.describe()}"
    return cell(action.metavar or action.dest.upper())


def default_of(action):
    if action.default in (None, argparse.SUPPRESS) or action.nargs == 0 and action.default is False:
        return ""
    return f"`{cell(action.default)}`"


def flags_markdown(parser=None):
    parser = parser or get_args_parser()
    out = [
        "# dlojz.py's flags",
        "",
        "What you can do here: look up any flag of `dlojz.py`: what it takes, its default and what it does, grouped as",
        "`python dlojz.py --help` groups them. Written by `python docs/make_flags.py` from the parser; the prose by",
        "topic is [flags-by-topic.md](flags-by-topic.md). A default left blank is decided at start-up (the GPU or CPU",
        "profile, the device, the Slurm task) or means off.",
    ]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.help != argparse.SUPPRESS]
        if not actions:
            continue
        out += ["", f"## {group.title}", "", "| flag | takes | default | what it does |", "| --- | --- | --- | --- |"]
        for action in actions:
            names = ", ".join(f"`{name}`" for name in action.option_strings)
            out.append(f"| {names} | {value_of(action)} | {default_of(action)} | {cell(action.help or '')} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    PAGE.write_text(flags_markdown())
    print(f"written: {PAGE.relative_to(ROOT)}")
