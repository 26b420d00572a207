"""dlojz: ResNet-50 / ImageNet training, optimised flag by flag (IDRIS course "Deep Learning Optimisé - Jean Zay").

One command runs alone, under torchrun or under srun across nodes:
    python dlojz.py --test                  # first run: 50 steps, chronometer report (CPU profile without a GPU)
    srun python -u dlojz.py -b 256 -e 90    # on a Slurm GPU allocation, one task per GPU
`main()` reads top to bottom in the course's order: arguments, instantiation (distribution, model, loss,
optimizer), DataLoader, initialisation, training, validation, checkpoint and report. Each section calls a small
function below it; `train_one_epoch` and `evaluate` are the loop's two phases. The flags live in dlojz_flags.py,
the run's settings and their checks in dlojz_config.py, the batches in dlojz_loaders.py, checkpoints and resume in
dlojz_resume.py, the model's facts in dlojz_model.py, the lines the run prints in dlojz_log.py, the chronometer,
profiler and LR finder hooks in dlojz_hooks.py.
"""

import contextlib
import dataclasses
import os
import random
import sys
import time
from datetime import timedelta
from pathlib import Path

if __name__ == "__main__":  # --help and every bad flag answer here, before the seconds that torch takes to import
    from dlojz_flags import check_command_line

    check_command_line()

import numpy as np
import torch
import torch.distributed as dist

import dlojz_checkpoint as ckpt
import dlojz_optim as optim
from dlojz_chrono import Chronometer
from dlojz_config import Config, UserError, fail, load_idr_torch, resolve_config
from dlojz_flags import get_args_parser, recipe_text
from dlojz_data import (
    DataError,
    build_datasets,
    close_loader,
    embedded_dataset_root,
    measure_loader,
    resolve_data_root,
    select_train_subset,
)
from dlojz_dist import (
    INTERRUPTED,
    Distribution,
    StopPoll,
    StopSignal,
    agree_on_stop,
    checkpoint_for_stop,
    keep_freed_host_memory,
    requeue,
    start_compile_workers,
)
from dlojz_hooks import LoopHooks, make_profiler
from dlojz_loaders import LOADERS, build_loaders, synthetic_loaders
from dlojz_log import (
    LOG_EVERY,
    Console,
    NoWandb,
    Progress,
    append_json_line,
    chrono_context,
    finish,
    start_wandb,
    write_json,
    write_lr_finder,
    write_text,
)
from dlojz_resume import TrainState, make_saver, restore
from dlojz_model import ModelEma, apply_blurpool, create_model, enable_grad_checkpointing, meta_copy
from dlojz_transforms import (
    ValTransform,
    decoder_description,
    train_transform,
    training_resolution,
)

idr_torch = load_idr_torch()
TEST_VAL_BATCHES = 20  # --test validates on this many batches
SYNTHETIC_CLASSES = 1000  # --synthetic: ImageNet's


class TrainingDiverged(Exception):
    """The loss became NaN/inf: stop (exit 3), keep the last good checkpoint."""


@dataclasses.dataclass
class EpochResult:
    train_loss: float
    train_accuracy: float
    stop_reason: str | None  # a signal's name: the epoch was left for a checkpoint and a requeue


@dataclasses.dataclass
class Model:
    net: torch.nn.Module  # what trains: wrapped by DDP and torch.compile when asked
    module: torch.nn.Module  # the model without those wrappers (sharded in place by --fsdp): checkpointed, validated
    ema: torch.nn.Module | None  # --model-ema's averaged copy
    num_classes: int
    parallel: str  # "none", or "ddp" or "fsdp" across ranks
    unsharded: torch.nn.Module  # the model whole, for FLOP counts: `module`, or with --fsdp its meta-device copy

    def gradient_sync(self, sync):
        """Context of a micro-batch's forward and backward: gradients are reduced across ranks only when `sync`
        (the last micro-batch before an optimizer step)."""
        if self.parallel == "fsdp":
            self.module.set_requires_gradient_sync(sync)  # no reduce-scatter while accumulating
        elif self.parallel == "ddp" and not sync:
            return self.net.no_sync()  # no all-reduce while accumulating
        return contextlib.nullcontext()


