"""What a run tells its user as it goes and leaves beside its results: the progress line's learning rate and
data-loading wait, the run's arguments as a recipe file, pin_memory as it is, the host allocator's setting."""

import re

import pytest
from conftest import SMALL, TINY, read_json, run_dlojz, show


def progress_lines(stdout):
    return [line for line in stdout.splitlines() if line.startswith("Epoch ") and ", Step " in line]


def test_progress_line_carries_the_learning_rate_and_the_data_wait(tiny_data, tmp_path):
    """The LR on each line is the schedule's (a constant 0.0371 here, then cosine's), and the data wait agrees with
    the chronometer's load time when the main process decodes (no workers): both time the same next()."""
    metrics = tmp_path / "m.json"
    common = [*SMALL, "--data-root", tiny_data, "-b", "4", "--test", "--no-wandb", "--output-dir", tmp_path / "run"]
    common[common.index("--num-workers") + 1] = "0"
    proc = run_dlojz(
        *common, "--test-nsteps", "12", "--lr", "0.0371", "--lr-scheduler", "constant", "--metrics-json", metrics
    )
    assert proc.returncode == 0, show(proc)
    lines = progress_lines(proc.stdout)
    assert len(lines) >= 2, proc.stdout
    assert all(", LR: 0.0371," in line for line in lines), lines
    waits = [float(re.search(r"Data wait: ([0-9.]+) ms/step \((\d+) %\)", line).group(1)) for line in lines]
    assert all(w > 0 for w in waits), lines
    m = read_json(metrics)
    step_ms = 1e3 * m["global_batch_size"] / m["images_per_second"]  # wall time per step, the wait included
    # a part of the step, whatever the machine's load (that it is the chronometer's next() is the test below's)
    assert 0 < m["data_wait_ms"] < step_ms and m["chrono"]["load_median_s"] > 0, (m["data_wait_ms"], step_ms)

    # a decaying schedule: the LR printed falls from line to line
    proc = run_dlojz(*common, "--test-nsteps", "18", "--lr", "0.2", "--lr-scheduler", "cosine")
    assert proc.returncode == 0, show(proc)
    lrs = [float(line.split(", LR: ")[1].split(",")[0]) for line in progress_lines(proc.stdout)]
    assert len(lrs) >= 2 and all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[0] <= 0.2, lrs


def test_the_data_wait_is_the_chronometer_s_load_phase():
    """The loop's data wait times each next() inside the chronometer's data-loading phase: never less than the
    time the batches took to come (each pauses 20 ms, and a pause never ends early), never more than the phase."""
    import time

    from dlojz_lib.observers.hooks import LoopHooks

    class Phases:
        def __init__(self):
            self.opened, self.seconds = None, 0.0

        def dataload(self):
            if self.opened is None:
                self.opened = time.perf_counter()
            else:
                self.seconds, self.opened = self.seconds + time.perf_counter() - self.opened, None

    def batches():
        for index in range(5):
            time.sleep(0.02)
            yield index

    chrono = Phases()
    hooks = LoopHooks(chrono)
    assert list(hooks.loading(batches())) == [0, 1, 2, 3, 4]
    assert 5 * 0.02 <= hooks.data_wait_s <= chrono.seconds, (hooks.data_wait_s, chrono.seconds)


def test_the_arguments_of_a_run_are_saved_as_a_recipe_that_runs_it_again(tiny_data, tmp_path):
    """args.toml in the output folder holds the recipe's values, the command line's (which win) and the profile's;
    `--config args.toml` reads back the same flags. pin_memory is reported False on a CPU, where it does nothing."""
    from dlojz_lib.settings.flags import get_args_parser
    from dlojz_lib.settings.recipe import recipe_text

    recipe = tmp_path / "recipe.toml"
    recipe.write_text('label-smoothing = 0.05\nlr = 0.5\noptimizer = "adamw"\n')
    out = tmp_path / "run"
    proc = run_dlojz(
        *SMALL,
        "--config",
        recipe,
        "--data-root",
        tiny_data,
        "-b",
        "4",
        "--lr",
        "0.0371",
        "--test",
        "--test-nsteps",
        "2",
        "--no-wandb",
        "--output-dir",
        out,
    )
    assert proc.returncode == 0, show(proc)
    saved = out / "args.toml"
    assert f"arguments: {saved}" in proc.stdout, proc.stdout
    assert "pin_memory=False" in proc.stdout and "pin_memory=True" not in proc.stdout
    assert "host memory: freed memory kept for reuse" in proc.stdout  # tests/system/test_host_memory.py: what it does
    text = saved.read_text()
    body = [line for line in text.splitlines() if not line.startswith("#")]
    assert "lr = 0.0371" in body and "label-smoothing = 0.05" in body and 'optimizer = "adamw"' in body
    assert "val-batch-size = 64" in body  # the CPU profile's value, given by neither
    assert f'data-root = "{tiny_data}"' in body and "batch-size = 4" in body and "pin-memory = false" in body
    assert "config = " not in text
    parser = get_args_parser()
    again = parser.parse_args(["--config", str(saved)])
    assert recipe_text(again, parser).splitlines() == body


