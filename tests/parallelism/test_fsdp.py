"""--fsdp (dlojz_fsdp.py): FSDP2 on 2 CPU ranks (gloo) trains to the weights of DDP and of one process, holds
half of the model's state per rank, validates exactly, writes sharded checkpoints that resume mid-epoch on another
number of ranks, survive a crash mid-write and consolidate into one ordinary checkpoint."""

import shutil
import signal
import subprocess

import preloaded
import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, clean_env, read_json, run_dlojz, script_python, show
from test_dlojz import assert_one_line_error
from test_resume import start_ranks, wait_for_line

import dlojz_lib.checkpoint as ckpt
from dlojz_lib.model.zoo import create_model

# A small vision transformer (timm's test_vit: no BatchNorm, no dropout). 72 training images: 5 steps of a global
# batch of 16; 15 validation images in batches of 7: rank 0 has 2 batches, rank 1 one (8 and 7 images).
# SGD with momentum, not Adam: the runs compared here differ only in the order of floating-point sums (one process,
# DDP's all-reduce, FSDP's reduce-scatter, the CPU's vector width), and SGD's step is linear in the gradient, so
# that noise stays at float32's rounding. Adam divides each step by the gradient's own root mean square: where the
# true gradient is zero (the key bias of attention: softmax ignores a shift shared by every key) the step is rounding
# noise scaled up to a fraction of the learning rate, and no tolerance below the learning rate is a property of the code.
BASE = [
    "--device",
    "cpu",
    "--arch",
    "timm:test_vit",
    "--image-size",
    "32",
    "--val-resize-size",
    "36",
    "--val-crop-size",
    "32",
    "--num-workers",
    "1",
    "--no-wandb",
    "--epochs",
    "1",
    "--optimizer",
    "sgd",
    "--lr",
    "0.05",
    "--val-batch-size",
    "7",
    "--dist-timeout",
    "120",
]


def checkpoint(path):
    """A checkpoint (the latest of a folder), a sharded one consolidated first."""
    path = ckpt.load_latest(path)[1] if path.is_dir() and not path.name.endswith(".dcp") else path
    if path.name.endswith(".dcp"):
        from dlojz_fsdp import consolidate

        target = path.with_suffix(".consolidated.pt")
        path = target if target.is_file() else consolidate(path, target)
    return torch.load(path, weights_only=True)


def weights(path):
    """The model's weights of a checkpoint, a sharded one consolidated first."""
    return checkpoint(path)["model"]


def consolidate_command(source, target):
    """dlojz_fsdp.py consolidate as a command (a fork of the preloaded server where it can be: script_python)."""
    return subprocess.run(
        [*script_python(), str(ROOT / "dlojz_fsdp.py"), "consolidate", str(source), str(target)],
        capture_output=True,
        text=True,
        env=clean_env(),
        timeout=300,
    )


def consolidate_inline(source, target, capsys):
    """`python dlojz_fsdp.py consolidate SOURCE TARGET` in this process (no process group: one reader)."""
    from types import SimpleNamespace

    from dlojz_fsdp import main

    status = main(["consolidate", str(source), str(target)])
    out = capsys.readouterr()
    return SimpleNamespace(returncode=status, stdout=out.out, stderr=out.err)


def assert_same_weights(a, b, atol=2e-6):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key].float(), b[key].float(), atol=atol, rtol=1e-5), (
            key,
            (a[key] - b[key]).abs().max(),
        )


@pytest.fixture(scope="module")
def runs(tiny_data, tmp_path_factory):
    """The same training as one process (global batch 16), DDP on 2 ranks and FSDP on 2 ranks (8 per rank), eager
    and with --compile."""
    out = tmp_path_factory.mktemp("fsdp")
    common = [*BASE, "--data-root", tiny_data]
    for name, ranks, flags in (
        ("single", 1, ["-b", "16"]),
        ("ddp", 2, ["-b", "8"]),
        ("fsdp", 2, ["-b", "8", "--fsdp"]),
        ("fsdp-compiled", 2, ["-b", "8", "--fsdp", "--compile", "--no-drop-last"]),
    ):
        proc = run_dlojz(
            *common, *flags, "--output-dir", out / name, "--metrics-json", out / f"{name}.json", ranks=ranks
        )
        assert proc.returncode == 0, show(proc)
        (out / f"{name}.log").write_text(proc.stdout)
    return out


