"""Each test file's seconds in a measured run of the suite, so that conftest hands the slowest files to the xdist
workers first (longest first is the schedule that ends two workers closest together; xdist's own order, by number of
tests, put a 50 s file last and left one worker idle for up to a minute).

    python -m pytest tests -q -n 2 --dist loadfile --junitxml=/tmp/junit.xml
    python tests/file_seconds.py /tmp/junit.xml        # rewrites tests/file_seconds.json
"""

import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

FIGURES = Path(__file__).with_name("file_seconds.json")


def load():
    """{file name: seconds} as last measured; empty where the file is missing or unreadable (any order then runs)."""
    try:
        return {str(name): float(seconds) for name, seconds in json.loads(FIGURES.read_text()).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def from_junit(path):
    """Seconds per test file, summed over its tests, from pytest's --junitxml report."""
    seconds = collections.Counter()
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "").split(".")
        if len(module) >= 2 and module[0] == "tests":
            seconds[module[1] + ".py"] += float(case.get("time") or 0)
    return seconds


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/file_seconds.py JUNIT.xml  (from pytest --junitxml)")
    figures = from_junit(sys.argv[1])
    FIGURES.write_text(json.dumps({name: round(s, 1) for name, s in figures.most_common()}, indent=1) + "\n")
    print(f"{FIGURES}: {len(figures)} files, {sum(figures.values()):.0f} s of tests")