def main(argv=None) -> dict:
    """One run, in the course's order; returns its metrics. Bad input raises UserError (see cli)."""
    # ================================ ARGUMENTS: every check, before any process group or data scan
    run_start = time.perf_counter()  # time to target counts from here, start-up included
    cfg = resolve_config(get_args_parser().parse_args(argv))
    stop_signal = StopSignal().install()  # installed first: a signal arriving during start-up must not kill the job

    # ================================ INSTANTIATION: distribution
    ranks, cfg = setup_distributed(cfg)
    stop = StopPoll(stop_signal, ranks, timedelta(seconds=cfg.dist_timeout))
    log = Console(ranks.is_main)
    for note in cfg.notes:
        log(note)
    log(
        f">>> Training on {idr_torch.num_nodes} nodes and {ranks.world_size} processes ({idr_torch.current_API}), "
        f"device {ranks.device}"
    )
    if ranks.is_main:
        log(f"arguments: {save_arguments(cfg, argv)} (dlojz.py --config FILE runs them again)")
    chrono = Chronometer(enabled=cfg.test, rank=ranks.rank, device=ranks.device)

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
    opt = optim.build_optimization(cfg, model, loaders.n_train_batches, len(classes), ranks, log)

    # ================================ INITIALISATION: resume, W&B, hooks
    state, resumed_from = restore(cfg, model, opt, loaders.n_train_batches, ranks.device, log)
    val_max_batches = TEST_VAL_BATCHES if cfg.test else None
    if cfg.eval_only:
        return evaluate_only(cfg, model, loaders, opt, ranks, chrono, resumed_from, val_max_batches, metrics, log)
    wandb_run = open_wandb(cfg, ranks, metrics, state)
    saver = make_saver(cfg, model, opt, ranks)
    profiler = make_profiler(cfg, Path(cfg.output_dir) / "profiler", ranks.rank, ranks.device) if cfg.prof else None
    hooks = LoopHooks(chrono, profiler, opt.lr_finder)
    progress = Progress(
        log, wandb_run, ranks.device, cfg.epochs, loaders.n_train_batches, cfg.grad_acc, images_per_step
    )

    # ================================ TRAINING
    chrono.start()
    started = run_start - state.elapsed_s  # a resumed run goes on counting from the first run's start
    for epoch in range(state.epoch, cfg.epochs):
        epoch_start = time.perf_counter()
        if cfg.min_res is not None:  # the data set's workers crop at this resolution (the sample keys carry the epoch)
            announce_resolution(cfg, epoch, log, wandb_run, state.global_step)
        result = train_one_epoch(model, opt, loaders, state, cfg, ranks, hooks, progress, stop)
        train_seconds = time.perf_counter() - epoch_start
        if result.train_loss is not None:  # None: resumed after this epoch's training, before its validation
            metrics.update(train_loss=result.train_loss, train_accuracy=result.train_accuracy)
        metrics["steps"] = state.global_step
        state.elapsed_s = time.perf_counter() - started
        if opt.lr_finder is not None:  # the range test sweeps on over the next epoch, without validation
            if opt.lr_finder.done:
                break
            continue
        if result.stop_reason:  # preempted or at the time limit: checkpoint mid-epoch, requeue, exit cleanly
            return stop_run(cfg, result.stop_reason, saver, state, loaders, ranks, log, metrics, chrono, wandb_run)

        # ================================ VALIDATION (every --val-every epochs and at the last)
        target_reached = False
        if (epoch + 1) % cfg.val_every == 0 or epoch + 1 == cfg.epochs or cfg.test:
            validation = validate(
                cfg, epoch, model, loaders, opt, ranks, chrono, val_max_batches, log, stop, train_seconds
            )
            if validation.get("stopped_by"):  # resumed, the run validates this epoch first
                return stop_run(
                    cfg, validation["stopped_by"], saver, state, loaders, ranks, log, metrics, chrono, wandb_run
                )
            target_reached = record_validation(cfg, epoch, validation, state, metrics, started, wandb_run, ranks, log)
        metrics["epochs"] = epoch + 1

        # ================================ CHECKPOINT
        state.epoch, state.batch, state.elapsed_s = epoch + 1, 0, time.perf_counter() - started
        if not cfg.test:  # rank 0 writes; with --fsdp every rank writes its shards
            log(f"checkpoint written: {saver.save(dataclasses.asdict(state))}")
        if cfg.test or target_reached:
            break
    hooks.close()
    if profiler is not None:
        log(
            f">>> Profiler traces: {Path(cfg.output_dir) / 'profiler'} (tensorboard --logdir "
            f"{Path(cfg.output_dir) / 'profiler'}, or open the .json in https://ui.perfetto.dev)"
        )
    if opt.lr_finder is not None and ranks.is_main:
        metrics.update(write_lr_finder(opt.lr_finder, Path(cfg.output_dir)))

    # ================================ REPORT
    metrics["images_per_second"] = progress.images_per_second()
    metrics["data_wait_ms"] = progress.data_wait_ms()  # steady state, per micro-batch, as images_per_second
    metrics.update(state_bytes_per_rank(model, opt, ranks))  # what DDP copies and FSDP shards
    metrics["grad_scaler_scale"] = opt.scaler.get_scale() if opt.scaler.is_enabled() else None  # float16 loss scale
    ctx = chrono_context(cfg, model, loaders, ranks, metrics, val_max_batches) if cfg.test and ranks.is_main else None
    return finish(cfg, metrics, chrono, ranks, wandb_run, ctx=ctx or {}, n_batches=loaders.n_train_batches)


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