@pytest.mark.multirank
def test_fsdp_trains_to_the_weights_of_ddp_and_of_one_process(runs):
    fsdp = weights(runs / "fsdp")
    assert_same_weights(fsdp, weights(runs / "ddp"))
    assert_same_weights(fsdp, weights(runs / "single"))
    assert read_json(runs / "fsdp.json")["steps"] == 5
    log = (runs / "fsdp.log").read_text()
    assert "FSDP: 6 blocks and the root sharded over 2 ranks" in log, log
    assert (runs / "fsdp" / "ckpt_e0001_s000000005.dcp" / ckpt.SHARDED_META).is_file()


@pytest.mark.multirank
def test_fsdp_compiles_each_block_to_the_weights_of_eager(runs):
    """--compile under --fsdp compiles each block (one graph a block, between the tensor plan and FSDP, as torchtitan
    does), not the whole sharded model: the same weights as the eager FSDP run."""
    assert_same_weights(weights(runs / "fsdp-compiled"), weights(runs / "fsdp"))
    log = (runs / "fsdp-compiled.log").read_text()
    assert "torch.compile: each of 6 blocks (fullgraph, mode default), around them eager" in log, log


@pytest.mark.multirank
def test_fsdp_holds_half_of_the_model_state_per_rank(runs):
    ddp, fsdp = read_json(runs / "ddp.json"), read_json(runs / "fsdp.json")
    assert (ddp["parallel"], fsdp["parallel"]) == ("ddp", "fsdp")
    for key in ("parameter_bytes_per_rank", "gradient_bytes_per_rank", "optimizer_bytes_per_rank"):
        assert 0.45 < fsdp[key] / ddp[key] < 0.56, (key, fsdp[key], ddp[key])  # 1/2, and the shards' padding
    whole = sum(p.numel() for p in create_model("timm:test_vit", 3, False, 32).parameters())
    assert ddp["parameter_bytes_per_rank"] == 4 * whole  # float32, whole on each rank
    assert len(fsdp["peak_memory_bytes_per_rank"]) == 2
    assert "Model state per rank (FSDP, sharded over 2 ranks)" in (runs / "fsdp.log").read_text()


@pytest.mark.multirank
def test_uneven_validation_shards_are_exact_under_fsdp(runs):
    """Rank 1 has one batch fewer: it runs one uncounted forward (else rank 0's all-gather would wait forever)."""
    ddp, fsdp = read_json(runs / "ddp.json"), read_json(runs / "fsdp.json")
    assert fsdp["val_images"] == 15
    for key in ("val_loss", "val_accuracy", "val_top5_accuracy"):
        assert fsdp[key] == pytest.approx(ddp[key], abs=1e-5), key


@pytest.mark.multirank
def test_a_sharded_checkpoint_evaluates_on_one_rank_and_consolidates(runs, tiny_data, tmp_path, run_inline):
    sharded = runs / "fsdp" / "ckpt_e0001_s000000005.dcp"
    expected = read_json(runs / "fsdp.json")
    common = [*BASE, "--data-root", tiny_data, "--eval-only", "--metrics-json", tmp_path / "m.json"]
    proc = run_dlojz(*common, "--fsdp", "--resume", sharded)  # written by 2 ranks, read by 1
    assert proc.returncode == 0, show(proc)
    assert read_json(tmp_path / "m.json")["val_loss"] == pytest.approx(expected["val_loss"], abs=1e-5)

    target = tmp_path / "model.pt"
    done = consolidate_command(sharded, target)
    assert done.returncode == 0 and "written" in done.stdout, done.stderr
    saved = torch.load(target, weights_only=True)
    ddp = ckpt.load_latest(runs / "ddp")[0]  # an ordinary checkpoint of the same training
    assert saved["global_step"] == 5
    # the same hyper-parameters; which kernel steps them differs (torch has no fused SGD for sharded parameters)
    kernel = ("fused", "foreach")
    assert [{k: v for k, v in group.items() if k not in kernel} for group in saved["optimizer"]["param_groups"]] == [
        {k: v for k, v in group.items() if k not in kernel} for group in ddp["optimizer"]["param_groups"]
    ]
    for index, state in ddp["optimizer"]["state"].items():  # SGD's momentum, consolidated too
        assert torch.allclose(
            saved["optimizer"]["state"][index]["momentum_buffer"], state["momentum_buffer"], atol=1e-6
        ), index
    create_model("timm:test_vit", 3, False, 32).load_state_dict(saved["model"])  # an ordinary model takes it
    for flags in ([], ["--fsdp"]):  # an ordinary run, and a sharded one given the whole weights
        proc = run_dlojz(*common, "--resume", target, *flags)
        assert proc.returncode == 0, show(proc)
        assert read_json(tmp_path / "m.json")["val_loss"] == pytest.approx(expected["val_loss"], abs=1e-5)
    proc = run_dlojz(
        *BASE,
        "--data-root",
        tiny_data,
        "-b",
        "16",
        "--epochs",
        "2",
        "--resume",
        target,
        "--output-dir",
        tmp_path / "more",
    )  # DDP (here one process) training goes on from it
    assert proc.returncode == 0, show(proc)
    assert ckpt.load_latest(tmp_path / "more")[0]["global_step"] == 10

    proc = run_inline(*common, "--resume", sharded)  # without --fsdp (no process group: in this process)
    assert_one_line_error(proc, "a sharded checkpoint (written with --fsdp): add --fsdp, or make one ordinary")


