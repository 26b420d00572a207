"""The run's records as dlojz.py's main() fills them, between the writers of dlojz_lib/log.py and the run's pieces
they read (the model's layout, the checkpoints, the data's resolution):

- `announce_run(...)`: the run's first lines (the settings' notes, where it runs); `record_settings(...)`: its flags
  saved as a recipe, `args.toml` in the output folder (`dlojz.py --config FILE` runs them again), once every check
  has passed.
- `initial_metrics(...)`: the metrics JSON's keys before the run fills them.
- `open_wandb(...)`: W&B on rank 0 (resumed under the checkpoint's run id), TensorBoard beside it.
- `record_validation(...)`: an epoch's validation into the metrics, --val-history and W&B; --target-accuracy.
- `announce_resolution(...)`: progressive resizing's resolution of the epoch.
- `close_hooks(...)`: the profiler's traces and the LR finder's files after training.
- `report_run(run, progress, watchdog)`: the run's figures into the metrics JSON and W&B, the final report.
"""

import dataclasses
import sys
import time
from pathlib import Path

import torch

from dlojz_lib.data.augment import training_resolution
from dlojz_lib.log import (
    ARGS_FILE,
    Loggers,
    NoWandb,
    TensorBoardRun,
    append_json_line,
    finish,
    start_wandb,
    tensorboard_folder,
    write_lr_finder,
    write_text,
)
from dlojz_lib.model.recompute import plain_stages
from dlojz_lib.model.zoo import saved_activation_bytes, train_flops_per_image
from dlojz_lib.observers.chrono import peak_memory_bytes
from dlojz_lib.parallelism.layout import state_bytes_per_rank
from dlojz_lib.resume import check_checkpoints_written
from dlojz_lib.settings.flags import PATH_FLAGS, get_args_parser
from dlojz_lib.settings.recipe import recipe_text


def announce_run(notes, ranks, log, nodes, launcher):
    """The run's first lines: the settings' `notes`, where it runs."""
    for note in notes:
        log(note)
    log(f">>> Training on {nodes} and {ranks.world_size} processes ({launcher}), device {ranks.device}")


def record_settings(cfg, argv, ranks, log):
    """Every flag of the run (recipe, command line and profile merged) saved as a recipe file in its output folder:
    `args.toml`, written atomically, replaced by a resumed run. Written once every check has passed and the run
    is about to train: a run refused (another model's checkpoint, a mistyped --data-root) leaves the record of the
    run that is there as it was, and its documented rerun (`--config args.toml --resume auto`) still works."""
    if ranks.is_main:
        path = Path(cfg.output_dir) / ARGS_FILE
        command = " ".join(sys.argv[1:] if argv is None else argv)
        header = [f"dlojz.py {command}", time.strftime("%Y-%m-%d %H:%M:%S"), "paths recorded absolute"]
        paths = {name: getattr(cfg, name, None) for name in PATH_FLAGS}
        recorded = dataclasses.replace(cfg, **absolute_paths(paths))
        write_text(path, recipe_text(recorded, get_args_parser(), header=header))
        log(f"arguments: {path} (dlojz.py --config FILE runs them again)")


def absolute_paths(paths: dict) -> dict:
    """Of `paths` ({dest: value} of flags.PATH_FLAGS), each relative one made absolute (from the folder the run
    started in), so `--config RUN/args.toml --resume auto` runs the same from any folder; `--resume auto` stays
    auto."""
    import os

    def relative(name, value):
        return isinstance(value, str) and value and not os.path.isabs(value) and (name, value) != ("resume", "auto")

    return {name: os.path.abspath(value) for name, value in paths.items() if relative(name, value)}


def initial_metrics(batch_size, grad_acc, compute_dtype, ranks) -> dict:
    """The metrics JSON's keys before the run fills them."""
    images_per_step = batch_size * ranks.data_size  # one micro-batch on every data replica
    return dict(
        world_size=ranks.world_size,
        global_batch_size=images_per_step * grad_acc,
        steps=0,
        epochs=0,
        train_loss=None,
        val_loss=None,
        val_accuracy=None,
        val_top5_accuracy=None,
        val_images=0,
        images_per_second=None,
        data_wait_ms=None,
        compute_dtype=compute_dtype,
        time_to_target_s=None,
        epochs_to_target=None,
    )


def open_wandb(cfg, ranks, metrics, state):
    """W&B on rank 0 (resumed under the checkpoint's run id, kept in `state`), a NoWandb elsewhere or when off;
    with --tensorboard, TensorBoard's writer beside it (Loggers)."""
    wandb_run = NoWandb()
    if ranks.is_main:
        wandb_run = start_wandb(
            cfg,
            dict(
                dataclasses.asdict(cfg),
                architecture=cfg.arch,
                world_size=ranks.world_size,
                global_batch_size=metrics["global_batch_size"],
            ),
            Path(cfg.output_dir).name,
            state.wandb_id,
        )
        state.wandb_id = wandb_run.id
        if cfg.tensorboard is not None and not (cfg.eval_only or cfg.findlr):
            wandb_run = Loggers(
                wandb_run, TensorBoardRun(tensorboard_folder(cfg.tensorboard, cfg.output_dir), state.global_step)
            )
    return wandb_run


