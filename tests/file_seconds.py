"""The suite's measured seconds, for its schedule and its tiers: each test file's seconds (conftest hands the slowest
files to the xdist workers first: longest first is the schedule that ends two workers closest together), each
test's own seconds and each shared fixture's set-up seconds (a test over SLOW_S, or one that needs a fixture over
SLOW_S, carries the `slow` marker: `-m "not slow"` is the loop to run after a change).

    python -m pytest tests -q -n 3 --dist loadfile --junitxml=/tmp/junit.xml     # as CI runs it
    python tests/file_seconds.py /tmp/junit.xml        # rewrites tests/file_seconds.json

conftest.py records each fixture's set-up seconds into the report (a `fixture_seconds` property of the test whose
set-up built it), so a test's own seconds are its total less the fixtures it built: the first test of a module
does not pay for the module's shared run in the tiers, the module's tests that need that run do.
"""

import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

FIGURES = Path(__file__).with_name("file_seconds.json")
TESTS = Path(__file__).resolve().parent
# A test over this many seconds, measured in the suite as CI runs it on a 2-core machine of the project's kind, is
# `slow`: the tier after a change leaves it out. The slow tests are about a sixth of them and most of the time; the
# bound holds the tier within its minute (measured: over 1.0 s, 1,261 tests in 75-80 s once the suite took 574 s;
# over 0.6 s, 1,189 in 51-52 s).
SLOW_S = 0.6
# What the figures keep of tests and fixtures: the rest are too short to matter to a tier or to the schedule.
KEPT_S = 0.5


def load():
    """{"files": {path under tests/: seconds}, "tests": {node id: own seconds}, "fixtures": {key: seconds}} as last
    measured; empty tables where the file is missing or unreadable (any order then runs, nothing is slow)."""
    tables = {"files": {}, "tests": {}, "fixtures": {}}
    try:
        found = json.loads(FIGURES.read_text())
        for table in tables:
            tables[table] = {str(name): float(seconds) for name, seconds in found.get(table, {}).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    return tables


def fixture_key(fixturedef):
    """A shared fixture's name where it is defined: `tests::trained_run`, `tests/commands/test_x.py::module_run`."""
    return f"{fixturedef.baseid or 'tests'}::{fixturedef.argname}"


def is_slow(nodeid, fixture_keys, figures):
    """Whether a test belongs to the slow tier: its own seconds, or those of a fixture it needs, over SLOW_S."""
    if figures["tests"].get(nodeid, 0.0) > SLOW_S:
        return True
    return any(figures["fixtures"].get(key, 0.0) > SLOW_S for key in fixture_keys)


def nodeid_of(case):
    """A junit testcase's pytest node id: classname `tests.data.test_dali` (or `...test_x.TestY`) and name."""
    parts = case.get("classname", "").split(".")
    cls = [parts.pop()] if len(parts) > 2 and parts[-1][:1].isupper() else []
    return "::".join(["/".join(parts) + ".py", *cls, case.get("name", "")])


def from_junit(path):
    """(files, tests, fixtures) seconds from pytest's --junitxml report, with conftest's fixture_seconds."""
    files, tests, fixtures = collections.Counter(), {}, {}
    for case in ET.parse(path).iter("testcase"):
        nodeid = nodeid_of(case)
        if not nodeid.startswith("tests/"):
            continue
        total = float(case.get("time") or 0)
        built = 0.0
        for prop in case.iter("property"):
            if prop.get("name") == "fixture_seconds":
                key, seconds = prop.get("value").rsplit("=", 1)
                fixtures[key] = max(fixtures.get(key, 0.0), float(seconds))
                built += float(seconds)
        files[nodeid.split("::")[0].removeprefix("tests/")] += total
        tests[nodeid] = max(0.0, total - built)
    return files, tests, fixtures


def write(files, tests, fixtures):
    def kept(table):
        return {k: round(v, 1) for k, v in sorted(table.items(), key=lambda kv: -kv[1]) if v >= KEPT_S}

    FIGURES.write_text(
        json.dumps({"files": kept(files), "tests": kept(tests), "fixtures": kept(fixtures)}, indent=1) + "\n"
    )


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/file_seconds.py JUNIT.xml  (from pytest --junitxml)")
    files, tests, fixtures = from_junit(sys.argv[1])
    write(files, tests, fixtures)
    slow = [nodeid for nodeid, seconds in tests.items() if seconds > SLOW_S]
    print(
        f"{FIGURES}: {len(files)} files, {sum(files.values()):.0f} s of tests; {len(slow)} tests over {SLOW_S} s, "
        f"{sum(1 for s in fixtures.values() if s > SLOW_S)} fixtures over {SLOW_S} s"
    )