def stopped_mid_epoch(args, out, steps=5):
    """Two ranks of a sharded run (`args`, `steps` a epoch) into `out`, Slurm's warning (SIGUSR1) to rank 0 once
    step 1 is logged: both exit 0 and the newest checkpoint is a sharded one, mid-epoch. Returns it."""
    rank0, rank1 = start_ranks([*args, "--output-dir", out])
    early = wait_for_line(rank0, f"Epoch 1/1, Step 1/{steps}")
    rank0.send_signal(signal.SIGUSR1)
    log = early + rank0.communicate(timeout=300)[0] + rank1.communicate(timeout=300)[0]
    assert rank0.returncode == 0 and rank1.returncode == 0, log
    stopped = ckpt.load_latest(out)[0]
    assert stopped["sharded_path"].endswith(".dcp") and 1 <= stopped["batch"] < steps, log
    return stopped


@pytest.mark.multirank
def test_an_fsdp_run_stopped_mid_epoch_resumes_on_one_rank_to_the_same_weights(runs, tiny_data, tmp_path):
    """Saved by 2 ranks x 8 images after a step or two, resumed by 1 process x 16: DCP reshards the model and the
    optimizer, and the epoch goes on after the images already trained on."""
    out = tmp_path / "run"
    stopped = stopped_mid_epoch([*BASE, "--data-root", tiny_data, "-b", "8", "--fsdp"], out)
    shutil.copytree(out, tmp_path / "by8")
    proc = run_dlojz(*BASE, "--data-root", tiny_data, "-b", "16", "--fsdp", "--output-dir", out, "--resume", "auto")
    assert proc.returncode == 0, show(proc)
    assert "a checkpoint written on 2 x 8: the epoch goes on after its first" in proc.stdout, proc.stdout
    assert_same_weights(weights(out), weights(runs / "fsdp"))
    # On 1 x 8 the epoch has 9 batches; 16 images per step were done, so 2 per step saved are skipped, and the
    # run counts the steps this setting would have made: it ends at its own schedule's end, step 9.
    proc = run_dlojz(
        *BASE, "--data-root", tiny_data, "-b", "8", "--fsdp", "--output-dir", tmp_path / "by8", "--resume", "auto"
    )
    assert proc.returncode == 0, show(proc)
    done = stopped["batch"]
    assert f"step {2 * done}/9, global step {2 * done})" in proc.stdout, proc.stdout
    final = ckpt.load_latest(tmp_path / "by8")[0]
    assert final["global_step"] == final["total_steps"] == final["scheduler"]["last_epoch"] == 9, proc.stdout


@pytest.mark.multirank
def test_fsdp_with_accumulation_checkpointing_and_no_reshard_trains_the_same(runs, tiny_data, tmp_path):
    """2 micro-batches of 4 per rank and step, activations recomputed, parameters kept gathered: same weights."""
    proc = run_dlojz(
        *BASE,
        "--data-root",
        tiny_data,
        "-b",
        "4",
        "--grad-acc",
        "2",
        "--grad-checkpointing",
        "--no-fsdp-reshard-after-forward",
        "--fsdp",
        "--output-dir",
        tmp_path / "run",
        "--metrics-json",
        tmp_path / "m.json",
        ranks=2,
    )
    assert proc.returncode == 0, show(proc)
    assert "kept gathered after each block's forward" in proc.stdout
    assert_same_weights(weights(tmp_path / "run"), weights(runs / "fsdp"))
    # validation's forwards gathered every block: freed afterwards, the shards alone remain
    fsdp = read_json(runs / "fsdp.json")
    assert read_json(tmp_path / "m.json")["parameter_bytes_per_rank"] == fsdp["parameter_bytes_per_rank"]


