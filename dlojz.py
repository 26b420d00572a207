"""dlojz: ResNet-50 / ImageNet training, optimised flag by flag (IDRIS course "Deep Learning Optimisé - Jean Zay").

One command runs alone, under torchrun or under srun across nodes:
    python dlojz.py --test                  # first run: 50 steps, chronometer report (CPU profile without a GPU)
    srun python -u dlojz.py -b 256 -e 90    # on a Slurm GPU allocation, one task per GPU
`main()` reads top to bottom in the course's order: arguments, instantiation (distribution, model, loss,
optimizer), DataLoader, initialisation, training, validation, checkpoint and report. Each section calls one
function, below it or in a helper module; `train_one_epoch` and `evaluate` are the loop's two phases. The flags
live in dlojz_lib/settings/flags.py, the run's settings and their checks in dlojz_lib/settings/config.py, the process group in dlojz_lib/dist.py,
the data sets and batches in dlojz_lib/data/loaders.py, the model in dlojz_lib/model/build.py, its layout (DDP, FSDP, --tp, --pp, compile) in dlojz_lib/parallelism/layout.py,
its loss, optimizer and schedule in dlojz_lib/optim/, checkpoints and resume in dlojz_lib/resume.py, the lines the run
prints in dlojz_lib/log.py, the chronometer, profiler and LR finder hooks in dlojz_lib/observers/hooks.py.
"""

import contextlib
import dataclasses
import math
import os
import signal
import sys
import time
from datetime import timedelta

if __name__ == "__main__":  # --help and every bad flag answer here, before the seconds that torch takes to import
    from dlojz_lib.settings.flag_checks import check_command_line

    check_command_line()

    def interrupted_while_starting(signum, frame):  # Ctrl-C in the imports: a line, not a traceback from torch's
        print("dlojz: interrupted while starting, before any training: nothing to resume", file=sys.stderr)
        os._exit(128 + signum)

    signal.signal(signal.SIGINT, interrupted_while_starting)

import torch
import torch.distributed as dist

import dlojz_lib.checkpoint as ckpt
from dlojz_lib.checks import DataError, UserError, one_line, say_refusal
from dlojz_lib.data.datasets import class_counts
from dlojz_lib.data.loaders import Loaders, build_data, build_loaders, measure_loader_only
from dlojz_lib.dist import (
    INTERRUPTED,
    Distribution,
    HostMemoryBound,
    LostPeerReport,
    PeerLost,
    RequeueFailed,
    StopPoll,
    StopSignal,
    agree_on_stop,
    checkpoint_for_stop,
    refusal_claim,
    report_crash,
    requeue,
    setup_distributed,
)
from dlojz_lib.global_batch import fit_to_ranks
from dlojz_lib.log import LOG_EVERY, Console, Progress, finish, warn_unwritten
from dlojz_lib.metrics import gather_predictions, write_per_class, write_predictions
from dlojz_lib.metrics import summary as class_summary
from dlojz_lib.model.build import build_model
from dlojz_lib.observers.chrono import Chronometer
from dlojz_lib.observers.hooks import LoopHooks, make_profiler
from dlojz_lib.observers.watchdog import Watchdog
from dlojz_lib.optim.losses import soft_target_accuracy
from dlojz_lib.optim.training import Training, build_training
from dlojz_lib.parallelism.fsdp import ShardedCheckpointSaver, match_sharded_forwards
from dlojz_lib.parallelism.layout import Model, lay_out, resolved_with_layout
from dlojz_lib.resume import (
    TrainState,
    claim_output_dir,
    find_checkpoint,
    make_saver,
    periodic_checkpoints,
    record_best,
    restore,
    save_epoch_checkpoint,
)
from dlojz_lib.run_record import (
    announce_resolution,
    announce_run,
    close_hooks,
    initial_metrics,
    open_wandb,
    record_settings,
    record_validation,
    report_run,
)
from dlojz_lib.settings.config import Config
from dlojz_lib.settings.flag_checks import check_flags
from dlojz_lib.settings.flags import get_args_parser
from dlojz_lib.settings.launch import load_idr_torch

