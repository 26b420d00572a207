"""dlojz: ResNet-50 / ImageNet training, optimised flag by flag (IDRIS course "Deep Learning Optimisé - Jean Zay").

One command runs alone, under torchrun or under srun across nodes:
    python dlojz.py --test                  # first run: 50 steps, chronometer report (CPU profile without a GPU)
    srun python -u dlojz.py -b 256 -e 90    # on a Slurm GPU allocation, one task per GPU
`main()` reads top to bottom in the course's order: arguments, instantiation (distribution, model, loss,
optimizer), DataLoader, initialisation, training, validation, checkpoint and report. Each section calls one
function, below it or in a helper module; `train_one_epoch` and `evaluate` are the loop's two phases. The flags
live in dlojz_lib/flags.py, the run's settings and their checks in dlojz_lib/config.py, the process group in dlojz_lib/dist.py,
the data sets and batches in dlojz_lib/data/loaders.py, the model as it trains (DDP, FSDP, compile) in dlojz_lib/parallel.py,
its loss, optimizer and schedule in dlojz_lib/optim/, checkpoints and resume in dlojz_lib/resume.py, the lines the run
prints in dlojz_lib/log.py, the chronometer, profiler and LR finder hooks in dlojz_lib/hooks.py.
"""

import contextlib
import dataclasses
import math
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

if __name__ == "__main__":  # --help and every bad flag answer here, before the seconds that torch takes to import
    from dlojz_lib.flag_checks import check_command_line

    check_command_line()

    def interrupted_while_starting(signum, frame):  # Ctrl-C in the imports: a line, not a traceback from torch's
        print("dlojz: interrupted while starting, before any training: nothing to resume", file=sys.stderr)
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, interrupted_while_starting)

import torch
import torch.distributed as dist

import dlojz_lib.checkpoint as ckpt
from dlojz_lib.checks import DataError, UserError
from dlojz_lib.chrono import Chronometer
from dlojz_lib.config import load_idr_torch, resolve_config
from dlojz_lib.data.augment import training_resolution
from dlojz_lib.data.datasets import class_counts
from dlojz_lib.data.loaders import LOADERS, build_data, build_loaders, close_loader, measure_loader
from dlojz_lib.dist import (
    INTERRUPTED,
    RequeueFailed,
    StopPoll,
    StopSignal,
    agree_on_stop,
    checkpoint_for_stop,
    is_lost_peer,
    report_crash,
    report_lost_peer,
    requeue,
    setup_distributed,
)
from dlojz_lib.flag_checks import check_flags
from dlojz_lib.flags import VALIDATION_METRICS, get_args_parser
from dlojz_lib.hooks import LoopHooks, make_profiler
from dlojz_lib.log import (
    LOG_EVERY,
    Console,
    NoWandb,
    Progress,
    announce_run,
    append_json_line,
    chrono_context,
    finish,
    start_wandb,
    warn_unwritten,
    write_json,
    write_lr_finder,
)
from dlojz_lib.metrics import summary as class_summary
from dlojz_lib.metrics import write_per_class, write_predictions
from dlojz_lib.optim.losses import soft_target_accuracy
from dlojz_lib.optim.training import build_training
from dlojz_lib.parallel import build_model, state_bytes_per_rank
from dlojz_lib.resume import (
    check_checkpoints_written,
    claim_output_dir,
    keep_global_batch,
    make_saver,
    periodic_checkpoints,
    release_output_dir,
    restore,
    save_epoch_checkpoint,
)
from dlojz_lib.watchdog import Watchdog

idr_torch = load_idr_torch()
TEST_VAL_BATCHES = 20  # --test validates on this many batches


class TrainingDiverged(Exception):
    """The loss became NaN/inf: stop (exit 3), keep the last good checkpoint."""


@dataclasses.dataclass
class EpochResult:
    train_loss: float
    train_accuracy: float
    stop_reason: str | None  # a signal's name: the epoch was left for a checkpoint and a requeue