@pytest.mark.multirank
def test_lamb_and_gradient_clipping_step_on_shards_as_on_the_whole_model(tiny_data, tmp_path):
    """--clip-grad-norm and timm's LAMB (its own global-norm clipping, a trust ratio of norms per layer): computed on
    sharded parameters (DTensors), the norms are those of the whole tensors."""
    common = [*BASE, "--data-root", tiny_data, "--optimizer", "lamb", "--wd", "0.01", "--clip-grad-norm", "0.05"]
    for name, ranks, flags in (("single", 1, ["-b", "16"]), ("fsdp", 2, ["-b", "8", "--fsdp"])):
        proc = run_dlojz(*common, *flags, "--output-dir", tmp_path / name, ranks=ranks)
        assert proc.returncode == 0, show(proc)
    # LAMB's eps (1e-6) bounds how far it scales up the rounding noise of a zero gradient, unlike AdamW's (1e-8).
    fsdp, single = checkpoint(tmp_path / "fsdp"), checkpoint(tmp_path / "single")
    assert_same_weights(fsdp["model"], single["model"], atol=1e-5)
    for index, state in single["optimizer"]["state"].items():  # Adam's moments, consolidated from shards
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.allclose(fsdp["optimizer"]["state"][index][key], state[key], atol=1e-6), (index, key)


# ---------------------------------------------------------------------- in a group of one rank
def in_fresh_process(function, *args):
    """function(*args) in a process of its own: a process group (and its threads) must never live in the pytest
    process, which forks afterwards (DataLoader workers, pools), and a fork of a process with threads can hang. The
    process is a fork of the tests' preloaded server (tests/preloaded.py) set up as a spawned one, else spawned."""
    context, env = preloaded.spawned_context()
    with context.Pool(1, initializer=preloaded.as_spawned, initargs=(env,)) as pool:
        return pool.apply(function, args)


def sharded_test_vit(*flags):
    from dlojz_lib.parallelism.fsdp import shard_model
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flags import get_args_parser

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = resolve_config(get_args_parser().parse_args(["--device", "cpu", "--fsdp", "--test", *flags]))
    model = create_model("timm:test_vit", 10, False, 32)
    shard_model(model, cfg.fsdp_reshard_after_forward, cfg.amp_torch_dtype, torch.device("cpu"))
    return model


def block_weight_after_forward_is_sharded(flag):
    model = sharded_test_vit(flag)
    model(torch.randn(2, 3, 32, 32))
    return isinstance(model.blocks[0].attn.qkv.weight, torch.distributed.tensor.DTensor)


@pytest.mark.parametrize(
    "flag, sharded", [("--fsdp-reshard-after-forward", True), ("--no-fsdp-reshard-after-forward", False)]
)
def test_reshard_after_forward_frees_the_gathered_parameters(flag, sharded):
    """After a block's forward its weight is the shard again (a DTensor), or the gathered tensor until the backward."""
    assert in_fresh_process(block_weight_after_forward_is_sharded, flag) is sharded


def sharded_gradients_between_micro_batches():
    from in_process import synthetic_loop

    import dlojz

    loop = synthetic_loop(
        [
            "--device",
            "cpu",
            "--arch",
            "timm:test_vit",
            "--image-size",
            "32",
            "-b",
            "4",
            "--grad-acc",
            "2",
            "--fsdp",
            "--no-wandb",
            "--optimizer",
            "adamw",
        ],
        n_batches=4,
    )
    weight, seen = (lambda: loop["model"].module.blocks[0].attn.qkv.weight), []
    step_done = loop["hooks"].step_done

    def record():  # after each micro-batch (and after the optimizer step, when there is one)
        seen.append(weight().grad is None)
        step_done()

    loop["hooks"].step_done = record
    before = weight().full_tensor().clone()
    dlojz.train_one_epoch(**loop)
    return seen, loop["state"].global_step, not torch.equal(before, weight().full_tensor())


def test_accumulated_micro_batches_reduce_no_gradient():
    """Between the micro-batches of one step no sharded gradient exists: they were not reduce-scattered."""
    seen, steps, trained = in_fresh_process(sharded_gradients_between_micro_batches)
    assert steps == 2 and trained and seen == [True] * 4, seen


def test_test_mode_reports_flops_of_the_unsharded_model(tiny_data, tmp_path):
    """--test on a sharded model, with SGD (its foreach step: torch has no fused SGD for sharded parameters)."""
    proc = run_dlojz(
        *BASE,
        "--data-root",
        tiny_data,
        "-b",
        "8",
        "--fsdp",
        "--test",
        "--test-nsteps",
        "3",
        "--grad-checkpointing",
        "--optimizer",
        "sgd",
        "--metrics-json",
        tmp_path / "m.json",
        "--output-dir",
        tmp_path / "o",
    )
    assert proc.returncode == 0, show(proc)
    assert "optimizer: sgd (foreach step) (lr" in proc.stdout, proc.stdout
    metrics = read_json(tmp_path / "m.json")
    assert metrics["chrono"]["train_flops_per_image"] > 0 and metrics["activation_bytes_per_image"] > 0, metrics


