"""dlojz_lab.py: sweeps of dlojz.py runs here and as a Slurm job array, `status`, and `compare`'s table, CSV and plots
checked against the runs' own metrics; bad grids refused in one line before anything runs. The sweep as a Slurm job
array is in test_slurm.py, with the tests' one-node cluster.

Modules: dlojz_lib/lab/ (the sweeps and the comparison's report)."""

import csv
import json
import os
import signal
import socket
import subprocess
import sys

import preloaded
import pytest
from conftest import ROOT, clean_env, script_python
from test_packed_data import TINY

import dlojz_lab  # noqa: E402
import dlojz_lib.lab.report  # noqa: E402
import dlojz_lib.lab.sweep as sweeps  # noqa: E402

RUN = [*TINY, "--test", "--test-nsteps", "2"]


def lab(*args, cwd, env=None, timeout=300):
    """dlojz_lab.py as a user runs it, from `cwd`: a fork of the tests' preloaded server where the environment
    allows (a sweep checks its runs' flags with dlojz's, whose imports a fresh interpreter pays: 5.5 CPU s)."""
    env = env or clean_env()
    return subprocess.run(
        [*script_python(env), str(ROOT / "dlojz_lab.py"), *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def read_csv(path):
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def test_a_local_sweep_goes_on_past_a_failed_run_and_compare_gives_its_metrics(tiny_data, tmp_path):
    # --python: each run a fork of the tests' preloaded server (tests/preloaded.py), not a new interpreter
    (tmp_path / "py").mkdir()
    python = preloaded.python_executable(tmp_path / "py", clean_env())
    proc = lab(
        *("sweep", "--name", "s", "--python", python),
        *("--grid", "channels-last=on,off", "--grid", "arch=resnet18,nosuchnet", "--"),
        *RUN,
        "--data-root",
        tiny_data,
        cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr  # one run failed: said in the exit status
    assert "[2/4] channels-last=on_arch=nosuchnet ... FAILED (exit 2)" in proc.stdout, proc.stdout
    assert "[3/4] channels-last=off_arch=resnet18 ... done" in proc.stdout, proc.stdout  # the others went on
    sweep = tmp_path / "runs" / "s"
    assert json.loads((sweep / "channels-last=on_arch=nosuchnet" / "status.json").read_text())["state"] == "failed"
    calls = (tmp_path / "py" / "python.calls").read_text().splitlines()
    assert len(calls) == 4 and all(call.startswith(f"-u {ROOT / 'dlojz.py'} ") for call in calls), calls

    proc = lab("compare", "runs/s", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {row["run"]: row for row in read_csv(sweep / "compare.csv")}
    assert set(rows) == {"channels-last=on_arch=resnet18", "channels-last=on_arch=nosuchnet",
                         "channels-last=off_arch=resnet18", "channels-last=off_arch=nosuchnet"}  # fmt: skip
    assert rows["channels-last=off_arch=nosuchnet"]["state"] == "failed (exit 2)"
    assert rows["channels-last=off_arch=nosuchnet"]["img_s"] == ""
    for name in ("channels-last=on_arch=resnet18", "channels-last=off_arch=resnet18"):
        metrics = json.loads((sweep / name / "metrics.json").read_text())
        row = rows[name]
        assert row["state"] == "done" and row["channels-last"] == name.split("=")[1].split("_")[0]
        assert float(row["img_s"]) == metrics["chrono"]["throughput_img_s"]
        assert float(row["step_ms"]) == pytest.approx(1e3 * metrics["chrono"]["step_median_s"])
        assert float(row["val_top1"]) == metrics["val_accuracy"]
        assert float(row["peak_memory_gib"]) == pytest.approx(metrics["chrono"]["peak_memory_bytes"] / 2**30)
        assert (sweep / name / "chrono_trace.json").exists()  # --test: the chronometer's trace beside it
    for png in ("throughput_memory.png", "phases.png"):
        assert (sweep / png).stat().st_size > 5_000, png
    assert "run(s) without figures" in proc.stdout and "nosuchnet" in proc.stdout
    status = lab("status", "s", cwd=tmp_path)
    assert status.returncode == 0 and "failed (exit 2)" in status.stdout and "done" in status.stdout


def fake_rows():
    """Four runs of a 2 x 2 sweep, as rows() gives them."""
    rows = []
    for k, (bs, cl) in enumerate([("4", "on"), ("4", "off"), ("8", "on"), ("8", "off")]):
        history = [
            dict(elapsed_s=10.0 * (k + 1) * e, val_accuracy=0.1 * e + 0.01 * k, val_macro_f1=0.1 * e - 0.01 * k)
            for e in (1, 2, 3)
        ]
        rows.append(
            {
                "sweep": "s",
                "run": f"batch-size={bs}_channels-last={cl}",
                "state": "done",
                "batch-size": bs,
                "channels-last": cl,
                "img_s": 100.0 + 10 * k,
                "peak_memory_gib": 1.0 + k,
                "step_ms": 40.0 + k,
                "load_ms": 2.0,
                "forward_ms": 12.0,
                "backward_ms": 20.0 + k,
                "history": history,
                "val_top1": history[-1]["val_accuracy"],
                "val_macro_f1": history[-1]["val_macro_f1"],
            }  # fmt: skip
        )
    rows.append({"sweep": "s", "run": "queued", "state": "queued", "batch-size": "16", "channels-last": "on"})
    return rows


def test_the_plots_draw_every_run_s_figures():
    rows = fake_rows()
    fig = dlojz_lib.lab.report.plot_throughput(rows)
    drawn = {}
    for ax in fig.axes[0::2]:  # the first swept flag's column (batch-size): img/s above, memory below
        for line in ax.lines:
            drawn.setdefault(ax.get_ylabel(), {})[line.get_label()] = list(line.get_ydata())
    assert drawn["images / s"] == {"channels-last=on": [100.0, 120.0], "channels-last=off": [110.0, 130.0]}
    assert drawn["peak memory (GiB)"] == {"channels-last=on": [1.0, 3.0], "channels-last=off": [2.0, 4.0]}
    fig = dlojz_lib.lab.report.plot_phases(rows)
    heights = [[patch.get_height() for patch in container] for container in fig.axes[0].containers]
    assert heights[0] == [2.0] * 4 and heights[2] == [20.0, 21.0, 22.0, 23.0]
    assert [sum(column) for column in zip(*heights)] == [42.0, 43.0, 44.0, 45.0]  # load + step, each run
    fig = dlojz_lib.lab.report.plot_accuracy(rows)
    assert [list(line.get_ydata()) for line in fig.axes[0].lines][3] == pytest.approx([13.0, 23.0, 33.0])
    assert len(fig.axes[0].lines) == 4  # the queued run has no history
    # --metric macro_f1: the plot and the best run follow it (here the first run, the last by top-1).
    fig = dlojz_lib.lab.report.plot_accuracy(rows, "macro_f1")
    assert [list(line.get_ydata()) for line in fig.axes[0].lines][3] == pytest.approx([7.0, 17.0, 27.0])
    assert fig.axes[0].get_ylabel() == "validation macro-F1 (%)"
    assert dlojz_lib.lab.report.best_run(rows, "macro_f1") == "best macro-F1: batch-size=4_channels-last=on (30.0 %)"
    assert dlojz_lib.lab.report.best_run(rows) == "best top-1: batch-size=8_channels-last=off (33.0 %)"


@pytest.mark.parametrize(
    "grid, message",
    [
        (["bath-size=4,8"], "--grid 'bath-size=4,8': dlojz.py has no flag --bath-size; did you mean batch-size"),
        (["batch-size=8,0"], "run batch-size=0: argument -b/--batch-size: must be >= 1 (got 0)"),
        (["channels-last=yes,no"], "--channels-last is a switch: its values are on and off"),
        (["output-dir=a,b"], "--grid output-dir: each run's --output-dir is the lab's"),
        (["batch-size"], "give FLAG=V1,V2,..."),
        (["batch-size=4,8,4"], "--grid 'batch-size=4,8,4': 4 given twice; give each value once"),
    ],
)
def test_a_bad_grid_is_one_line_before_anything_runs(tmp_path, monkeypatch, capsys, grid, message):
    monkeypatch.chdir(tmp_path)
    args = ["sweep", "--name", "bad"] + [f"--grid={g}" for g in grid] + ["--", *RUN]
    assert dlojz_lab.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "runs").exists()  # nothing written, nothing run


def test_ranks_started_by_the_lab_on_slurm_are_one_line_before_anything_runs(tmp_path, monkeypatch, capsys):
    """--nproc-per-node starts a local run's ranks; on Slurm the job's tasks are them: said in one line."""
    monkeypatch.chdir(tmp_path)
    argv = ["sweep", "--name", "n", "--launch", "slurm", "--nproc-per-node", "2", "--grid=batch-size=4,8", "--"]
    assert dlojz_lab.main(argv) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1 and "--nproc-per-node 2 starts local runs' ranks" in err and "--ntasks-per-node 2" in err
    )
    assert not (tmp_path / "runs").exists()


def test_a_python_that_is_not_there_is_one_line_before_anything_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert dlojz_lab.main(["sweep", "--name", "p", "--python", "venv/bin/pyhton", "--grid=batch-size=4,8", "--"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: --python venv/bin/pyhton: not an executable; give the path" in err, err
    assert not (tmp_path / "runs").exists()


def test_follow_waits_for_the_queue_and_names_a_task_that_never_started(tmp_path, monkeypatch):
    """A task still in Slurm's queue is waited for; one gone from it without a status (its environment script failed,
    say) is said once, with its Slurm log, and does not keep follow() waiting."""
    sweep = tmp_path / "runs" / "q"
    runs = [dict(name=f"batch-size={b}", settings={"batch-size": b}, argv=[]) for b in ("4", "8")]
    sweep.mkdir(parents=True)
    (sweep / "sweep.json").write_text(json.dumps(dict(name="q", runs=runs, job_id="77")))
    sweeps.write_status(sweep / "batch-size=4", state="done", exit=0)
    queues = iter([{1: ("PENDING", "0:00")}, {1: ("RUNNING", "0:05")}, {}])
    monkeypatch.setattr(sweeps, "queue_states", lambda job: next(queues))
    said = []
    final = sweeps.follow(sweep, every=0, say=said.append)
    assert [line.split("  ", 1)[1] for line in said] == [
        "batch-size=4: done",
        "batch-size=8: pending",
        "batch-size=8: running",
        "batch-size=8: never started (slurm_77_1.out)",
    ]
    assert final[1] == ("batch-size=8", "never started (slurm_77_1.out)")


def test_a_local_run_whose_process_is_gone_is_interrupted_not_running(tmp_path):
    sweep = tmp_path / "runs" / "gone"
    runs = [dict(name=f"batch-size={b}", settings={"batch-size": b}, argv=[]) for b in ("4", "8")]
    sweep.mkdir(parents=True)
    (sweep / "sweep.json").write_text(json.dumps(dict(name="gone", runs=runs)))
    ended = subprocess.Popen(["true"])
    ended.wait()  # a pid no process has now
    host = socket.gethostname()
    sweeps.write_status(sweep / "batch-size=4", state="running", pid=ended.pid, host=host)
    sweeps.write_status(sweep / "batch-size=8", state="running", pid=os.getpid(), host=host)
    assert sweeps.states(sweep) == [
        ("batch-size=4", "interrupted (its process is gone)"),
        ("batch-size=8", "running"),
    ]


def test_ctrl_c_during_a_local_run_stops_it_and_says_stopped(tmp_path, monkeypatch):
    """Ctrl-C while the lab waits for a run: the run is told (SIGINT: it checkpoints), waited for, and its status is
    `stopped`, not `running` for good; the KeyboardInterrupt goes on to the command's one line."""
    sweep = tmp_path / "runs" / "ctrl-c"
    sweep.mkdir(parents=True)
    runs = [dict(name="batch-size=4", settings={"batch-size": "4"}, argv=[])]
    (sweep / "sweep.json").write_text(json.dumps(dict(name="ctrl-c", runs=runs, python=sys.executable)))
    (sweep / "batch-size=4").mkdir()
    told = []

    class Run:  # a dlojz.py run: Ctrl-C reaches the lab while it waits, the run then ends with 130
        pid, returncode = os.getpid(), None

        def __init__(self, *args, **kwargs):
            self.waits = 0

        def wait(self, timeout=None):
            self.waits += 1
            if self.waits == 1:
                raise KeyboardInterrupt
            self.returncode = 130
            return 130

        def poll(self):
            return self.returncode

        def send_signal(self, signum):
            told.append(signum)

    monkeypatch.setattr(sweeps.subprocess, "Popen", Run)  # (the same module as checks.subprocess)
    with pytest.raises(KeyboardInterrupt):
        sweeps.run_one(sweep, 0)
    assert told == [signal.SIGINT]
    assert sweeps.read_status(sweep / "batch-size=4")["state"] == "stopped"
    assert sweeps.states(sweep) == [("batch-size=4", "stopped (Ctrl-C; --resume auto goes on from its checkpoint)")]


def test_every_command_ends_on_ctrl_c_in_one_line_with_130(monkeypatch, capsys):
    """Every sibling command (found by name: dlojz_*.py) goes through the one door: Ctrl-C anywhere in it (here in
    its argument parsing) is one line naming it and exit status 130, never a traceback."""
    import argparse
    import importlib

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    for method in ("parse_args", "parse_intermixed_args", "parse_known_args"):
        monkeypatch.setattr(argparse.ArgumentParser, method, interrupted)
    commands = sorted(path.stem for path in ROOT.glob("dlojz_*.py"))
    assert len(commands) >= 8, commands
    for name in commands:
        module = importlib.import_module("dlojz_lib.observers.chrono_report" if name == "dlojz_chrono" else name)
        assert module.main(["--help"]) == 130, name
        err = capsys.readouterr().err
        assert err == f"{name}.py: interrupted (Ctrl-C): stopped, nothing half-written left\n", (name, err)


@pytest.mark.parametrize("flag", ["--nodes", "--ntasks-per-node", "--gpus-per-node", "--cpus-per-task"])
def test_the_sweep_s_slurm_counts_are_whole_numbers_of_at_least_one(flag, capsys):
    """What the sbatch script would get: 0, -1, nan, inf and 2.5 refused in one line naming the flag; 2 taken."""
    for value in ("0", "-1", "nan", "inf", "2.5"):
        with pytest.raises(SystemExit) as exit:
            dlojz_lab.get_parser().parse_args(["sweep", "--name", "x", flag, value])
        err = capsys.readouterr().err.strip()
        assert exit.value.code == 2 and err.count("\n") == 0 and flag in err, (value, err)
    assert (
        getattr(dlojz_lab.get_parser().parse_args(["sweep", "--name", "x", flag, "2"]), flag[2:].replace("-", "_")) == 2
    )


PLANNED = ["plan", "--arch", "timm:test_vit", "--image-size", "32", "--num-classes", "3", "--nodes", "2",
           "--gpus-per-node", "2", "-b", "8"]  # fmt: skip


def test_the_planner_prints_every_layout_it_can_run_and_picks_the_fastest_that_fits(capsys):
    """dlojz_lab.py plan (dlojz_lib/parallelism/plan.py) on 2 nodes of 2 GPUs: a row for DDP, FSDP, HSDP over the
    nodes, TP 2 and PP 2 and 4 with FSDP, PP 2 x TP 2; the layouts that fit first, fastest first; the pick names the
    first. HSDP holds what FSDP within one node holds, and sends less across nodes than FSDP over all 4."""
    from dlojz_lib.parallelism.plan import GPUS, Allocation, LayoutTable, plan

    assert dlojz_lab.main(PLANNED) == 0
    out = capsys.readouterr().out
    layouts = [line.split("  ")[0] for line in out.splitlines()[2:] if line[:1].isupper() and "  " in line]
    assert set(layouts) >= {"DDP", "FSDP", "HSDP 2 x FSDP 2", "TP 2 x FSDP 2", "PP 2 x FSDP 2", "PP 4 x FSDP 1",
                            "PP 2 x TP 2 x FSDP 1"}, out  # fmt: skip
    assert out.splitlines()[-1].startswith(f"pick: {layouts[0]} ("), out
    settings, allocation = LayoutTable("timm:test_vit", 32, 3, 8), Allocation(2, **dict(GPUS["h100"], gpus_per_node=2))
    rows = {row["layout"]: row for row in plan(settings, allocation)[0]}
    speeds = [row["images_per_gpu_s"] for row in rows.values()]
    assert speeds == sorted(speeds, reverse=True) and list(rows) == layouts  # (all fit: fastest first)
    one_node = plan(settings, Allocation(1, **dict(GPUS["h100"], gpus_per_node=2)))[0]
    fsdp_in_a_node = next(row for row in one_node if row["layout"] == "FSDP")
    for key in ("parameter_bytes", "gradient_bytes", "optimizer_bytes"):
        assert rows["HSDP 2 x FSDP 2"][key] == fsdp_in_a_node[key] > rows["FSDP"][key], key  # (about 2x)
    assert rows["HSDP 2 x FSDP 2"]["inter_bytes"] < rows["FSDP"]["inter_bytes"]
    # the ranks laid out as dlojz.py's mesh: a tensor group inside a node, a pipeline of 2 x 2 across the two
    three_d = rows["PP 2 x TP 2 x FSDP 1"]
    assert three_d["intra_bytes"] == three_d["sent_by_group"]["tensor"] > 0
    assert three_d["inter_bytes"] == three_d["sent_by_group"]["pipe"] + three_d["sent_by_group"]["data"] > 0
    assert rows["TP 2 x FSDP 2"]["inter_bytes"] == rows["TP 2 x FSDP 2"]["sent_by_group"]["data"] > 0


def test_the_planner_says_when_no_layout_fits(capsys):
    """With 1 MiB a GPU nothing fits: one line names the smallest layout and how far over it is; exit 1."""
    assert dlojz_lab.main([*PLANNED, "--gpu-memory", str(1 / 1024)]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("no layout fits in 0.0009766 GiB a GPU: the smallest, "), last
    assert "GiB over); add GPUs or activation checkpointing, or take a smaller -b" in last


def test_the_planner_adds_activation_checkpointing_where_a_layout_does_not_fit_without(capsys):
    """With 150 MiB a GPU and -b 4096, no layout fits with every activation kept: each comes again with
    --activation-checkpointing selective, then full where selective does not fit either (its activations smaller,
    its step a third longer on the roofline); the pick is one of them. A layout named with --layout says whether it
    fits and by how much not; a name not in the table is one line, exit 2."""
    from dlojz_lib.parallelism.plan import GPUS, Allocation, LayoutTable, plan

    argv = [*PLANNED[:-2], "-b", "4096", "--gpu-memory", str(150 / 1024)]
    assert dlojz_lab.main(argv) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0]: line.split() for line in out.splitlines()[2:] if line[:1].isupper() and "  " in line}
    assert {"DDP + AC selective", "DDP + AC full", "FSDP + AC full"} <= set(rows), out
    assert [rows[name][-6] for name in ("DDP", "DDP + AC selective", "DDP + AC full")] == ["no", "no", "yes"], out
    settings = LayoutTable("timm:test_vit", 32, 3, 4096)
    allocation = Allocation(2, **dict(GPUS["h100"], gpus_per_node=2, gpu_memory_gib=150 / 1024))
    found = {row["layout"]: row for row in plan(settings, allocation)[0]}
    kept, selective, full = (found[name] for name in ("DDP", "DDP + AC selective", "DDP + AC full"))
    assert kept["activation_bytes"] > selective["activation_bytes"] > full["activation_bytes"]
    assert full["compute_s"] == pytest.approx(kept["compute_s"] * 4 / 3) and selective["compute_s"] == kept["compute_s"]
    assert dlojz_lab.main([*argv, "--layout", "DDP"]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("DDP: does not fit: ") and "GiB over the 0.1465 GiB of a GPU; pick: " in last, last
    assert dlojz_lab.main([*argv, "--layout", "DDP + AC full"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("DDP + AC full: fits, ")
    assert dlojz_lab.main([*argv, "--layout", "ZeRO-3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dlojz_lab.py: error: --layout ZeRO-3: not a layout of this allocation's table; give one of:")
    assert "DDP + AC full" in err.split("give one of: ")[1].split(", ") and "\n" not in err, err


def test_the_planner_adds_float8_rows_where_the_gpu_has_float8(capsys):
    """ViT-H/14 (its block linears above torchao's sizes): on A100s no float8 row (no float8 there: --float8-tflops
    refused); on H100s given --float8-tflops, DDP and FSDP come again with --float8, faster (their linears at that
    peak), and no TP or PP row does (dlojz.py refuses --float8 beside --tp and --pp)."""
    argv = [
        "plan",
        "--arch",
        "timm:vit_huge_patch14_224",
        "--image-size",
        "28",
        "--gpu",
        "a100",
        "--gpus-per-node",
        "2",
    ]
    assert dlojz_lab.main(argv) == 0
    assert "+ float8  " not in capsys.readouterr().out
    assert dlojz_lab.main([*argv, "--float8-tflops", "624"]) == 2  # (dlojz.py's --float8 refuses an A100)
    assert "--float8-tflops: an A100 has no float8" in capsys.readouterr().err
    argv[argv.index("a100")] = "h100"  # (a GPU with float8, at the figures given)
    assert dlojz_lab.main([*argv, "--tflops", "312", "--float8-tflops", "624"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0]: line.split() for line in out.splitlines()[2:] if line[:1].isupper() and "  " in line}
    assert {"DDP + float8", "FSDP + float8"} <= set(rows) and not any(
        name.startswith(("TP", "PP")) and "float8" in name for name in rows
    ), out
    assert float(rows["FSDP + float8"][-2]) < float(rows["FSDP"][-2]), out  # step ms


def test_batch_per_copy_gives_the_planner_dlojz_py_s_meaning_of_b(capsys):
    """dlojz_lab.py plan's -b counts a GPU's images (a pipeline of p stages takes -b x p, in 8 micro-batches);
    with --batch-per-copy it counts a model copy's, as dlojz.py's -b and --layout auto do (a pipeline takes -b, in
    2 p micro-batches): the pipelines' rows then are the rows --layout auto ranks, and differ from the per-GPU ones."""
    from dlojz_lib.parallelism.plan import GPUS, Allocation, LayoutTable, plan

    def pipeline_rows(extra):
        assert dlojz_lab.main([*PLANNED, *extra]) == 0
        lines = capsys.readouterr().out.splitlines()
        return {line.split("  ")[0]: line.split()[-3:] for line in lines if line.startswith("PP ")}, lines[0]

    per_gpu, said_gpu = pipeline_rows([])
    per_copy, said_copy = pipeline_rows(["--batch-per-copy"])
    assert "-b 8 a GPU" in said_gpu and "-b 8 a model copy (as dlojz.py)" in said_copy
    assert per_gpu.keys() == per_copy.keys() and per_gpu != per_copy
    settings = LayoutTable("timm:test_vit", 32, 3, 8, pp_microbatches=None, batch_per_copy=True)
    rows = plan(settings, Allocation(2, **dict(GPUS["h100"], gpus_per_node=2)))[0]
    for row in rows:
        if row["layout"] in per_copy:
            assert per_copy[row["layout"]][1] == f"{row['step_s'] * 1e3:.2f}", row["layout"]


def test_ctrl_c_while_a_command_imports_torch_is_one_line(tmp_path):
    """Ctrl-C in the seconds a command takes to import torch (a torch here whose import raises KeyboardInterrupt):
    every sibling command run as a script, given flags that reach its work, ends in one line (130, or its one-line
    refusal of the missing inputs), never a traceback; dlojz_fsdp.py's and dlojz_chrono.py's imported torch before
    their door was open."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise KeyboardInterrupt\n")
    env = dict(clean_env(), PYTHONPATH=f"{fake.parent}{os.pathsep}{ROOT}")
    given = {"dlojz_fsdp.py": ["consolidate", "ckpt_e0001_s000000001.dcp", "out.pt"],
             "dlojz_chrono.py": ["plot", "trace.json", "-o", "t.png"], "dlojz_lab.py": ["plan", "--arch", "resnet18"],
             "dlojz_predict.py": ["ckpt.pt", "imgs"], "dlojz_export.py": ["ckpt.pt", "-o", "out"]}  # fmt: skip
    reached = []
    for path in sorted(ROOT.glob("dlojz_*.py")):
        proc = subprocess.run([sys.executable, str(path), *given.get(path.name, [])], capture_output=True, text=True,
                              cwd=tmp_path, env=env, timeout=120)  # fmt: skip
        assert "Traceback" not in proc.stderr and proc.returncode in (2, 130), (path.name, proc.stderr[-2000:])
        assert len(proc.stderr.strip().splitlines()) == 1, (path.name, proc.stderr)
        if proc.returncode == 130:
            assert proc.stderr == f"{path.name}: interrupted (Ctrl-C): stopped, nothing half-written left\n"
            reached.append(path.name)
    assert {"dlojz_fsdp.py", "dlojz_lab.py", "dlojz_predict.py", "dlojz_export.py"} <= set(reached), reached


@pytest.mark.parametrize("flag", ["--tflops", "--float8-tflops", "--nvlink-gbs", "--network-gbs", "--gpu-memory"])
def test_the_planner_s_speeds_and_memory_are_above_zero(flag, capsys):
    """0 (a division by it once) and -1 refused in one line naming the flag, exit 2; 1 taken."""
    for value in ("0", "-1"):
        with pytest.raises(SystemExit) as exit:
            dlojz_lab.get_parser().parse_args([*PLANNED, flag, value])
        err = capsys.readouterr().err.strip()
        assert exit.value.code == 2 and "\n" not in err and f"argument {flag}: must be > 0" in err, (value, err)
    assert dlojz_lab.main([*PLANNED, flag, "1"]) in (0, 1)  # (1 GiB a GPU may fit nothing: exit 1, said)


def test_the_planner_refuses_what_dlojz_py_refuses_in_its_words(capsys):
    """A model that cannot take the images (torchvision's ViT-B/16 at 30 px), an unknown model, float8 on an A100
    (dlojz.py's --float8 refuses it): one line each, exit 2, before any row; the first two in dlojz.py's words."""
    from dlojz_lib.checks import UserError
    from dlojz_lib.model.zoo import check_input_sizes

    with pytest.raises(UserError) as dlojz_py_says:
        check_input_sizes("vit_b_16", False, [30])
    cases = [
        (["--arch", "vit_b_16", "--image-size", "30"], str(dlojz_py_says.value)),
        (["--arch", "vit_b_1"], "--arch vit_b_1: not a torchvision classification model"),
        (["--arch", "resnet18", "--gpu", "a100", "--float8-tflops", "500"], "--float8-tflops: an A100 has no float8"),
    ]
    for argv, said in cases:
        assert dlojz_lab.main(["plan", *argv]) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith(f"dlojz_lab.py: error: {said}"), captured.err
        assert len(captured.err.strip().splitlines()) == 1