def evaluate_only(cfg, model, loaders, opt, ranks, chrono, resumed_from, val_max_batches, metrics, log) -> dict:
    """--eval-only: validate the checkpoint's weights and report."""
    chrono.validation()
    metrics.update(
        evaluate(
            model.module,
            loaders,
            opt,
            ranks,
            val_max_batches,
            tta_flip=cfg.tta_flip,
            sharded=model.parallel == "fsdp",
        )
    )
    chrono.validation()
    log(
        f"##EVALUATION## {resumed_from}: Validation Loss: {metrics['val_loss']:.4f}, Validation Accuracy: "
        f"{metrics['val_accuracy']:.4f}, top-5 {metrics['val_top5_accuracy']:.4f} ({metrics['val_images']} "
        f"images{', flip TTA' if cfg.tta_flip else ''}, {chrono.val_time:.1f} s)"
    )
    return finish(cfg, metrics, chrono, ranks)


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


def save_arguments(cfg, argv) -> Path:
    """Every flag of this run (recipe, command line and profile merged) as a recipe file in its output folder:
    `args.toml`, written atomically, replaced by a resumed run."""
    path = Path(cfg.output_dir) / "args.toml"
    command = " ".join(sys.argv[1:] if argv is None else argv)
    header = [f"dlojz.py {command}", time.strftime("%Y-%m-%d %H:%M:%S")]
    write_text(path, recipe_text(cfg, get_args_parser(), header=header))
    return path