def test_the_data_wait_share_leaves_the_epoch_change_out():
    """A line's share of time spent waiting for data counts from the epoch's start, not across the validation and
    the workers' restart that came before it."""
    import time

    import torch

    from dlojz_lib.log import NoWandb, Progress

    class Lines:
        def __init__(self):
            self.lines = []

        def progress(self, line, end_of_epoch):
            self.lines.append(line)

    console = Lines()
    progress = Progress(console, NoWandb(), torch.device("cpu"), 2, 4, 1, 8)
    progress.micro_steps = 4
    progress.console_line(0, 3, 0.1, data_wait_s=0.0)
    time.sleep(0.6)  # the validation between the two epochs
    progress.new_epoch(0.0)
    time.sleep(0.02)
    progress.micro_steps = 8
    progress.console_line(1, 3, 0.1, data_wait_s=0.015)  # 15 ms of the ~20 ms since the epoch began
    share = int(re.search(r"\((\d+) %\)", console.lines[-1]).group(1))
    assert share >= 10, console.lines[-1]  # counted from the previous line: under 3 %
    assert "Data wait: 3.8 ms/step" in console.lines[-1]


def tensorboard_scalars(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_gets_w_and_b_s_scalars_and_a_resumed_run_appends(tiny_data, tmp_path):
    """--tensorboard: the training scalars every 10 steps (loss, accuracy, learning rate, then img/s and the data
    wait once past the warm-up), validation's at each epoch (the per-class summaries too), in the output folder's
    tensorboard/; the run resumed for a third epoch writes on in the same folder from its step."""
    flags = [*TINY, "--data-root", tiny_data, "--output-dir", tmp_path / "run", "--lr-scheduler", "cosine", "-b", "4"]
    proc = run_dlojz(*flags, "--epochs", "2", "--tensorboard")
    assert proc.returncode == 0, show(proc)
    scalars = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    for tag in ("train loss", "train accuracy", "learning rate", "test accuracy", "test loss", "test macro-F1"):
        assert tag in scalars, (tag, sorted(scalars))
    assert [step for step, _ in scalars["test accuracy"]] == [18, 36]  # 18 steps an epoch
    assert [step for step, _ in scalars["train loss"]] == [10, 20, 30]
    assert [step for step, _ in scalars["images per second"]] == [20, 30] and scalars["images per second"][0][1] > 0
    proc = run_dlojz(*flags, "--epochs", "3", "--tensorboard", "--resume", "auto")
    assert proc.returncode == 0, show(proc)
    scalars = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    assert [step for step, _ in scalars["test accuracy"]] == [18, 36, 54]
    assert [step for step, _ in scalars["train loss"]] == [10, 20, 30, 40, 50]
    proc = run_dlojz(*TINY, "--data-root", tiny_data, "--output-dir", tmp_path / "plain", "--epochs", "1")
    assert proc.returncode == 0 and not (tmp_path / "plain" / "tensorboard").exists()  # only when asked


def test_tensorboard_in_a_folder_of_its_own_and_the_chronometer_s_summary(tiny_data, tmp_path):
    proc = run_dlojz(
        *TINY, "--data-root", tiny_data, "--test", "--test-nsteps", "4", "--tensorboard", tmp_path / "tb",
        "--output-dir", tmp_path / "run",
    )  # fmt: skip
    assert proc.returncode == 0, show(proc)
    scalars = tensorboard_scalars(tmp_path / "tb")
    assert any(tag.startswith("chrono/") for tag in scalars), sorted(scalars)


@pytest.mark.parametrize(
    "layout, said",
    [
        (dict(parallel="fsdp"), "(FSDP, sharded over 4 ranks)"),
        (
            dict(parallel="fsdp", fsdp_replicas=2),
            "(HSDP 2 x FSDP 2, sharded over 2 ranks in each of 2 replicas (HSDP))",
        ),
        (dict(parallel="fsdp", fsdp_replicas=4), "(HSDP 4 x FSDP 1, not sharded (HSDP: 4 whole copies))"),
        (dict(parallel="tp", tensor_parallel_size=2), "(TP 2 x FSDP 2: blocks split over groups of 2, sharded over 2"),
        (
            dict(parallel="tp", tensor_parallel_size=2, fsdp_replicas=2),
            "x FSDP 1: blocks split over groups of 2, not sharded (HSDP: 2 whole copies)",
        ),
        (
            dict(parallel="pp", pipeline_size=2, fsdp_replicas=2),
            "(PP 2 x HSDP 2 x FSDP 1: a stage each, not sharded (HSDP",
        ),
        (dict(parallel="pp", pipeline_size=4), "(PP 4 x FSDP 1: a stage each, not sharded (one data replica))"),
    ],
)
def test_the_end_of_run_line_says_how_each_layout_holds_the_state(layout, said):
    """The end-of-run state line of 4 ranks names the shards each replica's ranks hold (HSDP's are 1/N of a copy,
    not of all ranks), and says "not sharded" where the data replicas hold their part whole."""
    from dlojz_lib.log import memory_line

    sizes = dict(parameter_bytes_per_rank=1, gradient_bytes_per_rank=1, optimizer_bytes_per_rank=1)
    line = memory_line({**sizes, "peak_memory_bytes_per_rank": [1, 1, 1, 1], **layout})
    assert said in line, line