def main(argv=None, running=None) -> dict:
    """One run, in the course's order; returns its metrics. Bad input raises UserError (see cli). `running`, a dict
    if given, receives the ranks, the output folder and the TrainState once training can start: what cli() says
    when a peer is lost."""
    # ================================ ARGUMENTS: every check, before any process group or data scan
    run_start = time.perf_counter()  # time to target counts from here, start-up included
    args = get_args_parser().parse_args(argv)
    if args.fetch_weights:  # on a login node, before any check that wants the weights already there
        from dlojz_lib.pretrained import fetch_weights

        check_flags(vars(args))
        print(fetch_weights(args.arch, args.pretrained), flush=True)
        return {}
    cfg = resolve_config(args)
    stop_signal = StopSignal().install()  # installed first: a signal arriving during start-up must not kill the job

    # ================================ INSTANTIATION: distribution
    ranks, cfg = setup_distributed(cfg)
    # a thread that ends the job in one line when a rank hangs (each StopPoll call tells it the loop moves on)
    watchdog = Watchdog(
        ranks, cfg.hang_timeout, cfg.output_dir, lambda: ckpt.newest_checkpoint(cfg.output_dir), cfg.straggler_factor
    )
    stop = StopPoll(stop_signal, ranks, timedelta(seconds=cfg.dist_timeout), watchdog.start())
    if running is not None:  # what cli says if a peer is lost from here on; it tells the others of a normal end
        running.update(ranks=ranks, output_dir=cfg.output_dir, watchdog=watchdog)
    log = Console(ranks.is_main)
    if cfg.writes_checkpoints:
        claim_output_dir(cfg, ranks, log)  # one run writes in a folder: refused here, before any data scan
    cfg = keep_global_batch(cfg, ranks.world_size, log)  # (before the loaders and the schedule: --grad-acc)
    announce_run(cfg, argv, ranks, log, f"{idr_torch.num_nodes} nodes", idr_torch.current_API)
    # --test: the chronometer times each phase of the first steps, then the last --test-unsync-steps as a whole
    synced = (cfg.test_nsteps - cfg.test_unsync_steps) * cfg.grad_acc if cfg.test_unsync_steps else None
    chrono = Chronometer(enabled=cfg.test, rank=ranks.rank, device=ranks.device, synced_steps=synced)

    # ================================ DATA SETS (the model needs the number of classes)
    train_set, val_set, classes = build_data(cfg, ranks, log)

    # ================================ INSTANTIATION: model, loss, optimizer
    model = build_model(cfg, len(classes), ranks, log)

    # ================================ DATALOADER
    loaders = build_loaders(cfg, train_set, val_set, len(classes), ranks, log)
    images_per_step = cfg.batch_size * ranks.world_size  # one micro-batch on every rank
    metrics = initial_metrics(cfg, ranks)
    if cfg.loader_only:
        return measure_loader_only(cfg, loaders, ranks, metrics, log)
    training = build_training(
        cfg, model, loaders.n_train_batches, len(classes), ranks, log, class_counts(train_set, len(classes))
    )

    # ================================ INITIALISATION: resume, W&B, hooks
    state, resumed_from = restore(cfg, model, training, loaders.n_train_batches, ranks.device, log)
    if running is not None:
        running.update(ranks=ranks, output_dir=cfg.output_dir, state=state)
    val_max_batches = TEST_VAL_BATCHES if cfg.test else None
    if cfg.eval_only:
        return evaluate_only(
            cfg, model, loaders, training, ranks, chrono, resumed_from, val_max_batches, metrics, classes, val_set, log,
            stop,
        )  # fmt: skip
    if resumed_from and state.epoch >= cfg.epochs and training.lr_finder is None:  # its metrics stay as they are
        log(f"nothing to train: the run has done its {state.epoch} epochs; give --epochs N > {state.epoch} to go on")
        return {}
    wandb_run = open_wandb(cfg, ranks, metrics, state)
    saver = make_saver(cfg, model, training, ranks)
    profiler = make_profiler(cfg, Path(cfg.output_dir) / "profiler", ranks.rank, ranks.device) if cfg.prof else None
    # the chronometer, torch.profiler, the LR range test
    hooks = LoopHooks(chrono, profiler, training.lr_finder, ranks.enabled)
    progress = Progress(
        log, wandb_run, ranks.device, cfg.epochs, loaders.n_train_batches, cfg.grad_acc, images_per_step
    )

    # ================================ TRAINING
    chrono.start()
    started = run_start - state.elapsed_s  # a resumed run goes on counting from the first run's start
    periodic = periodic_checkpoints(cfg, saver, started, loaders.n_train_batches, training.lr_finder, log)
    for epoch in range(state.epoch, cfg.epochs):
        epoch_start = time.perf_counter()
        if cfg.min_res is not None:  # the data set's workers crop at this resolution (the sample keys carry the epoch)
            announce_resolution(cfg, epoch, log, wandb_run, state.global_step)
        result = train_one_epoch(model, training, loaders, state, cfg, ranks, hooks, progress, stop, periodic)
        train_seconds = time.perf_counter() - epoch_start
        if result.train_loss is not None:  # None: resumed after this epoch's training, before its validation
            metrics.update(train_loss=result.train_loss, train_accuracy=result.train_accuracy)
        metrics["steps"] = state.global_step
        state.elapsed_s = time.perf_counter() - started
        if training.lr_finder is not None:  # the range test sweeps on over the next epoch, without validation
            if training.lr_finder.done:
                break
            continue
        if result.stop_reason:  # preempted or at the time limit: checkpoint mid-epoch, requeue, exit cleanly
            return stop_run(cfg, result.stop_reason, saver, state, loaders, ranks, log, metrics, chrono, wandb_run)

        # ================================ VALIDATION (every --val-every epochs and at the last)
        target_reached = best = nonfinite_validation = False
        if (epoch + 1) % cfg.val_every == 0 or epoch + 1 == cfg.epochs or cfg.test:
            validation = validate(
                cfg, epoch, model, loaders, training, ranks, chrono, val_max_batches, log, stop, train_seconds
            )
            if validation.get("stopped_by"):  # resumed, the run validates this epoch first
                return stop_run(
                    cfg, validation["stopped_by"], saver, state, loaders, ranks, log, metrics, chrono, wandb_run
                )
            target_reached = record_validation(cfg, epoch, validation, state, metrics, started, wandb_run, ranks, log)
            best = record_best(cfg, epoch, validation, state, metrics)
            nonfinite_validation = not math.isfinite(validation["val_loss"])  # the epoch is saved, then the run ends
        metrics["epochs"] = epoch + 1

        # ================================ CHECKPOINT
        stop.watchdog.disarm(f"writing epoch {epoch + 1}'s checkpoint")
        state.epoch, state.batch, state.elapsed_s = epoch + 1, 0, time.perf_counter() - started
        if not cfg.test:
            save_epoch_checkpoint(saver, state, periodic, log, best)
        if nonfinite_validation:
            saver.wait()
            raise TrainingDiverged(
                f"the validation loss is not finite (nan/inf) after epoch {epoch + 1}: stopping; the epoch's "
                "checkpoint is kept "
                f"({ckpt.newest_checkpoint(cfg.output_dir) or 'none written'}); lower --lr, or validate without "
                "float16 (--amp-dtype bfloat16 or --no-amp) if the outputs overflow"
            )
        if cfg.test or target_reached:
            break
    stop.watchdog.disarm("at the run's end (the last checkpoint, the report)")
    saver.wait()  # the last checkpoint's background write
    metrics.update(close_hooks(cfg, hooks, ranks, log))

    # ================================ REPORT
    metrics["images_per_second"] = progress.images_per_second()
    metrics["data_wait_ms"] = progress.data_wait_ms()  # steady state, per micro-batch, as images_per_second
    metrics.update(state_bytes_per_rank(model, training, ranks))  # what DDP copies and FSDP shards
    if watchdog.compares:
        metrics["stragglers"] = watchdog.stragglers
    metrics["grad_scaler_scale"] = (
        training.scaler.get_scale() if training.scaler.is_enabled() else None
    )  # float16 loss scale
    ctx = chrono_context(cfg, model, loaders, ranks, metrics, val_max_batches) if cfg.test and ranks.is_main else None
    metrics = finish(cfg, metrics, chrono, ranks, wandb_run, ctx=ctx or {}, n_batches=loaders.n_train_batches)
    check_checkpoints_written(cfg, saver, log)  # a final model nowhere on disk ends the run non-zero
    return metrics