def train_one_epoch(model, opt, loaders, state, cfg, ranks, hooks, progress, stop) -> EpochResult:
    """Train on what is left of epoch `state.epoch` (from micro-batch `state.batch`), stopping early at the end of
    --test, on a stop signal (any rank) or when the LR finder is done. The metrics stay on the device: the host
    waits for it only at log points (every LOG_EVERY optimizer steps and at console lines). The hot loop, on one
    screen on purpose: split into functions, the order of a step's operations would be hidden."""
    loaders.start_epoch(state.epoch, state.batch)
    progress.new_epoch(hooks.data_wait_s)
    device = ranks.device
    epoch_totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, images
    first_nonfinite = torch.full((), -1.0, dtype=torch.float64, device=device)  # optimizer step of a NaN/inf loss
    stop_reason = None
    model.net.train()
    batches = hooks.loading(loaders.train_batches)
    for images, labels in batches:
        if progress.micro_steps == 0:
            progress.console(f"image batch shape: {tuple(images.shape)}, dtype {images.dtype}")
        batch_index = state.batch
        targets = labels
        if opt.mix is not None:  # soft labels; the loss and the train accuracy take them as they are
            images, targets = opt.mix(images, labels)
        optimizer_step = (batch_index + 1) % cfg.grad_acc == 0 or batch_index == loaders.n_train_batches - 1
        with model.gradient_sync(optimizer_step):  # accumulating: gradients reduced at the last micro-batch only
            with hooks.phase("forward"), opt.autocast():
                outputs = model.net(images)
                with hooks.phase("loss"):
                    loss = opt.criterion(outputs, targets)
            with hooks.phase("backward"):
                opt.scaler.scale(loss / cfg.grad_acc).backward()
        if optimizer_step:
            with hooks.phase("optimizer_step"):
                if cfg.clip_grad_norm is not None:  # on the true gradients: unscaled first under float16
                    opt.scaler.unscale_(opt.optimizer)
                    torch.nn.utils.clip_grad_norm_(model.module.parameters(), cfg.clip_grad_norm, foreach=True)
                opt.scaler.step(opt.optimizer)  # skipped by the float16 scaler when gradients overflowed
                opt.scaler.update()
                opt.optimizer.zero_grad(set_to_none=True)
                if model.ema is not None:
                    model.ema.update_parameters(model.module)
        state.batch += 1
        progress.micro_steps += 1
        hooks.step_done()
        if not optimizer_step:
            continue
        state.global_step += 1
        if opt.scheduler is not None:
            opt.scheduler.step()
        with torch.no_grad():  # a Python scalar or torch.full: torch.tensor(x, device=cuda) would wait for the host
            count = float(labels.numel())
            stats = torch.stack(
                [
                    loss.detach().double() * count,
                    optim.soft_target_accuracy(outputs, targets).double() * count,
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
        if stop():  # a stop signal on any rank (asked without waiting for the GPU): all ranks stop here
            stop_reason = stop.stop_signal.name or "signal on another rank"
            break
        end_of_test = cfg.test and state.global_step >= cfg.test_nsteps
        console_line = progress.is_console_line(batch_index) or end_of_test
        if state.global_step % LOG_EVERY == 0 or console_line:
            stop_requested, bad_step = agree_on_stop(stop.stop_signal, first_nonfinite, ranks)  # waits for the device
            progress.mark(hooks.data_wait_s)
            if bad_step >= 0:
                diverged(cfg, bad_step, state.epoch)
            lr = opt.optimizer.param_groups[0]["lr"]  # the next step's (the scheduler has stepped)
            if state.global_step % LOG_EVERY == 0:
                progress.log_train(state.global_step, loss, lr)
            if console_line:
                progress.console_line(state.epoch, batch_index, lr, hooks.data_wait_s)
            if stop_requested:
                stop_reason = stop.stop_signal.name or "signal on another rank"
                break
        if end_of_test:
            break
    batches.close()  # leaving mid-epoch (test, stop signal): release this epoch's iterator and its workers' batches now
    stop.settle()
    progress.console.end_live_line()
    if ranks.enabled:
        dist.all_reduce(epoch_totals)
    loss_sum, correct, count = epoch_totals.tolist()
    if count == 0:  # resumed after this epoch's training (stopped during its validation)
        return EpochResult(None, None, stop_reason)
    return EpochResult(loss_sum / count, correct / count, stop_reason)


def evaluate(net, loaders, opt, ranks, max_batches=None, stop=None, tta_flip=False, sharded=False) -> dict:
    """Loss, top-1 and top-5 over exactly the images this run evaluates, summed on every rank then all-reduced.
    `tta_flip`: the logits are the mean of the image's and its mirror's. With `stop` (a StopPoll), a stop signal
    ends it between two batches: returns {"stopped_by": signal name}. `sharded` (FSDP): each forward gathers
    parameters from every rank, so a rank with one batch fewer runs one uncounted forward more."""
    if sharded:
        from dlojz_fsdp import reshard
    if ranks.enabled:  # BN statistics drift per rank in training: validate rank 0's model, as checkpointed
        for buffer in net.buffers():
            dist.broadcast(buffer, 0)
    net.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=ranks.device)  # loss sum, top-1 and top-5 correct, images
    forwards, images = 0, None
    with torch.no_grad():
        for batch_index, (images, labels) in enumerate(loaders.val_batches):
            if max_batches is not None and batch_index >= max_batches:
                break
            forwards += 1
            # Asked only while every rank has a batch (the last may have one fewer): the same calls on all.
            if stop is not None and batch_index < loaders.n_val_batches_every_rank and stop():
                return dict(stopped_by=stop.stop_signal.name or "signal on another rank")
            with opt.autocast():
                outputs = net(images).float()
                if tta_flip:
                    outputs = (outputs + net(images.flip(3)).float()) / 2
            loss = opt.val_criterion(outputs, labels)
            top5 = outputs.topk(min(5, outputs.shape[1]), dim=1).indices
            totals += torch.stack(
                [
                    loss.double(),
                    (top5[:, 0] == labels).sum().double(),
                    (top5 == labels[:, None]).any(dim=1).sum().double(),
                    torch.full((), float(labels.numel()), dtype=torch.float64, device=ranks.device),
                ]
            )
        if sharded:  # the other ranks' last forwards gather this rank's shards too
            for _ in range(forwards, min(loaders.n_val_batches_most, max_batches or loaders.n_val_batches_most)):
                with opt.autocast():  # (every rank has an image: build_loaders checks it)
                    net(images[:1])
                    if tta_flip:
                        net(images[:1].flip(3))
            reshard(net)  # blocks kept gathered after their forward (--no-fsdp-reshard-after-forward) free them
    if stop is not None:
        stop.settle()  # a signal it found is asked again at the next call: this validation is complete
    if ranks.enabled:
        dist.all_reduce(totals)
    net.train()
    loss_sum, correct, correct5, count = totals.tolist()
    count_or_1 = max(count, 1)
    return dict(
        val_loss=loss_sum / count_or_1,
        val_accuracy=correct / count_or_1,
        val_top5_accuracy=correct5 / count_or_1,
        val_images=int(count),
    )


# ================================================================ the sections' functions, in main's order
def setup_distributed(cfg: Config):
    """This rank's device, the process group (NCCL on GPUs, gloo on CPUs) through idr_torch, the seeds, and one
    output folder for all ranks (rank 0's). Returns (Distribution, cfg)."""
    device = torch.device(cfg.torch_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # autotune convolutions for the fixed input size
        torch.backends.cuda.matmul.allow_tf32 = cfg.tf32
        torch.backends.cudnn.allow_tf32 = cfg.tf32
    elif keep_freed_host_memory():  # on a CPU, page faults for each step's activations cost ~20 % of the step
        cfg = dataclasses.replace(cfg, notes=(*cfg.notes, "host memory: freed memory kept for reuse (glibc mallopt)"))
    ranks = Distribution(idr_torch.world_size, idr_torch.rank, idr_torch.local_rank, device)
    if ranks.enabled:
        # device_id: NCCL connects now (a broken fabric fails at start-up) and knows each rank's GPU.
        idr_torch.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            timeout=timedelta(seconds=cfg.dist_timeout),
            device_id=device if device.type == "cuda" else None,
        )
        holder = [cfg.output_dir]
        dist.broadcast_object_list(holder, src=0)
        cfg = dataclasses.replace(cfg, output_dir=holder[0])
    elif cfg.fsdp:  # sharding over one process: a group of one (the same code path, and the GPU tests, on one GPU)
        dist.init_process_group(
            backend="nccl" if device.type == "cuda" else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            device_id=device if device.type == "cuda" else None,
        )
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    return ranks, cfg


def build_data(cfg, ranks, log):
    """(train set, val set, class names): --data-root, the variables, else the embedded data set; none with
    --synthetic."""
    if cfg.synthetic:
        log(f"data: synthetic (random tensors in memory), {SYNTHETIC_CLASSES} classes")
        return None, None, [str(i) for i in range(SYNTHETIC_CLASSES)]
    root, found_by = resolve_data_root(cfg.data_root)
    if root is None:
        if ranks.is_main:  # one rank generates, the others wait for it (the folder is renamed into place atomically)
            embedded_dataset_root()
        if ranks.enabled:
            dist.barrier()
        root = embedded_dataset_root()
        log(
            f"No --data-root, $DLOJZ_DATA, $ALL_CCFRSCRATCH/imagenet or $DSDIR/imagenet: using the embedded "
            f"data set ({root}, 10 classes of shapes and textures)"
        )
    train_set, val_set, classes, layout = build_datasets(
        root, train_transform(cfg), ValTransform(cfg.val_resize_size, cfg.val_crop_size), seed=cfg.seed
    )
    kind = layout if layout.startswith("packed") else f"{layout} layout"
    log(
        f"data: {root} ({kind}, found by {found_by}): {len(train_set)} train / {len(val_set)} val images, "
        f"{len(classes)} classes"
    )
    if cfg.train_subset is not None:  # cheap runs, e.g. hyper-parameter search trials
        log(select_train_subset(train_set, cfg.train_subset))
    log(f"JPEG decoding: {decoder_description()}")
    return train_set, val_set, classes


def build_model(cfg, num_classes, ranks, log) -> Model:
    module = create_model(cfg.arch, num_classes, cfg.zero_init_residual, cfg.image_size)
    if cfg.blurpool:  # before the copies below (SyncBN, EMA): they keep the blurred layers
        changed = apply_blurpool(module)
        if changed == 0:
            fail(f"--blurpool: --arch {cfg.arch} has no strided convolution or max-pool to blur")
        log(f"BlurPool: {changed} strided convolutions and max-pools blur their input first")
    if cfg.sync_bn and ranks.enabled:
        module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(module)
    if not cfg.fsdp:  # FSDP moves each rank's shards only to the device
        module = module.to(ranks.device)
    if cfg.channels_last:
        module = module.to(memory_format=torch.channels_last)
    if cfg.grad_checkpointing:
        enable_grad_checkpointing(module, cfg.arch)
    log(f"model: {cfg.arch}, {sum(p.numel() for p in module.parameters()):,} parameters")
    ema = None
    if cfg.model_ema:
        ema = ModelEma(module, cfg.model_ema_decay)
    net, parallel, unsharded = module, "none", module
    if cfg.fsdp:
        from dlojz_fsdp import shard_model

        unsharded = meta_copy(module)
        blocks = shard_model(module, cfg, ranks.device)
        parallel = "fsdp"
        log(
            f"FSDP: {blocks} blocks and the root sharded over {ranks.world_size} rank{'s' if ranks.world_size > 1 else ''}, parameters gathered in "
            f"{cfg.amp_dtype if cfg.amp else 'float32'}, gradients reduced in float32, "
            f"{'resharded' if cfg.fsdp_reshard_after_forward else 'kept gathered'} after each block's forward"
        )
    elif ranks.enabled:
        net = torch.nn.parallel.DistributedDataParallel(
            net, device_ids=[ranks.device.index] if ranks.device.type == "cuda" else None, gradient_as_bucket_view=True
        )
        parallel = "ddp"
    if cfg.compile:
        start_compile_workers()  # deaf to Slurm's preemption signal, which this process handles
        net = torch.compile(net)
    return Model(net, module, ema, num_classes, parallel, unsharded)


def state_bytes_per_rank(model, opt, ranks) -> dict:
    """Bytes of parameters, gradients and optimizer state on each rank (the largest), and each rank's peak."""
    from dlojz_fsdp import state_bytes
    from dlojz_model import peak_memory_bytes

    local = dict(state_bytes(model.module, opt.optimizer), peak_memory_bytes=peak_memory_bytes(ranks.device))
    every = ranks.all_gather(local) if ranks.enabled else [local]
    result = {f"{key}_per_rank": max(rank[key] for rank in every) for key in local if key != "peak_memory_bytes"}
    result["peak_memory_bytes_per_rank"] = [rank["peak_memory_bytes"] for rank in every]
    result["parallel"] = model.parallel
    return result


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
    kept = ckpt.list_checkpoints(cfg.output_dir) if Path(cfg.output_dir).is_dir() else []
    where = f"; last good checkpoint kept: {kept[-1]}" if kept else "; no checkpoint written"
    raise TrainingDiverged(
        f"loss is not finite (nan/inf) at step {int(bad_step)} (epoch {epoch + 1}): "
        f"stopping{where}; lower --lr or check the data"
    )


def validate(cfg, epoch, model, loaders, opt, ranks, chrono, max_batches, log, stop, train_seconds) -> dict:
    """The end-of-epoch validation of the model (and of its EMA), timed, with its console lines; or
    {"stopped_by": signal} when a stop signal interrupted it."""
    chrono.validation()
    metrics = evaluate(model.module, loaders, opt, ranks, max_batches, stop, cfg.tta_flip, model.parallel == "fsdp")
    chrono.validation()
    if "stopped_by" in metrics:
        return metrics
    epoch = f"Epoch [{epoch + 1}/{cfg.epochs}]"
    log("##EVALUATION STEP##")
    log(
        f"{epoch}, Validation Loss: {metrics['val_loss']:.4f}, Validation Accuracy: {metrics['val_accuracy']:.4f}, "
        f"top-5 {metrics['val_top5_accuracy']:.4f} ({metrics['val_images']} images"
        f"{', flip TTA' if cfg.tta_flip else ''})"
    )
    log(f">>> Validation complete in: {chrono.val_time:.2f} s (this epoch's training: {train_seconds:.2f} s)")
    if model.ema is not None:
        ema = evaluate(model.ema.module, loaders, opt, ranks, max_batches, stop, cfg.tta_flip)
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


def synthetic_loop(argv, n_batches):
    """The arguments of train_one_epoch for `argv` on --synthetic batches, `n_batches` per epoch and rank: the
    training loop run in-process by benchmarks and tests, without data, W&B, checkpoints or signal handlers."""
    cfg = resolve_config(get_args_parser().parse_args([*argv, "--synthetic"]))
    ranks, cfg = setup_distributed(cfg)
    log = Console(ranks.is_main)
    model = build_model(cfg, SYNTHETIC_CLASSES, ranks, log)
    loaders = synthetic_loaders(
        cfg,
        SYNTHETIC_CLASSES,
        ranks,
        n_batches * cfg.batch_size * ranks.world_size,
        cfg.val_batch_size * ranks.world_size,
    )
    opt = optim.build_optimization(cfg, model, loaders.n_train_batches, SYNTHETIC_CLASSES, ranks, log)
    progress = Progress(
        log,
        NoWandb(),
        ranks.device,
        cfg.epochs,
        loaders.n_train_batches,
        cfg.grad_acc,
        cfg.batch_size * ranks.world_size,
    )
    return dict(
        model=model,
        opt=opt,
        loaders=loaders,
        state=TrainState(),
        cfg=cfg,
        ranks=ranks,
        hooks=LoopHooks(Chronometer(enabled=cfg.test, device=ranks.device)),
        progress=progress,
        stop=StopPoll(StopSignal(), ranks),
    )


def cli(argv=None) -> int:
    """Run main(); turn every failure into an exit status and one line, and never leave a rank waiting:
    0 done, 2 bad input, 3 loss diverged, 1 crash, 130 interrupted."""
    rank = idr_torch.rank
    status = 0
    try:
        if (main(argv) or {}).get("stopped_by") == INTERRUPTED:  # Ctrl-C, checkpointed: the shell's status for it
            status = 130
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
    except KeyboardInterrupt:
        status = 130
    except Exception as err:
        # A rank that fails must end the job, not leave the others waiting in a collective.
        import traceback

        traceback.print_exc()
        print(
            f"dlojz: rank {rank} failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
            file=sys.stderr,
            flush=True,
        )
        status = 1
    for loader in LOADERS:
        close_loader(loader)
    LOADERS.clear()
    if dist.is_available() and dist.is_initialized():
        if status == 0 or idr_torch.world_size == 1:  # (--fsdp's group of one: no peer to wait for)
            dist.destroy_process_group()
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)  # do not wait on peers or worker shutdown that may never come
    return status


if __name__ == "__main__":
    sys.exit(cli())