# ---------------------------------------------------------------------- sharded checkpoints on disk
def write_sharded(out, epoch, step, value, keep=3):
    """A sharded checkpoint as ShardedCheckpointSaver lays it out (one process writing every shard)."""
    import torch.distributed.checkpoint as dcp

    name = ckpt.checkpoint_name(epoch, step, sharded=True)
    staging = out / f".{name}.tmp"
    dcp.save({"model": {"w": torch.full((64,), float(value))}}, checkpoint_id=staging, no_dist=True)
    return ckpt.publish_folder(dict(epoch=epoch, batch=0, global_step=step), staging, out, name, keep)


def test_a_sharded_checkpoint_cut_short_is_refused_and_the_previous_one_used(tmp_path, capsys):
    first = write_sharded(tmp_path, 1, 10, 1.0)
    second = write_sharded(tmp_path, 2, 20, 2.0)
    (tmp_path / ".ckpt_e0003_s000000030.dcp.tmp").mkdir()  # a writer killed before the rename: never a candidate
    assert ckpt.load_latest(tmp_path)[1] == second
    shard = next(second.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # a shard truncated (a disk full, a node lost)
    state, path = ckpt.load_latest(tmp_path)
    assert path == first and state["global_step"] == 10 and state["sharded_path"] == str(first)
    assert "shard file" in capsys.readouterr().err
    (first / ".metadata").unlink()
    assert ckpt.load_latest(tmp_path) == (None, None)
    with pytest.raises(ckpt.CheckpointError, match="no readable shard metadata"):
        ckpt.load(first)


def test_sharded_checkpoints_are_pruned_like_files(tmp_path):
    for step in range(1, 5):
        write_sharded(tmp_path, step, step * 10, step, keep=2)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "ckpt_e0003_s000000030.dcp",
        "ckpt_e0004_s000000040.dcp",
    ]
    assert (tmp_path / ckpt.LATEST).read_text().strip() == "ckpt_e0004_s000000040.dcp"


def test_shard_into_a_run_s_folder_or_over_a_file_of_the_user_s_is_one_line(trained_run, tmp_path, capsys):
    """dlojz_fsdp.py shard writes a folder whose `latest` names the sharded copy: into another run's folder (its
    latest re-pointed) or the source's own (its next --resume auto gone astray), a lab sweep's folder or one of its
    runs', a sharded checkpoint's own folder, or over a file of the user's named latest, it is refused in one line
    naming a new folder, and nothing is written."""
    import dlojz_fsdp

    source = ckpt.load_latest(trained_run)[1]
    other = shutil.copytree(trained_run, tmp_path / "other")
    own = shutil.copytree(trained_run, tmp_path / "own")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "latest").write_text("my notes\n")
    sweep_run = tmp_path / "sweep" / "batch-size=4"  # (a lab sweep's run not checkpointed yet)
    sweep_run.mkdir(parents=True)
    (sweep_run / "status.json").write_text('{"state": "running"}')
    (sweep_run.parent / "sweep.json").write_text("{}")
    sharded = tmp_path / "ckpt_e0001_s000000009.dcp"
    sharded.mkdir()
    (sharded / ".metadata").write_bytes(b"not read")
    cases = (
        (source, other, f"target {other} is a run's folder (its checkpoint {source.name})"),
        (source, sweep_run, f"target {sweep_run} holds a run's or a sweep's files (status.json)"),
        (source, sweep_run.parent, f"target {sweep_run.parent} holds a run's or a sweep's files (sweep.json)"),
        (source, sharded, f"target {sharded} is a sharded checkpoint's folder, not a run's"),
        (own / source.name, own, f"target {own} is the source's own folder (its checkpoint {source.name})"),
        (source, mine, f"target {mine}: {mine / 'latest'} is not dlojz's"),
    )
    for given, target, fragment in cases:
        before = sorted(path.name for path in target.iterdir())
        assert dlojz_fsdp.main(["shard", str(given), str(target)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and fragment in err and "give a new folder" in err, err
        assert sorted(path.name for path in target.iterdir()) == before
    assert (mine / "latest").read_text() == "my notes\n"


def test_consolidating_what_is_not_a_sharded_checkpoint_is_one_line(tmp_path, capsys):
    done = consolidate_inline(tmp_path / "nothing.dcp", tmp_path / "out.pt", capsys)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no such file" in done.stderr, done.stderr
    done = consolidate_inline(tmp_path / "nothing.dcp", tmp_path / "no" / "out.pt", capsys)  # checked before reading
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "its folder does not exist" in done.stderr, (
        done.stderr
    )


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--fsdp", "--sync-bn"], "--fsdp with --sync-bn"),
        (["--fsdp", "--model-ema"], "--fsdp with --model-ema"),
        (["--fsdp", "--amp", "--amp-dtype", "float16"], "--fsdp with --amp-dtype float16"),
        (["--no-fsdp-reshard-after-forward"], "without --fsdp: it says how --fsdp shards; add --fsdp"),
        (["--fsdp-replicate", "2"], "--fsdp-replicate 2 without --fsdp: it says how --fsdp shards; add --fsdp"),
        (["--fsdp-offload"], "--fsdp-offload without --fsdp: it says how --fsdp shards; add --fsdp"),
        (["--fsdp", "--fsdp-offload"], "--fsdp-offload keeps the shards in host memory and copies each block's"),
        (["--fsdp", "--fsdp-replicate", "2"], "--fsdp-replicate 2: this job's 1 rank(s) do not make 2 equal replicas"),
        (["--float8", "rowwise_with_gw_hp", "--amp"], "--float8 rowwise_with_gw_hp: torchao computes its weight"),
        (["--fsdp", "--tp", "2", "--float8", "rowwise"], "--float8 rowwise with --tp 2: dlojz trains float8 linears"),
        (["--fsdp", "--pp", "2", "--float8", "rowwise"], "--float8 rowwise with --pp 2: dlojz trains float8 linears"),
    ],
)
def test_what_fsdp_cannot_take_is_one_line(flags, message, run_inline):
    assert_one_line_error(run_inline("--device", "cpu", "--test", "--no-wandb", *flags), message)