def initial_metrics(cfg, ranks) -> dict:
    """The metrics JSON's keys before the run fills them."""
    images_per_step = cfg.batch_size * ranks.world_size  # one micro-batch on every rank
    return dict(
        world_size=ranks.world_size,
        global_batch_size=images_per_step * cfg.grad_acc,
        steps=0,
        epochs=0,
        train_loss=None,
        val_loss=None,
        val_accuracy=None,
        val_top5_accuracy=None,
        val_images=0,
        images_per_second=None,
        data_wait_ms=None,
        compute_dtype=cfg.compute_dtype,
        time_to_target_s=None,
        epochs_to_target=None,
    )


def measure_loader_only(cfg, loaders, ranks, metrics, log) -> dict:
    """--loader-only: the training DataLoader alone, images/s overall and per worker."""
    metrics = dict(
        measure_loader(
            loaders.train,
            loaders.train_sampler,
            cfg.test_nsteps,
            cfg.num_workers,
            ranks.all_gather if ranks.enabled else None,
            log,
        ),
        world_size=ranks.world_size,
        global_batch_size=metrics["global_batch_size"],
    )
    if ranks.is_main and cfg.metrics_json:
        write_json(cfg.metrics_json, metrics)
    return metrics


def evaluate_only(
    cfg, model, loaders, training, ranks, chrono, resumed_from, val_max_batches, metrics, classes, val_set, log, stop
) -> dict:
    """--eval-only: validate the checkpoint's weights (or its EMA's) and report, with the results per class in the
    output folder and, with --predictions, each image's. A stop signal (Slurm's warning, SIGTERM, Ctrl-C) ends it
    between two batches: nothing to checkpoint, nothing written, exit 128 + the signal's number."""
    chrono.validation()
    result = evaluate(
        model.module,
        loaders,
        training,
        ranks,
        val_max_batches,
        stop=stop,
        tta_flip=cfg.tta_flip,
        sharded=model.parallel == "fsdp",
        keep_confusion=True,
        keep_predictions=cfg.predictions is not None,
    )
    if "stopped_by" in result:
        name = result["stopped_by"]
        log(f"{name} received during --eval-only: the evaluation stops, nothing written (run it again to evaluate)")
        raise SystemExit(128 + getattr(signal.Signals, name, signal.SIGTERM))
    confusion, predictions = result.pop("confusion", None), result.pop("predictions", None)
    metrics.update(result, eval_ema=cfg.eval_ema)
    chrono.validation()
    try:  # each file whole or as it was; a full disk is one warning, the evaluation's figures still printed
        if ranks.is_main and confusion is not None:
            written = write_per_class(confusion, classes, cfg.output_dir)
            log(f"per class: {written[0]} (precision, recall, F1, worst mix-up), {written[1]} (confusion matrix)")
        if ranks.is_main and predictions is not None:
            write_predictions(cfg.predictions, predictions, classes, val_set.describe)
            log(f"predictions: {cfg.predictions} ({len(predictions[0])} images: true class, top-5 and probabilities)")
    except OSError as err:
        warn_unwritten(err.filename or cfg.output_dir, err)
    log(
        f"##EVALUATION## {resumed_from}{' (EMA weights)' if cfg.eval_ema else ''}: Validation Loss: {metrics['val_loss']:.4f}, Validation Accuracy: "
        f"{metrics['val_accuracy']:.4f}, top-5 {metrics['val_top5_accuracy']:.4f}, balanced "
        f"{metrics['val_balanced_accuracy']:.4f}, macro-F1 {metrics['val_macro_f1']:.4f} ({metrics['val_images']} "
        f"images{', flip TTA' if cfg.tta_flip else ''}, {chrono.val_time:.1f} s)"
    )
    return finish(cfg, metrics, chrono, ranks)


