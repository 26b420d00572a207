"""The suite's own tools: the seconds that sort tests into tiers (tests/file_seconds.py), the markers conftest gives
from them, and the guard that holds the `multirank` marker true."""

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import conftest
import file_seconds
import preloaded
import pytest
from conftest import ROOT, SMALL, clean_env

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

    quick = min(figures["files"], key=figures["files"].get)  # the file measured fastest
    items = [
        Item(f"tests/{quick}::test_quick"),
        Item(slow[0]),
        Item(f"tests/{quick}::test_reads", [fixture]),
        Item("tests/test_not_measured_yet.py::test_new"),
    ]
    original = conftest.fixture_keys
    conftest.fixture_keys = lambda item: item.fixtures
    try:
        conftest.pytest_collection_modifyitems(None, items)
    finally:
        conftest.fixture_keys = original
    marked = {item.nodeid: item.markers for item in items}
    assert marked == {
        slow[0]: ["slow"],
        f"tests/{quick}::test_quick": [],
        f"tests/{quick}::test_reads": ["slow"],
        "tests/test_not_measured_yet.py::test_new": [],
    }
    # a file not measured yet first (it may be slow), then the slowest measured; a file's tests keep their order
    assert [item.nodeid.split("::")[1] for item in items] == [
        "test_new",
        slow[0].split("::")[1],
        "test_quick",
        "test_reads",
    ]


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


def test_the_test_modules_as_pytest_rewrote_them_are_kept_for_the_next_worker():
    """Each xdist worker, and the next run, reads this module's bytecode as pytest rewrote it (its asserts), written
    once whatever PYTHONDONTWRITEBYTECODE says: rewriting the test modules is 7 s of a worker's collection."""
    from _pytest.assertion.rewrite import PYTEST_TAG, _read_pyc, get_cache_dir

    source = Path(__file__)
    rewritten = get_cache_dir(source) / f"{source.stem}.{PYTEST_TAG}.pyc"
    assert rewritten.exists(), rewritten
    # valid as pytest checks it, by the source's hash, not by a time: a source touched and left as it was keeps it
    assert _read_pyc(source, rewritten) is not None, rewritten


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