def test_a_sharded_checkpoint_resumed_at_another_image_size_is_one_line(tiny_data, tmp_path):
    """A ViT's position embedding follows the image size: resumed at another, DCP failed rank by rank; the shapes
    are compared first and the difference named, with the size to resume at."""
    out = tmp_path / "run"
    vit = [*BASE, "--data-root", tiny_data, "--num-workers", "0", "--arch", "timm:test_vit", "--fsdp", "-b", "8"]
    proc = run_dlojz(*vit, "--image-size", "32", "--output-dir", out, "--epochs", "1")
    assert proc.returncode == 0, show(proc)
    proc = run_dlojz(*vit, "--image-size", "48", "--output-dir", out, "--epochs", "2", "--resume", "auto")
    assert_one_line_error(proc, "the checkpoint's pos_embed is [1, 5, 64], this run's [1, 10, 64]", "--image-size 32")


def hsdp_on_rank(rank, world, store_path, results, cases):
    """One of 4 ranks, for each case `--fsdp --fsdp-replicate 2` and its flags laid out as dlojz.py lays it out
    (`lay_out`): 2 replicas of a ViT, each sharded over 2 ranks (or with --tp 2, over 1, split over 2); two SGD steps
    with momentum on this data rank's share of 8 images against one process on all 8, then every weight gathered;
    and the collectives of a third step, by kind and by the ranks of their group."""
    import copy
    import traceback

    import torch
    import torch.distributed as dist
    from conftest import counting_mode
    from torch.distributed.tensor import DTensor

    from dlojz_lib.dist import Distribution, model_parallel_mesh
    from dlojz_lib.model.build import BuiltModel
    from dlojz_lib.model.zoo import create_model
    from dlojz_lib.parallelism.layout import lay_out
    from dlojz_lib.parallelism.tensor import fused_state_dict
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flags import get_args_parser

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    for case, flags in cases.items():
        try:
            argv = ["--device", "cpu", "--fsdp", "--fsdp-replicate", "2", *flags, "-b", "2", "--no-amp"]
            cfg = resolve_config(get_args_parser().parse_args(argv))
            ranks = Distribution(world, rank, rank, torch.device("cpu"))
            model_parallel_mesh(ranks, 1, cfg.tp, cfg.fsdp_replicate)
            torch.manual_seed(0)
            reference = create_model("timm:test_vit", 3, False, 32)
            said = []
            model = lay_out(BuiltModel.of(copy.deepcopy(reference), "timm:test_vit"), cfg, ranks, said.append)
            placements = {tuple(map(str, p.placements)) for p in model.module.parameters() if isinstance(p, DTensor)}
            optimizers = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (reference, model.module)]
            data = torch.Generator().manual_seed(1)
            per_rank = 8 // ranks.data_size
            mine = slice(per_rank * ranks.data_rank, per_rank * (ranks.data_rank + 1))
            for _ in range(2):
                images, labels = torch.randn(8, 3, 32, 32, generator=data), torch.randint(0, 3, (8,), generator=data)
                for net, optimizer, (x, y) in zip(
                    (reference, model.net), optimizers, ((images, labels), (images[mine], labels[mine]))
                ):
                    optimizer.zero_grad()
                    torch.nn.functional.cross_entropy(net(x), y).backward()
                    if net is model.net and model.whole_copies is not None:  # --tp: as dlojz.py steps
                        model.whole_copies.average_gradients()
                    optimizer.step()
            state = fused_state_dict({key: value.full_tensor() for key, value in model.module.state_dict().items()})
            expected = reference.state_dict()
            for key in expected:
                torch.testing.assert_close(state[key], expected[key], rtol=1e-4, atol=1e-5, msg=key)
            with counting_mode() as counted:  # a third step's forward and backward
                torch.nn.functional.cross_entropy(model.net(images[mine]), labels[mine]).backward()
            held = sum(4 * p.to_local().numel() for p in model.module.parameters())  # float32 bytes
            sent = [(name, group) for namespace, name, group, *_ in counted.calls if namespace == "c10d"]
            found = ((ranks.data_rank, ranks.data_size), sorted(placements), sent, said, held)
            results.put((rank, case, *found))
        except BaseException:
            results.put((rank, case, traceback.format_exc(), None, None, None, None))
    dist.destroy_process_group()