def record_best(cfg, epoch, validation, state, metrics) -> bool:
    """Whether this epoch's validation is the run's best by --best-metric (the first of equals stays the best);
    the best so far goes into `state` (checkpointed with it) and the metrics."""
    if cfg.best_metric == "none":
        return False
    value = validation[VALIDATION_METRICS[cfg.best_metric][0]]
    if not math.isfinite(validation["val_loss"]):  # a model whose outputs are nan is never the best
        return False
    best = state.best_value is None or value > state.best_value  # (a resume keeps it for the same metric only)
    if best:
        state.best_metric, state.best_value, state.best_epoch = cfg.best_metric, value, epoch + 1
    metrics.update(best_metric=state.best_metric, best_value=state.best_value, best_epoch=state.best_epoch)
    return best


def open_wandb(cfg, ranks, metrics, state):
    """W&B on rank 0 (resumed under the checkpoint's run id, kept in `state`), a NoWandb elsewhere or when off."""
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
        },
        step=state.global_step,
    )
    target_reached = cfg.target_accuracy is not None and metrics["val_accuracy"] >= cfg.target_accuracy
    if target_reached:
        metrics.update(time_to_target_s=time.perf_counter() - started, epochs_to_target=epoch + 1)
        log(
            f">>> Target top-1 {cfg.target_accuracy:.4f} reached after {epoch + 1} epochs, "
            f"{metrics['time_to_target_s']:.1f} s from the start: stopping"
        )
    return target_reached