@pytest.mark.multirank
def test_the_launch_prefix_serves_torchrun_s_ranks_and_its_exit_status(tmp_path):
    """`python -m torch.distributed.run --standalone --nproc-per-node 2 dlojz.py ...` through launch_prefix (a lab's
    local multi-rank run): two forks of the preloaded server given torchrun's variables, one process group; a failed
    run's exit status is torchrun's, 1, not the ranks' own (a flag error's 2)."""
    torchrun = [*preloaded.launch_prefix(clean_env()), sys.executable, "-u", "-m", "torch.distributed.run",
                "--standalone", "--nproc-per-node", "2", str(ROOT / "dlojz.py")]  # fmt: skip
    run = [*SMALL, "--synthetic", "--test", "--test-nsteps", "2", "-b", "4", "--output-dir", tmp_path / "run"]
    preloaded.SEVERAL_RANKS.clear()
    proc = subprocess.run([*torchrun, *map(str, run)], capture_output=True, text=True, env=clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Training on 1 nodes and 2 processes (TorchElastic)" in proc.stdout, proc.stdout
    assert "dlojz.py on 2 ranks" in preloaded.SEVERAL_RANKS  # forks given torchrun's variables, not a torchrun
    proc = subprocess.run([*torchrun, "--epochs", "0"], capture_output=True, text=True, env=clean_env(), timeout=120)
    # (the rank that fails first has the other ended, as torchrun does: one rank's line or both)
    assert proc.returncode == 1 and "argument -e/--epochs: must be >= 1" in proc.stderr, proc.stderr


@pytest.mark.multirank
def test_the_launch_prefix_runs_a_bench_script_as_a_fork_and_anything_else_as_given(tmp_path):
    """`python bench/SCRIPT.py ARGS` and a sibling command's `python dlojz_NAME.py ARGS` through launch_prefix run
    in a fork of the preloaded server (their request reaches the server), with the script's exit status and output;
    under `torchrun --standalone --nproc-per-node 2`, in two such forks given torchrun's variables; `python -c` is
    executed as given."""
    preloaded.SERVED.clear()
    script = ROOT / "bench" / "bench_loader.py"
    proc = subprocess.run(
        [*preloaded.launch_prefix(clean_env()), sys.executable, str(script), "--data", str(tmp_path / "nowhere")],
        capture_output=True, text=True, env=clean_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and f"--data {tmp_path / 'nowhere'}: not a folder" in proc.stderr, proc.stderr
    command = ROOT / "dlojz_hpo.py"
    proc = subprocess.run(
        [*preloaded.launch_prefix(clean_env()), sys.executable, str(command), "report", "--study", "s", "--storage",
         str(tmp_path / "nowhere.log"), "--out", str(tmp_path / "out")],
        capture_output=True, text=True, env=clean_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.startswith("dlojz_hpo.py: error: --storage"), proc.stderr
    assert preloaded.SERVED == [str(script), str(command)]
    preloaded.SEVERAL_RANKS.clear()
    proc = subprocess.run(
        [*preloaded.launch_prefix(clean_env()), sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", "2", str(script), "--data", str(tmp_path / "nowhere")],
        capture_output=True, text=True, env=clean_env(), timeout=120,
    )  # fmt: skip
    # (torchrun's status when its workers fail, 1; the rank that fails first has the other ended: one line or two)
    assert proc.returncode == 1 and f"--data {tmp_path / 'nowhere'}: not a folder" in proc.stderr, proc.stderr
    assert preloaded.SERVED == [str(script), str(command), str(script)]
    assert "dlojz.py on 2 ranks" in preloaded.SEVERAL_RANKS  # two forks given torchrun's variables, not a torchrun
    proc = subprocess.run(
        [*preloaded.launch_prefix(clean_env()), sys.executable, "-c", "print('as given')"],
        capture_output=True, text=True, env=clean_env(), timeout=120,
    )  # fmt: skip
    assert proc.stdout == "as given\n" and preloaded.SERVED == [str(script), str(command), str(script)]


def test_the_ranks_a_test_starts_by_hand_as_torchrun_would_are_forks_of_the_server():
    """A rank given torchrun's variables by a test (preloaded.rank_env: TORCHELASTIC_RUN_ID, RANK...) is a fork of
    the preloaded server (those variables are read when the run sets up its ranks, not when Python starts); a
    variable read at start-up (PYTHONHASHSEED) still asks for a fresh interpreter."""
    ranks = preloaded.rank_env(clean_env(), 1, 2, preloaded.free_port())
    assert ranks["TORCHELASTIC_RUN_ID"] and preloaded.can_run(ranks)
    assert not preloaded.can_run(dict(ranks, PYTHONHASHSEED="7"))


def what_a_fork_of_the_server_holds(rank, world, store_path, found):
    """One process: how many objects its collector never walks, the modules of the server's preload it lacks, and
    the processes a --compile run's start of the compile workers left beside it (dlojz_lib.dist.start_compile_workers,
    as --compile calls it)."""
    import gc
    import os
    import sys

    from dlojz_lib.dist import start_compile_workers

    frozen = gc.get_freeze_count()
    lacking = [name for name in preloaded.PRELOAD if name not in sys.modules]
    start_compile_workers()
    children = open(f"/proc/{os.getpid()}/task/{os.getpid()}/children").read().split()
    found.put((frozen, lacking, children))


def test_a_fork_of_the_server_walks_none_of_its_objects_and_compiles_without_a_pool_of_workers(tmp_path):
    """In a process the tests start (a fork of the preloaded server), the server's imports are in the collector's
    permanent generation, every module of its preload is imported (the server's imports fail silently: a module
    renamed by an upgrade would be imported again by every run), and torch.compile starts no compile worker: CPU
    seconds the suite saves in every run (tests/preloaded.py's PRELOAD and as_spawned, conftest's
    TORCHINDUCTOR_COMPILE_THREADS)."""
    from conftest import spawn_ranks

    [(frozen, lacking, children)] = spawn_ranks(what_a_fork_of_the_server_holds, 1, tmp_path)
    assert frozen > 100_000, frozen  # torch's and dlojz's modules, functions and classes
    assert lacking == [], lacking
    assert children == [], children