def record_validation(cfg, epoch, validation, state, metrics, started, wandb_run, ranks, log) -> bool:
    """An epoch's validation into the metrics, --val-history and W&B; True when --target-accuracy is reached."""
    metrics.update(validation)
    if ranks.is_main and cfg.val_history:  # followed live by dlojz_hpo.py's pruner
        append_json_line(
            cfg.val_history,
            dict(epoch=epoch + 1, steps=state.global_step, elapsed_s=time.perf_counter() - started, **validation),
        )
    wandb_run.log(
        {
            "test accuracy": metrics["val_accuracy"],
            "test top5 accuracy": metrics["val_top5_accuracy"],
            "test loss": metrics["val_loss"],
            "epoch": epoch + 1,
            **{  # the per-class figures' summaries
                name: metrics[key]
                for name, key in (
                    ("test balanced accuracy", "val_balanced_accuracy"),
                    ("test macro-F1", "val_macro_f1"),
                )
                if metrics.get(key) is not None
            },
        },
        step=state.global_step,
    )
    top1 = metrics["ema_val_accuracy" if cfg.ema_judges else "val_accuracy"]  # --ema-judges: the EMA's
    target_reached = cfg.target_accuracy is not None and top1 >= cfg.target_accuracy
    if target_reached:
        metrics.update(time_to_target_s=time.perf_counter() - started, epochs_to_target=epoch + 1)
        log(
            f">>> Target top-1 {cfg.target_accuracy:.4f} reached{' by the EMA' if cfg.ema_judges else ''} after {epoch + 1} epochs, "
            f"{metrics['time_to_target_s']:.1f} s from the start: stopping"
        )
    return target_reached


def announce_resolution(cfg, epoch, log, wandb_run, step):
    """Progressive resizing: this epoch's training resolution, to the console and W&B."""
    resolution = training_resolution(cfg.section("validation"), cfg.image_size, epoch)
    log(
        f"epoch {epoch + 1}: training resolution {resolution} px (progressive resizing "
        f"{cfg.min_res}->{cfg.max_res} px, epochs {cfg.start_ramp}->{cfg.end_ramp} counted from 0); "
        f"validation {cfg.val_crop_size} px, {cfg.val_crop_size / resolution:.2f}x"
    )
    wandb_run.log({"resolution": resolution}, step=step)


def close_hooks(output_dir, hooks, ranks, log) -> dict:
    """After training: the profiler's traces closed and announced, the LR finder's CSV, plot and suggested
    learning rate written (its metrics returned)."""
    hooks.close()
    trace_dir = Path(output_dir) / "profiler"
    if hooks.profiler is not None:
        log(
            f">>> Profiler traces: {trace_dir} (tensorboard --logdir {trace_dir}, or open the .json in https://ui.perfetto.dev)"
        )
    if hooks.lr_finder is not None and ranks.is_main:
        return write_lr_finder(hooks.lr_finder, Path(output_dir))
    return {}


def report_run(run, progress, watchdog) -> dict:
    """The run's figures (throughput, data wait, memory, stragglers, the loss scale; with --test the chronometer's
    report) into the metrics JSON and W&B; a final model nowhere on disk ends the run non-zero."""
    cfg, ranks, metrics, training = run.cfg, run.ranks, run.metrics, run.training
    metrics["images_per_second"] = progress.images_per_second()
    metrics["data_wait_ms"] = progress.data_wait_ms()  # steady state, per micro-batch, as images_per_second
    metrics.update(state_bytes_per_rank(run.model, training, ranks))  # what DDP copies and FSDP shards
    if watchdog.compares:
        metrics["stragglers"] = watchdog.stragglers
    scaler = training.scaler
    metrics["grad_scaler_scale"] = scaler.get_scale() if scaler.is_enabled() else None  # float16 loss scale
    pipeline = run.model.pipeline
    if pipeline is not None and pipeline.steps:  # --pp under the chronometer: each stage's busy and idle time
        line, metrics["pipeline"] = pipeline.bubble_report(ranks)
        run.log(f">>> {line}")
    ctx = None
    if cfg.test and ranks.is_main:
        ctx = chrono_context(cfg, run.model, run.loaders, ranks, metrics, run.val_max_batches)
    metrics = finish(
        cfg, metrics, run.chrono, ranks, run.wandb_run, ctx=ctx or {}, n_batches=run.loaders.n_train_batches
    )
    check_checkpoints_written(cfg.output_dir, run.saver, run.log)  # a final model nowhere on disk ends the run non-zero
    return metrics


def chrono_context(cfg, model, loaders, ranks, metrics, val_max_batches) -> dict:
    """What the chronometer's report needs beyond its timings: the model's FLOPs, the run's shape, the machine."""
    whole = model.unsharded  # with --fsdp, the shapes of the model before sharding
    with plain_stages(whole):  # model FLOPs: the recomputation is not useful work
        flops = train_flops_per_image(whole, cfg.image_size, cfg.channels_last)
    if cfg.grad_checkpointing:  # what checkpointing saves, estimated from one image (float32)
        plain, kept = (
            saved_activation_bytes(whole, cfg.image_size, cfg.channels_last, c, cfg.arch) for c in (False, True)
        )
        metrics.update(activation_bytes_per_image=kept, activation_bytes_per_image_without_checkpointing=plain)
    device = ranks.device
    return dict(
        images_per_step=cfg.batch_size * ranks.data_size,
        world_size=ranks.world_size,
        steps_per_epoch=loaders.n_train_batches,
        val_batches_done=min(val_max_batches or loaders.n_val_batches, loaders.n_val_batches),
        val_batches_total=loaders.n_val_batches,
        num_workers=cfg.num_workers,
        cpus_per_task=cfg.cpus_per_task,
        pin_memory=cfg.pin_memory,
        persistent_workers=cfg.persistent_workers,
        train_flops_per_image=flops,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        compute_dtype=cfg.compute_dtype,
        peak_memory_bytes=peak_memory_bytes(device),
    )