def announce_resolution(cfg, epoch, log, wandb_run, step):
    """Progressive resizing: this epoch's training resolution, to the console and W&B."""
    resolution = training_resolution(cfg, epoch)
    log(
        f"epoch {epoch + 1}: training resolution {resolution} px (progressive resizing "
        f"{cfg.min_res}->{cfg.max_res} px, epochs {cfg.start_ramp}->{cfg.end_ramp} counted from 0); "
        f"validation {cfg.val_crop_size} px, {cfg.val_crop_size / resolution:.2f}x"
    )
    wandb_run.log({"resolution": resolution}, step=step)


def close_hooks(cfg, hooks, ranks, log) -> dict:
    """After training: the profiler's traces closed and announced, the LR finder's CSV, plot and suggested
    learning rate written (its metrics returned)."""
    hooks.close()
    trace_dir = Path(cfg.output_dir) / "profiler"
    if hooks.profiler is not None:
        log(
            f">>> Profiler traces: {trace_dir} (tensorboard --logdir {trace_dir}, or open the .json in https://ui.perfetto.dev)"
        )
    if hooks.lr_finder is not None and ranks.is_main:
        return write_lr_finder(hooks.lr_finder, Path(cfg.output_dir))
    return {}


def train_one_epoch(
    model, training, loaders, state, cfg, ranks, hooks, progress, stop, checkpoints=None
) -> EpochResult:
    """Train on what is left of epoch `state.epoch` (from micro-batch `state.batch`), stopping early at the end of
    --test, on a stop signal (any rank) or when the LR finder is done; `checkpoints` (--checkpoint-every) saves
    mid-epoch. The metrics stay on the device: the host
    waits for it only at log points (every LOG_EVERY optimizer steps and at console lines). The hot loop, on one
    screen on purpose: split into functions, the order of a step's operations would be hidden."""
    loaders.start_epoch(state.epoch, state.batch)
    progress.new_epoch(hooks.data_wait_s)
    device = ranks.device
    epoch_totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, images
    first_nonfinite = torch.full((), -1.0, dtype=torch.float64, device=device)  # optimizer step of a NaN/inf loss
    stop_reason = None
    model.net.train()
    stop.watchdog.disarm()  # the first step (compilation, autotuning) is not timed
    batches = hooks.loading(loaders.train_batches)
    for images, labels in batches:
        if progress.micro_steps == 0:
            progress.console(f"image batch shape: {tuple(images.shape)}, dtype {images.dtype}")
        batch_index = state.batch
        targets = labels
        if training.mix is not None:  # soft labels; the loss and the train accuracy take them as they are
            images, targets = training.mix(images, labels)
        optimizer_step = (batch_index + 1) % cfg.grad_acc == 0 or batch_index == loaders.n_train_batches - 1
        with model.gradient_sync(optimizer_step):  # accumulating: gradients reduced at the last micro-batch only
            with hooks.phase("forward"), stop.watchdog.timing(), training.autocast():
                model.begin_step()  # CUDA graphs: the last step's outputs may be overwritten
                outputs = model.net(images)
                with hooks.phase("loss"):
                    loss = training.criterion(outputs, targets)
            with hooks.phase("backward"), stop.watchdog.collective("the gradient all-reduce", optimizer_step):
                training.scaler.scale(loss / cfg.grad_acc).backward()
        if optimizer_step:
            with hooks.phase("optimizer_step"):
                if training.drop_frozen_gradients is not None:  # frozen layers: out of the clip's norm and the scaler
                    training.drop_frozen_gradients()
                if cfg.clip_grad_norm is not None:  # on the true gradients: unscaled first under float16
                    training.scaler.unscale_(training.optimizer)
                    torch.nn.utils.clip_grad_norm_(model.module.parameters(), cfg.clip_grad_norm, foreach=True)
                training.scaler.step(training.optimizer)  # skipped by the float16 scaler when gradients overflowed
                training.scaler.update()
                training.optimizer.zero_grad(set_to_none=True)
                if model.ema is not None and model.ema.due(state.global_step + 1):
                    model.ema.update_parameters(model.module)
        state.batch += 1
        progress.micro_steps += 1
        hooks.step_done()
        if not optimizer_step:
            continue
        state.global_step += 1
        if training.scheduler is not None:
            training.scheduler.step()
        with torch.no_grad():  # a Python scalar or torch.full: torch.tensor(x, device=cuda) would wait for the host
            count = float(labels.numel())
            stats = torch.stack(
                [
                    loss.detach().double() * count,
                    soft_target_accuracy(outputs, targets).double() * count,
                    torch.full((), count, dtype=torch.float64, device=device),
                ]
            )
            progress.running += stats
            epoch_totals += stats
            first_nonfinite = torch.where(
                (first_nonfinite < 0) & ~torch.isfinite(loss.detach()), float(state.global_step), first_nonfinite
            )
        if hooks.optimizer_step_done(loss, stats[1], count):  # the LR finder has swept its range
            break
        # a stop signal on any rank (asked without waiting for the GPU): all ranks stop here
        if stop(state.global_step):
            stop_reason = stop.stop_signal.name or "signal on another rank"
            break
        end_of_test = cfg.test and state.global_step >= cfg.test_nsteps
        console_line = progress.is_console_line(batch_index) or end_of_test
        if state.global_step % LOG_EVERY == 0 or console_line:
            due = checkpoints is not None and checkpoints.due()  # rank 0's clock; the all-reduce tells the others
            stop_requested, bad_step, save_now, straggler = agree_on_stop(stop, first_nonfinite, ranks, due)
            if straggler:  # named once per rank
                progress.console(straggler)
            progress.mark(hooks.data_wait_s)
            if bad_step >= 0:
                diverged(cfg, bad_step, state.epoch)
            lr = training.optimizer.param_groups[0]["lr"]  # the next step's (the scheduler has stepped)
            if state.global_step % LOG_EVERY == 0:
                progress.log_train(state.global_step, loss, lr)
            if console_line:
                progress.console_line(state.epoch, batch_index, lr, hooks.data_wait_s)
            if stop_requested:
                stop_reason = stop.stop_signal.name or "signal on another rank"
                break
            if save_now and state.batch < loaders.n_train_batches:  # (the epoch's end writes its own)
                stop.watchdog.disarm("writing a checkpoint")  # a sharded save on a slow file system: minutes
                checkpoints.save(state)
        if end_of_test:
            hooks.chrono.end_window()  # the unsynchronised window's one wait, at its end
            break
    batches.close()  # leaving mid-epoch (test, stop signal): release this epoch's iterator and its workers' batches now
    stop.settle()
    progress.console.end_live_line()
    with stop.watchdog.collective("the epoch's totals", ranks.enabled):
        if ranks.enabled:
            dist.all_reduce(epoch_totals)
        loss_sum, correct, count = epoch_totals.tolist()
    stop.watchdog.disarm()
    if count == 0:  # resumed after this epoch's training (stopped during its validation)
        return EpochResult(None, None, stop_reason)
    return EpochResult(loss_sum / count, correct / count, stop_reason)