@pytest.mark.multirank
def test_hsdp_shards_within_a_replica_and_trains_as_one_process(tmp_path):
    """--fsdp --fsdp-replicate 2 on 4 ranks: each parameter replicated over 2 replicas and sharded over the 2 ranks
    of its own (placements Replicate, Shard(0)); the 4 ranks are still 4 data ranks (each its own images), and after
    two steps every weight is one process's on the whole batch. A step's all-gathers are sent within a replica's 2
    ranks only, its gradients reduce-scattered there and then all-reduced across the 2 replicas; the run's line says
    so. With --tp 2 (a (replicate, shard, tensor) mesh of 2 x 1 x 2: 2 data ranks), the same weights. The planner's
    HSDP row gives the parameter bytes a rank holds, exactly."""
    from conftest import spawn_ranks

    cases = {"hsdp": [], "hsdp-tp": ["--tp", "2"]}
    found = spawn_ranks(hsdp_on_rank, 4, tmp_path, cases)
    failures = [where for _, _, where, placements, *_ in found if placements is None]
    assert not failures, "\n".join(failures)
    assert len(found) == 4 * len(cases)
    for rank, case, where, placements, sent, said, _ in found:
        if case == "hsdp-tp":
            split = [p for p in placements if len(p) == 3 and p[0] == "R" and p[2].startswith("S(")]  # (3-D)
            assert where == (rank // 2, 2) and ("R", "S(0)", "R") in placements and split, (where, placements)
            continue
        assert where == (rank, 4), where
        assert placements == [("R", "S(0)")], placements  # (Replicate(), Shard(0)): DTensor's short names
        replica, peers = (0, 1) if rank < 2 else (2, 3), (rank % 2, rank % 2 + 2)
        groups = {kind: {group for name, group in sent if name == kind} for kind, _ in sent}
        assert groups == {"_allgather_base_": {replica}, "_reduce_scatter_base_": {replica},
                          "allreduce_": {peers}}, groups  # fmt: skip
        assert any("sharded over 2 ranks in each of 2 replicas (HSDP" in line for line in said), said

    # the planner's HSDP row (dlojz_lib/parallelism/plan.py) on 2 nodes of 2: the bytes a rank holds, exactly
    from dlojz_lib.parallelism.plan import GPUS, Allocation, LayoutTable, plan

    rows, _, _ = plan(LayoutTable("timm:test_vit", 32, 3, 2), Allocation(2, **dict(GPUS["h100"], gpus_per_node=2)))
    predicted = next(row for row in rows if row["layout"] == "HSDP 2 x FSDP 2")["parameter_bytes"]
    assert predicted == max(held for _, case, *_, held in found if case == "hsdp")


def test_on_several_nodes_the_fsdp_line_says_what_hsdp_would_change():
    """Plain FSDP over ranks on 2 nodes: its line names --fsdp-replicate 2 and what it would change; on one node, or
    with HSDP on, nothing is added; HSDP's own line counts a replica's ranks."""
    from types import SimpleNamespace

    from dlojz_lib.parallelism.layout import hsdp_hint, sharded_over

    two_nodes = SimpleNamespace(hosts=("a", "a", "b", "b"), data_size=4)
    assert "--fsdp-replicate 2 would gather within each node" in hsdp_hint(two_nodes, 1)
    assert hsdp_hint(two_nodes, 2) == "" and hsdp_hint(SimpleNamespace(hosts=("a",) * 4, data_size=4), 1) == ""
    assert sharded_over(two_nodes, 1) == "4 ranks"
    assert sharded_over(two_nodes, 2).startswith("2 ranks in each of 2 replicas (HSDP")


@pytest.mark.multirank
def test_layout_auto_runs_the_layout_the_planner_picks(tiny_data, tmp_path):
    """dlojz.py --layout auto on 2 ranks: the planner's line at start-up names a layout and its flags
    (dlojz_lib/parallelism/plan.py's choose_layout), and the run is that layout (its metrics say how the model was
    laid out: on this tiny ViT the roofline picks the pipeline of 2 stages, which sends the least); given with a
    layout flag of its own, one line."""
    out = tmp_path / "run"
    common = [*BASE, "--data-root", tiny_data, "--num-workers", "0", "-b", "8", "--epochs", "1", "--train-subset", "16"]
    proc = run_dlojz(*common, "--layout", "auto", "--output-dir", out, "--metrics-json", tmp_path / "m.json", ranks=2)
    assert proc.returncode == 0, show(proc)
    line = next(line for line in proc.stdout.splitlines() if "--layout auto: " in line)
    picked = line.split("--layout auto: ", 1)[1].split(" (", 1)[0]
    laid_out = {
        "DDP": ("ddp", 1, 1),
        "FSDP": ("fsdp", 1, 1),
        "TP 2 x FSDP 1": ("tp", 2, 1),
        "PP 2 x FSDP 1": ("pp", 1, 2),
    }
    assert picked in laid_out, line
    metrics = read_json(tmp_path / "m.json")
    found = (metrics["parallel"], metrics["tensor_parallel_size"], metrics["pipeline_size"])
    assert found == laid_out[picked], (line, metrics)
    refused = run_dlojz(*common, "--layout", "auto", "--fsdp", "--output-dir", tmp_path / "again")
    assert_one_line_error(refused, "--layout auto chooses --fsdp, --fsdp-replicate, --tp and --pp (it takes -b, ")
    assert "drop --fsdp, or --layout auto and give the layout yourself" in refused.stderr, refused.stderr


def test_a_sharded_checkpoint_is_known_by_its_contents_and_its_damage_said(tmp_path):
    """A sharded checkpoint copied under another name (final.dcp, a folder "copy") loads as one; a damaged one says
    what is wrong (a shard missing or truncated, a .metadata that is not DCP's, dlojz.pt missing, an unfinished
    .dcp.tmp), never "is a folder, not a checkpoint"; a run's folder still is one."""
    import os
    import shutil

    good = write_sharded(tmp_path / "run", 1, 10, 1.0)
    for name in ("final.dcp", "copy"):
        state = ckpt.load(shutil.copytree(good, tmp_path / name))
        assert state["global_step"] == 10 and state["sharded_path"] == str(tmp_path / name)

    def damaged(name, harm):
        folder = shutil.copytree(good, tmp_path / name)
        harm(folder)
        with pytest.raises(ckpt.CheckpointError) as refused:
            ckpt.load(folder)
        assert "is a folder, not a checkpoint" not in str(refused.value)
        return str(refused.value)

    assert "shard file" in damaged("missing", lambda f: next(f.glob("*.distcp")).unlink())
    truncated = damaged("truncated", lambda f: next(f.glob("*.distcp")).write_bytes(b"\0" * 10))
    assert "is missing or truncated" in truncated, truncated
    assert "no readable shard metadata" in damaged("random", lambda f: (f / ".metadata").write_bytes(os.urandom(64)))
    assert f"its {ckpt.SHARDED_META} (the run's state beside the shards) is missing" in damaged(
        "no_state", lambda f: (f / ckpt.SHARDED_META).unlink()
    )
    assert "an unfinished write" in damaged(".ckpt_e0002_s000000020.dcp.tmp", lambda f: None)
    with pytest.raises(ckpt.CheckpointError, match="is a folder, not a checkpoint: its newest is"):
        ckpt.load(tmp_path / "run")