TEST_VAL_BATCHES = 20  # --test validates on this many batches


class TrainingDiverged(Exception):
    """The loss became NaN/inf: stop (exit 3), keep the last good checkpoint."""


@dataclasses.dataclass
class EpochResult:
    train_loss: float
    train_accuracy: float
    stop_reason: str | None  # a signal's name: the epoch was left for a checkpoint and a requeue


@dataclasses.dataclass
class Run:
    """What main() has built once training can start, for the sections' functions below it: one record instead of
    a dozen parameters each. `started`: the clock at the run's start (a resumed run's first start)."""

    cfg: Config
    ranks: Distribution
    log: Console
    stop: StopPoll
    chrono: Chronometer
    model: Model
    training: Training
    loaders: Loaders
    state: TrainState
    metrics: dict
    val_max_batches: int | None
    started: float = 0.0
    saver: ckpt.CheckpointSaver | ShardedCheckpointSaver | None = None  # none for --test, --eval-only
    wandb_run: object = None  # W&B's run, or a NoWandb that stands in for it

    def __post_init__(self):
        self.stop.watchdog.time_after_buffer_broadcast(self.model.net)  # (DDP: a straggler is not hidden there)


def main(argv=None, resources=None) -> dict:
    """One run, in the course's order; returns its metrics. Bad input raises UserError (see cli). `resources`: the
    run's ExitStack (DataLoader workers, the folder's lock, the lost-peer report), cli()'s or one of its own."""
    if resources is None:  # a caller other than cli(): what the run holds is released at its end
        with contextlib.ExitStack() as resources:
            return main(argv, resources)
    # ================================ ARGUMENTS: every check, before any process group or data scan
    run_start = time.perf_counter()  # time to target counts from here, start-up included
    args = get_args_parser().parse_args(argv)
    if args.fetch_weights:  # on a login node, before any check that wants the weights already there
        return fetch_weights_only(args)
    cfg = resolved_with_layout(args)  # (--layout auto: the planner's layout, as if its flags were given)
    stop_signal = StopSignal().install()  # installed first: a signal arriving during start-up must not kill the job

    # ================================ INSTANTIATION: distribution
    ranks, cfg = setup_distributed(cfg)
    watchdog = Watchdog.for_run(cfg.section("distribution"), cfg.output_dir, ranks)  # a hung rank ends the job
    stop = StopPoll(stop_signal, ranks, timedelta(seconds=cfg.dist_timeout), watchdog.start())
    resources.push(peer_report := LostPeerReport(ranks, cfg.output_dir, watchdog))  # a rank lost: one line from here
    log = Console(ranks.is_main)
    claim_output_dir(cfg.section("logging"), cfg.section("modes"), ranks, log, resources)  # one run a folder
    cfg = fit_to_ranks(cfg, ranks.data_size, log)  # (before the loaders and the schedule: batch, --grad-acc, --lr)
    idr_torch = load_idr_torch()  # the launch, as setup_distributed read it
    announce_run(cfg.notes, ranks, log, f"{idr_torch.num_nodes} nodes", idr_torch.current_API)
    # --test: the chronometer times each phase of the first steps, then the last --test-unsync-steps as a whole
    synced = (cfg.test_nsteps - cfg.test_unsync_steps) * cfg.grad_acc if cfg.test_unsync_steps else None
    chrono = Chronometer(enabled=cfg.test, rank=ranks.rank, device=ranks.device, synced_steps=synced)

    # ================================ DATA SETS (the model needs the number of classes), --resume's checkpoint
    train_set, val_set, classes = build_data(cfg, ranks, log)
    resumed = find_checkpoint(cfg.section("logging"), cfg.eval_only, cfg.arch, len(classes), log, cfg.parallelism.fsdp)

    # ================================ INSTANTIATION: model, loss, optimizer
    model = build_model(cfg, len(classes), ranks, log)  # whole: created, its weights, checkpointing, EMA
    model = lay_out(model, cfg, ranks, log)  # then laid out: DDP, FSDP, --tp, --pp, torch.compile

    # ================================ DATALOADER
    loaders = build_loaders(cfg, train_set, val_set, len(classes), ranks, log)
    resources.callback(loaders.close)  # the workers ignore SIGTERM: stopped at the run's end, whatever happens
    metrics = initial_metrics(cfg.batch_size, cfg.grad_acc, cfg.compute_dtype, ranks)
    if cfg.loader_only:
        return measure_loader_only(cfg.test_nsteps, cfg.num_workers, cfg.metrics_json, loaders, ranks, metrics, log)
    counts = class_counts(train_set, len(classes))
    training = build_training(cfg, model, loaders.n_train_batches, len(classes), ranks, log, counts)

    # ================================ INITIALISATION: resume, W&B, hooks
    state, resumed_from = restore(cfg, model, training, loaders.n_train_batches, ranks, log, resumed)
    peer_report.state = state  # (the step a lost peer's line names)
    val_max_batches = TEST_VAL_BATCHES if cfg.test else None  # --test validates on a few batches
    run = Run(cfg, ranks, log, stop, chrono, model, training, loaders, state, metrics, val_max_batches)
    if cfg.eval_only:
        return evaluate_only(run, resumed_from, classes, val_set)
    if resumed_from and state.epoch >= cfg.epochs and training.lr_finder is None:  # its metrics stay as they are
        log(f"nothing to train: the run has done its {state.epoch} epochs; give --epochs N > {state.epoch} to go on")
        return {}
    record_settings(cfg, argv, ranks, log)  # (every check passed: the run's own record, args.toml)
    run.wandb_run = wandb_run = open_wandb(cfg, ranks, metrics, state)
    run.saver = make_saver(cfg, model, training, ranks, classes)
    profiler = make_profiler(cfg.section("profiler"), cfg.output_dir, ranks.rank, ranks.device, log)  # or None
    hooks = LoopHooks(chrono, profiler, training.lr_finder, ranks.enabled, HostMemoryBound.on(ranks.device))
    progress = Progress(log, wandb_run, ranks.device, cfg.epochs, loaders.n_train_batches, cfg.grad_acc,
                        cfg.batch_size * ranks.data_size)  # images a step: a micro-batch on each data replica  # fmt: skip

    # ================================ TRAINING
    chrono.start()
    run.started = run_start - state.elapsed_s  # a resumed run goes on counting from the first run's start
    periodic = periodic_checkpoints(cfg, run.saver, run.started, loaders.n_train_batches, training.lr_finder, log)
    epoch_end = (cfg.test_nsteps if cfg.test else None, cfg.output_dir)  # (--test's steps; a divergence's folder)
    for epoch in range(state.epoch, cfg.epochs):
        epoch_start = time.perf_counter()
        if cfg.min_res is not None:  # the data set's workers crop at this resolution (the sample keys carry the epoch)
            announce_resolution(cfg, epoch, log, wandb_run, state.global_step)
        result = train_one_epoch(model, training, loaders, state, ranks, hooks, progress, stop, periodic, *epoch_end)
        train_seconds = time.perf_counter() - epoch_start
        if result.train_loss is not None:  # None: resumed after this epoch's training, before its validation
            metrics.update(train_loss=result.train_loss, train_accuracy=result.train_accuracy)
        metrics["steps"] = state.global_step
        state.elapsed_s = time.perf_counter() - run.started
        if training.lr_finder is not None:  # the range test sweeps on over the next epoch, without validation
            if training.lr_finder.done:
                break
            continue
        if result.stop_reason:  # preempted or at the time limit: checkpoint mid-epoch, requeue, exit cleanly
            return stop_run(run, result.stop_reason)

        # ================================ VALIDATION (every --val-every epochs and at the last)
        validation = {}
        if (epoch + 1) % cfg.val_every == 0 or epoch + 1 == cfg.epochs or cfg.test:
            validation = validate(run, epoch, train_seconds)
            if validation.get("stopped_by"):  # resumed, the run validates this epoch first
                return stop_run(run, validation["stopped_by"])
        # ================================ CHECKPOINT
        if save_epoch(run, epoch, validation, periodic):  # True: the end of --test, or --target-accuracy reached
            break
    stop.disarm("at the run's end (the last checkpoint, the report)")
    run.saver.wait()  # the last checkpoint's background write
    metrics.update(close_hooks(cfg.output_dir, hooks, ranks, log))

    # ================================ REPORT
    return report_run(run, progress, watchdog)