def evaluate(
    net,
    loaders,
    training,
    ranks,
    max_batches=None,
    stop=None,
    tta_flip=False,
    sharded=False,
    keep_confusion=False,
    keep_predictions=False,
) -> dict:
    """Loss, top-1 and top-5 over exactly the images this run evaluates, summed on every rank then all-reduced.
    `tta_flip`: the logits are the mean of the image's and its mirror's. With `stop` (a StopPoll), a stop signal
    ends it between two batches: returns {"stopped_by": signal name}. `sharded` (FSDP): each forward gathers
    parameters from every rank, so a rank with one batch fewer runs one uncounted forward more. `keep_confusion`:
    the result's "confusion" is the [true, predicted] matrix of counts (on the CPU). `keep_predictions`: the
    result's "predictions" are (image index, label, top-5 classes, their probabilities) of every image, gathered
    from every rank on the CPU, in the data set's order."""
    if sharded:
        from dlojz_lib.fsdp import reshard
    if ranks.enabled:  # BN statistics drift per rank in training: validate rank 0's model, as checkpointed
        for buffer in net.buffers():
            dist.broadcast(buffer, 0)
    net.eval()
    if stop is not None:
        stop.watchdog.disarm()  # the first batch (compilation in eval mode) is not timed
    totals = torch.zeros(4, dtype=torch.float64, device=ranks.device)  # loss sum, top-1 and top-5 correct, images
    confusion = None  # [true class x predicted class] counts, flattened, made at the first batch (its width)
    forwards, images = 0, None
    predictions = [] if keep_predictions else None  # (labels, top-5, probabilities) per batch, on the device
    with torch.no_grad():
        for batch_index, (images, labels) in enumerate(loaders.val_batches):
            if max_batches is not None and batch_index >= max_batches:
                break
            forwards += 1
            # Asked only while every rank has a batch (the last may have one fewer): the same calls on all.
            if stop is not None and batch_index < loaders.n_val_batches_every_rank and stop():
                return dict(stopped_by=stop.stop_signal.name or "signal on another rank")
            with training.autocast():
                outputs = net(images).float()
                if tta_flip:
                    outputs = (outputs + net(images.flip(3)).float()) / 2
            loss = training.val_criterion(outputs, labels)
            top5 = outputs.topk(min(5, outputs.shape[1]), dim=1).indices
            totals += torch.stack(
                [
                    loss.double(),
                    (top5[:, 0] == labels).sum().double(),
                    (top5 == labels[:, None]).any(dim=1).sum().double(),
                    (labels >= 0).sum().double(),  # an image that could not be read is not counted (MISSING_LABEL)
                ]
            )
            classes = outputs.shape[1]
            if confusion is None:
                confusion = torch.zeros(classes * classes, dtype=torch.int64, device=ranks.device)
            # index_add_ with a 0/1 weight, not bincount of the kept labels: no length read back from the device
            confusion.index_add_(0, labels.clamp(min=0) * classes + top5[:, 0], (labels >= 0).long())
            if predictions is not None:
                predictions.append((labels, top5, outputs.softmax(dim=1).gather(1, top5)))
        if sharded:  # the other ranks' last forwards gather this rank's shards too
            for _ in range(forwards, min(loaders.n_val_batches_most, max_batches or loaders.n_val_batches_most)):
                with training.autocast():  # (every rank has an image: build_loaders checks it)
                    net(images[:1])
                    if tta_flip:
                        net(images[:1].flip(3))
            reshard(net)  # blocks kept gathered after their forward (--no-fsdp-reshard-after-forward) free them
    if stop is not None:
        stop.settle()  # a signal it found is asked again at the next call: this validation is complete
    # One all-reduce and one wait for the device: the totals and the confusion counts (exact in float64) together.
    results = totals if confusion is None else torch.cat([totals, confusion.double()])
    with stop.watchdog.collective("the validation's totals", ranks.enabled) if stop else contextlib.nullcontext():
        if ranks.enabled:
            dist.all_reduce(results)  # (every rank has a batch, hence the same length: build_loaders checks it)
        results = results.cpu()
    if stop is not None:
        stop.watchdog.disarm()
    net.train()
    loss_sum, correct, correct5, count = results[:4].tolist()
    count_or_1 = max(count, 1)
    per_class = {}
    if confusion is not None:  # (`classes`: the width of the batches' logits)
        counts = results[4:].view(classes, classes)
        per_class = class_summary(counts)
        if keep_confusion:
            per_class["confusion"] = counts.long()
    if predictions is not None:
        per_class["predictions"] = gather_predictions(predictions, ranks)
    return dict(
        val_loss=loss_sum / count_or_1,
        val_accuracy=correct / count_or_1,
        val_top5_accuracy=correct5 / count_or_1,
        val_images=int(count),
        **per_class,
    )


