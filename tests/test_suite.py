"""The suite's own tools: the seconds that sort tests into tiers (tests/file_seconds.py), the markers conftest gives
from them, and the guard that holds the `multirank` marker true."""

import subprocess
import sys
from types import SimpleNamespace

import conftest
import file_seconds
import pytest

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.parallelism.test_x" name="test_first" time="14.0">
  <properties><property name="fixture_seconds" value="tests/parallelism/test_x.py::runs=12.5"/></properties>
</testcase>
<testcase classname="tests.parallelism.test_x" name="test_second[a-1]" time="0.3"/>
<testcase classname="tests.test_y" name="test_alone" time="2.5"/>
</testsuite></testsuites>"""


def test_a_test_s_own_seconds_leave_out_the_shared_fixture_its_set_up_built(tmp_path):
    (tmp_path / "junit.xml").write_text(JUNIT)
    files, tests, fixtures = file_seconds.from_junit(tmp_path / "junit.xml")
    assert files == {"parallelism/test_x.py": 14.3, "test_y.py": 2.5}
    assert tests == {
        "tests/parallelism/test_x.py::test_first": pytest.approx(1.5),
        "tests/parallelism/test_x.py::test_second[a-1]": 0.3,
        "tests/test_y.py::test_alone": 2.5,
    }
    assert fixtures == {"tests/parallelism/test_x.py::runs": 12.5}


def test_a_test_is_slow_by_its_own_seconds_or_by_a_fixture_it_needs():
    figures = {"files": {}, "tests": {"t::own": 1.5, "t::quick": 0.2}, "fixtures": {"t::runs": 12.5, "t::data": 0.1}}
    assert file_seconds.is_slow("t::own", [], figures)
    assert not file_seconds.is_slow("t::quick", ["t::data"], figures)
    assert file_seconds.is_slow("t::quick", ["t::data", "t::runs"], figures)  # the shared run it reads
    assert not file_seconds.is_slow("t::never-measured", [], figures)


def test_conftest_marks_the_measured_slow_tests_and_leaves_the_others():
    """Collection gives `slow` to a test tests/file_seconds.json measured over SLOW_S, and to one that needs a shared
    fixture measured over it, not to the others; the slowest file's tests go first."""
    figures = file_seconds.load()
    slow = [nodeid for nodeid, seconds in figures["tests"].items() if seconds > file_seconds.SLOW_S]
    fixture = next(key for key, seconds in figures["fixtures"].items() if seconds > file_seconds.SLOW_S)
    assert slow, "tests/file_seconds.json lists no slow test"

    class Item:
        def __init__(self, nodeid, fixtures=()):
            self.nodeid, self.markers, self.fixtures = nodeid, [], list(fixtures)
            self.path = conftest.ROOT / nodeid.split("::")[0]
            self.fixturenames = []

        def add_marker(self, marker):
            self.markers.append(marker.name)

    items = [Item("tests/test_suite.py::test_quick"), Item(slow[0]), Item("tests/test_suite.py::test_reads", [fixture])]
    original = conftest.fixture_keys
    conftest.fixture_keys = lambda item: item.fixtures
    try:
        conftest.pytest_collection_modifyitems(None, items)
    finally:
        conftest.fixture_keys = original
    marked = {item.nodeid: item.markers for item in items}
    assert marked == {
        slow[0]: ["slow"],
        "tests/test_suite.py::test_quick": [],
        "tests/test_suite.py::test_reads": ["slow"],
    }
    assert items[0].nodeid == slow[0]  # the slowest test's file was measured slower than this one


def test_torchrun_with_several_processes_is_noted_and_an_unmarked_test_refused():
    conftest.SEVERAL_RANKS.clear()
    try:
        subprocess.run([sys.executable, "-c", "pass", "-m", "torch.distributed.run", "--nproc-per-node", "1"])
        assert conftest.SEVERAL_RANKS == []  # one process is not several ranks
        conftest.note_torchrun(["torchrun", "--standalone", "--nproc-per-node", "4", "dlojz.py"])
        assert conftest.SEVERAL_RANKS == ["torchrun on 4 ranks"]
        unmarked = SimpleNamespace(nodeid="tests/x.py::test_y", get_closest_marker=lambda name: None)
        assert conftest.ranks_without_marker(unmarked) == (
            "tests/x.py::test_y starts torchrun on 4 ranks: mark it @pytest.mark.multirank"
        )
        marked = SimpleNamespace(nodeid="tests/x.py::test_y", get_closest_marker=lambda name: name == "multirank")
        assert conftest.ranks_without_marker(marked) is None
    finally:
        conftest.SEVERAL_RANKS.clear()


def test_each_test_starts_from_the_same_torch_state_part_one():
    import torch

    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(123)


def test_each_test_starts_from_the_same_torch_state_part_two():
    """Runs after part one in the same worker (a file's tests stay together, in order): what it changed is back."""
    import torch

    assert torch.get_default_dtype() == torch.float32
    assert torch.get_num_threads() == int(conftest.THREADS)
    state = torch.get_rng_state()
    torch.manual_seed(123)
    assert not torch.equal(state, torch.get_rng_state())  # the generator is not left at part one's seed