def fetch_weights_only(args) -> dict:
    """--fetch-weights: the flags checked, the weights fetched into the cache, nothing trained."""
    from dlojz_lib.model.pretrained import fetch_weights

    check_flags(vars(args))
    print(fetch_weights(args.arch, args.pretrained), flush=True)
    return {}


def evaluate_only(run, resumed_from, classes, val_set) -> dict:
    """--eval-only: validate the checkpoint's weights (or its EMA's) and report, with the results per class in the
    output folder and, with --predictions, each image's. A stop signal (Slurm's warning, SIGTERM, Ctrl-C) ends it
    between two batches: nothing to checkpoint, nothing written, exit 128 + the signal's number."""
    cfg, ranks, chrono, metrics, log = run.cfg, run.ranks, run.chrono, run.metrics, run.log
    chrono.validation()
    result = evaluate(
        run.model.evaluated,
        run.loaders,
        run.training,
        ranks,
        run.val_max_batches,
        stop=run.stop,
        tta_flip=cfg.tta_flip,
        sharded=run.model.parallel == "fsdp",
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


def train_one_epoch(
    model, training, loaders, state, ranks, hooks, progress, stop, checkpoints=None, test_steps=None, output_dir="."
) -> EpochResult:
    """Train on what is left of epoch `state.epoch` (from micro-batch `state.batch`), stopping early after
    `test_steps` optimizer steps (--test), on a stop signal (any rank) or when the LR finder is done; `checkpoints`
    (--checkpoint-every) saves mid-epoch; a non-finite loss stops the run, naming `output_dir`'s last checkpoint. The metrics stay on the device: the host waits for them only at log points (every LOG_EVERY
    optimizer steps and at console lines). The hot loop, on one screen: a step's operations in their order."""
    loaders.start_epoch(state.epoch, state.batch)
    progress.new_epoch(hooks.data_wait_s)
    epoch_totals = torch.zeros(3, dtype=torch.float64, device=ranks.device)  # loss sum, correct, images
    first_nonfinite = torch.full((), -1.0, dtype=torch.float64, device=ranks.device)  # step of a NaN/inf loss
    stop_reason = None
    model.net.train()
    stop.disarm()  # the first step (compilation, autotuning) is not timed
    batches = hooks.loading(loaders.train_batches)
    for images, labels in batches:
        progress.first_batch(images)
        batch_index = state.batch
        # MixUp/CutMix: soft labels, which the loss and the train accuracy take as they are
        images, targets = training.mix(images, labels) if training.mix is not None else (images, labels)
        optimizer_step = (batch_index + 1) % training.grad_acc == 0 or batch_index == loaders.n_train_batches - 1
        loss, accuracy = forward_backward(model, training, images, targets, hooks, stop, optimizer_step)
        if optimizer_step:
            with hooks.phase("optimizer_step"):  # (frozen layers dropped, clip, scaler step, zero_grad, EMA)
                step_optimizer(model, training, training.clip_grad_norm, state.global_step + 1)
        state.batch += 1
        hooks.step_done()
        if not optimizer_step:
            progress.micro_step_done()
            continue
        state.global_step += 1
        if training.scheduler is not None:
            training.scheduler.step()
        with torch.no_grad():  # added on the device: no wait for the host
            stats, count, first_nonfinite = step_stats(loss, accuracy, labels, first_nonfinite, state.global_step)
            progress.micro_step_done(stats)
            epoch_totals += stats
        if hooks.optimizer_step_done(loss, stats[1], count):  # the LR finder has swept its range
            break
        # a stop signal on any rank (asked without waiting for the GPU): all ranks stop here
        if stop.requested(state.global_step):
            stop_reason = stop.stop_signal.name or "signal on another rank"
            break
        end_of_test = test_steps is not None and state.global_step >= test_steps
        console_line = progress.is_console_line(batch_index) or end_of_test
        if state.global_step % LOG_EVERY == 0 or console_line:
            due = checkpoints is not None and checkpoints.due()  # rank 0's clock; the all-reduce tells the others
            stop_requested, bad_step, save_now, straggler = agree_on_stop(stop, first_nonfinite, ranks, due)
            if straggler:  # named once per rank
                progress.console(straggler)
            progress.mark(hooks.data_wait_s)
            if bad_step >= 0:
                diverged(output_dir, bad_step, state.epoch)
            lr = training.optimizer.param_groups[0]["lr"]  # the next step's (the scheduler has stepped)
            if state.global_step % LOG_EVERY == 0:
                progress.log_train(state.global_step, loss, lr)
            if console_line:
                progress.console_line(state.epoch, batch_index, lr, hooks.data_wait_s)
            if stop_requested:
                stop_reason = stop.stop_signal.name or "signal on another rank"
                break
            if save_now and state.batch < loaders.n_train_batches:  # (the epoch's end writes its own)
                stop.disarm("writing a checkpoint")  # a sharded save on a slow file system: minutes
                checkpoints.save(state)
        if end_of_test:
            hooks.chrono.end_window()  # the unsynchronised window's one wait, at its end
            break
    batches.close()  # leaving mid-epoch (test, stop signal): release this epoch's iterator and its workers' batches now
    stop.settle()
    progress.console.end_live_line()
    return epoch_result(epoch_totals, stop_reason, ranks, stop)


def forward_backward(model, training, images, targets, hooks, stop, optimizer_step):
    """A micro-batch's forward, loss and backward, its gradients reduced across ranks at an optimizer step's; under
    --pp the schedule's step (every micro-batch's forward and backward through the stages). Returns the loss and,
    at an optimizer step, the accuracy (under --pp both the last stage's, on every stage)."""
    if model.pipeline is not None:
        with hooks.phase("pipeline"), stop.timing(), stop.collective("the pipeline's step"), training.autocast():
            return model.pipeline.step(images, targets)
    teacher = ()
    if training.teacher is not None:  # --teacher: its logits, without gradients, in a phase of their own
        with hooks.phase("teacher"), training.autocast():
            teacher = (training.teacher(images),)
    with model.gradient_sync(optimizer_step):  # accumulating: gradients reduced at the last micro-batch only
        with hooks.phase("forward"), stop.timing(), training.autocast():
            model.begin_step()  # CUDA graphs: the last step's outputs may be overwritten
            outputs = model.net(images)
            with hooks.phase("loss"):
                loss = training.criterion(outputs, targets, *teacher)
        with hooks.phase("backward"), stop.collective("the gradient all-reduce", optimizer_step):
            training.scaler.scale(loss / training.grad_acc).backward()
    if not optimizer_step:
        return loss, None
    with torch.no_grad():
        return loss, soft_target_accuracy(outputs, targets)


def step_optimizer(model, training, clip_grad_norm, next_step):
    """An optimizer step: the frozen layers' gradients dropped, the clip, the (scaled) step, zero_grad, the EMA."""
    if training.drop_frozen_gradients is not None:  # frozen layers: out of the clip's norm and the scaler
        training.drop_frozen_gradients()
    if model.whole_copies is not None:  # --tp: one step for the tensor group's copies of its replicated weights
        model.whole_copies.average_gradients()
    if clip_grad_norm is not None:  # on the true gradients: unscaled first under float16
        training.scaler.unscale_(training.optimizer)
        model.clip_grad_norm(clip_grad_norm)
    training.scaler.step(training.optimizer)  # skipped by the float16 scaler when gradients overflowed
    training.scaler.update()
    training.optimizer.zero_grad(set_to_none=True)
    if model.after_step is not None:  # --float8 under --fsdp: the new weights' scales, for the next all-gathers
        model.after_step()
    if model.whole_copies is not None:
        model.whole_copies.check(next_step)  # --check-replicas N: every N steps (a wait for the device then)
    if model.ema is not None and model.ema.due(next_step):
        model.ema.update_parameters(model.module)


def step_stats(loss, accuracy, labels, first_nonfinite, step):
    """(the step's [loss sum, correct, images] on the device, its image count, the first step whose loss is not
    finite so far): a Python scalar or torch.full, as torch.tensor(x, device=cuda) would wait for the host."""
    count = float(labels.numel())
    stats = torch.stack(
        [
            loss.detach().double() * count,
            accuracy.double() * count,
            torch.full((), count, dtype=torch.float64, device=loss.device),
        ]
    )
    nonfinite_now = (first_nonfinite < 0) & ~torch.isfinite(loss.detach())
    return stats, count, torch.where(nonfinite_now, float(step), first_nonfinite)


def epoch_result(epoch_totals, stop_reason, ranks, stop) -> EpochResult:
    """The epoch's loss and accuracy over every rank: one all-reduce and one read, at the epoch's end."""
    with stop.collective("the epoch's totals", ranks.enabled):
        if ranks.enabled:
            dist.all_reduce(epoch_totals, group=ranks.data_group)
        loss_sum, correct, count = epoch_totals.tolist()
    stop.disarm()
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
    if ranks.enabled:  # BN statistics drift per data replica in training: validate the first's, as checkpointed
        for buffer in net.buffers():  # (--tp, --pp: over the ranks holding the same part of the model)
            dist.broadcast(buffer, group=ranks.data_group, group_src=0)
    net.eval()
    if stop is not None:
        stop.disarm()  # the first batch (compilation in eval mode) is not timed
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
            if stop is not None and batch_index < loaders.n_val_batches_every_rank and stop.requested():
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
            match_sharded_forwards(net, images, forwards, loaders, training, max_batches, tta_flip)
    if stop is not None:
        stop.settle()  # a signal it found is asked again at the next call: this validation is complete
    # One all-reduce and one wait for the device: the totals and the confusion counts (exact in float64) together.
    results = totals if confusion is None else torch.cat([totals, confusion.double()])
    with stop.collective("the validation's totals", ranks.enabled) if stop else contextlib.nullcontext():
        if ranks.enabled:  # (every rank has a batch, hence the same length: build_loaders checks it)
            dist.all_reduce(results, group=ranks.data_group)
        results = results.cpu()
    if stop is not None:
        stop.disarm()
    net.train()
    per_class = {}
    if confusion is not None:  # (`classes`: the width of the batches' logits)
        counts = results[4:].view(classes, classes)
        per_class = dict(class_summary(counts), **({"confusion": counts.long()} if keep_confusion else {}))
    if predictions is not None:
        per_class["predictions"] = gather_predictions(predictions, ranks)
    return dict(validation_figures(*results[:4].tolist()), **per_class)


def validation_figures(loss_sum, correct, correct5, count) -> dict:
    """The validation's loss, top-1 and top-5 from its totals over every rank."""
    count_or_1 = max(count, 1)
    return dict(
        val_loss=loss_sum / count_or_1,
        val_accuracy=correct / count_or_1,
        val_top5_accuracy=correct5 / count_or_1,
        val_images=int(count),
    )


# ================================================================ the sections' functions, in main's order


def stop_run(run, reason):
    """A stop signal (preemption, time limit): checkpoint where training is, write W&B and the metrics, then
    requeue the Slurm job (last: Slurm ends the job's processes as it requeues it)."""
    cfg, ranks, state = run.cfg, run.ranks, run.state
    checkpoint_for_stop(cfg.output_dir, cfg.test, run.saver, state, reason, run.loaders.n_train_batches, ranks, run.log)
    run.metrics.update(stopped_by=reason, epochs=state.epoch)
    finish(cfg, run.metrics, run.chrono, ranks, run.wandb_run, teardown=True)
    if ranks.enabled:
        dist.barrier()  # every rank has written what it had to
    requeue(cfg.section("logging"), cfg.test, ranks, reason)
    return run.metrics


def diverged(output_dir, bad_step, epoch):
    kept = ckpt.newest_checkpoint(output_dir)
    where = f"; last good checkpoint kept: {kept}" if kept else "; no checkpoint written"
    raise TrainingDiverged(
        f"loss is not finite (nan/inf) at step {int(bad_step)} (epoch {epoch + 1}): "
        f"stopping{where}; lower --lr or check the data"
    )


def validate(run, epoch, train_seconds) -> dict:
    """The end-of-epoch validation of the model (and of its EMA), timed, with its console lines; or
    {"stopped_by": signal} when a stop signal interrupted it."""
    cfg, model, chrono, log = run.cfg, run.model, run.chrono, run.log
    where = (run.loaders, run.training, run.ranks, run.val_max_batches, run.stop, cfg.tta_flip)
    chrono.validation()
    metrics = evaluate(model.evaluated, *where, model.parallel == "fsdp")
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
        ema = evaluate(model.ema.module, *where)
        if "stopped_by" in ema:
            return ema
        metrics.update({f"ema_{key}": value for key, value in ema.items() if isinstance(value, float)})
        log(
            f"{epoch}, EMA model: Validation Loss: {ema['val_loss']:.4f}, Validation Accuracy: {ema['val_accuracy']:.4f}, "
            f"top-5 {ema['val_top5_accuracy']:.4f}"
        )
    return metrics


def save_epoch(run, epoch, validation, periodic) -> bool:
    """The epoch's validation recorded (metrics, --val-history, W&B, the best so far) and its checkpoint written;
    True when the run ends here (the end of --test, --target-accuracy reached). A validation loss that is not finite
    ends the run (exit 3) once the epoch is saved."""
    cfg, state, metrics = run.cfg, run.state, run.metrics
    target_reached = best = False
    if validation:
        target_reached = record_validation(
            cfg, epoch, validation, state, metrics, run.started, run.wandb_run, run.ranks, run.log
        )
        best = record_best(cfg.best_metric, cfg.ema_judges, epoch, validation, state, metrics)
    metrics["epochs"] = epoch + 1
    run.stop.disarm(f"writing epoch {epoch + 1}'s checkpoint")
    state.epoch, state.batch, state.elapsed_s = epoch + 1, 0, time.perf_counter() - run.started
    if not cfg.test:
        save_epoch_checkpoint(run.saver, state, periodic, run.log, best)
    if validation and not math.isfinite(validation["val_loss"]):
        run.saver.wait()
        raise TrainingDiverged(
            f"the validation loss is not finite (nan/inf) after epoch {epoch + 1}: stopping; the epoch's "
            "checkpoint is kept "
            f"({ckpt.newest_checkpoint(cfg.output_dir) or 'none written'}); lower --lr, or validate without "
            "float16 (--amp-dtype bfloat16 or --no-amp) if the outputs overflow"
        )
    return cfg.test or target_reached


def cli(argv=None) -> int:
    """Run main(); turn every failure into an exit status and one line, and never leave a rank waiting:
    0 done, 2 bad input, 3 loss diverged, 4 another rank lost, 5 a checkpoint the run needed not written (disk
    full, folder read-only), 6 stopped with a checkpoint but not requeued, 1 crash, 130 interrupted."""
    idr_torch = load_idr_torch()  # which rank this is, before main() reads anything
    rank = idr_torch.rank
    status = 0
    try:
        with contextlib.ExitStack() as resources:  # closed before any line below: workers, lock, lost peer
            if (main(argv, resources) or {}).get("stopped_by") == INTERRUPTED:  # Ctrl-C, checkpointed
                status = 130
    except PeerLost as err:  # its one line said by the lowest survivor
        status = err.status
    except SystemExit as err:  # argparse: --help, or a bad flag already reported in one line
        status = err.code if isinstance(err.code, int) else 2
    except (UserError, DataError) as err:  # said once, by the first rank to refuse (the others may be waiting)
        say_refusal(f"dlojz: error: {one_line(err)}", rank, idr_torch.world_size, refusal_claim())
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
        status = report_crash(err, rank)
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