def gather_predictions(predictions, ranks):
    """evaluate()'s predictions of every rank on rank 0's CPU, in the data set's order: (image index, label,
    top-5 classes, their probabilities). ShardSampler gives rank r the images r, r + W, r + 2W..., in order."""
    labels, top5, probabilities = (torch.cat(parts).cpu() for parts in zip(*predictions))
    index = torch.arange(len(labels)) * ranks.world_size + ranks.rank
    mine = (index, labels, top5, probabilities)
    if not ranks.enabled:
        return mine
    every = [None] * ranks.world_size
    dist.all_gather_object(every, mine)  # once, at the end of --eval-only: a pickled copy is no cost
    index, labels, top5, probabilities = (torch.cat(parts) for parts in zip(*every))
    order = index.argsort()
    return index[order], labels[order], top5[order], probabilities[order]


# ================================================================ the sections' functions, in main's order


def stop_run(cfg, reason, saver, state, loaders, ranks, log, metrics, chrono, wandb_run):
    """A stop signal (preemption, time limit): checkpoint where training is, write W&B and the metrics, then
    requeue the Slurm job (last: Slurm ends the job's processes as it requeues it)."""
    checkpoint_for_stop(cfg, saver, state, reason, loaders.n_train_batches, ranks, log)
    metrics.update(stopped_by=reason, epochs=state.epoch)
    finish(cfg, metrics, chrono, ranks, wandb_run, teardown=True)
    if ranks.enabled:
        dist.barrier()  # every rank has written what it had to
    requeue(cfg, ranks, reason)
    return metrics


def diverged(cfg, bad_step, epoch):
    kept = ckpt.newest_checkpoint(cfg.output_dir)
    where = f"; last good checkpoint kept: {kept}" if kept else "; no checkpoint written"
    raise TrainingDiverged(
        f"loss is not finite (nan/inf) at step {int(bad_step)} (epoch {epoch + 1}): "
        f"stopping{where}; lower --lr or check the data"
    )


def validate(cfg, epoch, model, loaders, training, ranks, chrono, max_batches, log, stop, train_seconds) -> dict:
    """The end-of-epoch validation of the model (and of its EMA), timed, with its console lines; or
    {"stopped_by": signal} when a stop signal interrupted it."""
    chrono.validation()
    metrics = evaluate(
        model.module, loaders, training, ranks, max_batches, stop, cfg.tta_flip, model.parallel == "fsdp"
    )
    chrono.validation()
    if "stopped_by" in metrics:
        return metrics
    epoch = f"Epoch [{epoch + 1}/{cfg.epochs}]"
    log("##EVALUATION STEP##")
    log(
        f"{epoch}, Validation Loss: {metrics['val_loss']:.4f}, Validation Accuracy: {metrics['val_accuracy']:.4f}, "
        f"top-5 {metrics['val_top5_accuracy']:.4f}, balanced {metrics['val_balanced_accuracy']:.4f}, macro-F1 "
        f"{metrics['val_macro_f1']:.4f} ({metrics['val_images']} images{', flip TTA' if cfg.tta_flip else ''})"
    )
    log(f">>> Validation complete in: {chrono.val_time:.2f} s (this epoch's training: {train_seconds:.2f} s)")
    if model.ema is not None:
        ema = evaluate(model.ema.module, loaders, training, ranks, max_batches, stop, cfg.tta_flip)
        if "stopped_by" in ema:
            return ema
        metrics.update(
            ema_val_loss=ema["val_loss"],
            ema_val_accuracy=ema["val_accuracy"],
            ema_val_top5_accuracy=ema["val_top5_accuracy"],
        )
        log(
            f"{epoch}, EMA model: Validation Loss: {ema['val_loss']:.4f}, Validation Accuracy: {ema['val_accuracy']:.4f}, "
            f"top-5 {ema['val_top5_accuracy']:.4f}"
        )
    return metrics


def cli(argv=None) -> int:
    """Run main(); turn every failure into an exit status and one line, and never leave a rank waiting:
    0 done, 2 bad input, 3 loss diverged, 4 another rank lost, 5 a checkpoint the run needed not written (disk
    full, folder read-only), 6 stopped with a checkpoint but not requeued, 1 crash, 130 interrupted."""
    rank = idr_torch.rank
    status = 0
    running = {}
    try:
        try:
            if (main(argv, running) or {}).get(
                "stopped_by"
            ) == INTERRUPTED:  # Ctrl-C, checkpointed: the shell's status for it
                status = 130
            if "watchdog" in running:
                running["watchdog"].finish()
        except SystemExit as err:  # argparse: --help, or a bad flag already reported in one line
            status = err.code if isinstance(err.code, int) else 2
        except (UserError, DataError) as err:
            if rank == 0 or idr_torch.world_size == 1:
                print(f"dlojz: error: {err}", file=sys.stderr, flush=True)
            status = 2
        except TrainingDiverged as err:
            if rank == 0:
                print(f"dlojz: error: {err}", file=sys.stderr, flush=True)
            status = 3
        except ckpt.CheckpointNotWritten as err:
            if rank == 0:
                print(f"dlojz: error: {err}", file=sys.stderr, flush=True)
            status = 5
        except RequeueFailed as err:  # (raised on rank 0 only, after every rank's part of the stop)
            print(f"dlojz: error: {err}", file=sys.stderr, flush=True)
            status = 6
        except KeyboardInterrupt:
            status = 130
        except Exception as err:
            if idr_torch.world_size > 1 and "ranks" in running and is_lost_peer(err):  # (no state: in start-up)
                status = report_lost_peer(running["ranks"], running["output_dir"], running.get("state"))
            else:
                status = report_crash(err, rank)
    finally:  # also when a report itself fails (its terminal or pipe gone): the workers ignore SIGTERM, so
        for loader in LOADERS:  # left to the interpreter's exit they would be waited for forever
            close_loader(loader)
        LOADERS.clear()
        release_output_dir()
    if dist.is_available() and dist.is_initialized():
        if status == 0 or idr_torch.world_size == 1:  # (--fsdp's group of one: no peer to wait for)
            dist.destroy_process_group()
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)  # do not wait on peers or worker shutdown that may never come
    return status


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)  # started: cli() answers Ctrl-C from here on
    sys.exit(cli())
