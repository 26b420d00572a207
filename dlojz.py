"""dlojz: ResNet-50 / ImageNet training, optimised flag by flag (IDRIS course "Deep Learning Optimisé - Jean Zay").

One command runs alone, under torchrun or under srun across nodes:
    python dlojz.py --test                  # first run: 50 steps, chronometer report (CPU profile without a GPU)
    srun python -u dlojz.py -b 256 -e 90    # on a Slurm GPU allocation, one task per GPU
Read top to bottom in the course's order: imports and arguments, instantiation (model, distribution, loss,
optimizer, scheduler), DataLoader, initialisation, training, validation, checkpoint and report.
"""
import argparse
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
import warnings
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torchvision

import idr_torch
import dlojz_checkpoint as ckpt
from dlojz_chrono import Chronometer, plot_trace, train_flops_per_image
from dlojz_data import (IMAGENET_TRAIN_IMAGES, IMAGENET_VAL_IMAGES, DataError, EpochSampler, ShardSampler,
                        SyntheticLoader, build_datasets, close_loader, embedded_dataset_root, make_loader,
                        resolve_data_root)
from dlojz_transforms import DeviceNormalize, DevicePrefetcher, TrainTransform, ValTransform

LOG_EVERY = 10  # steps between W&B logs and between the ranks' checks for a stop signal or a NaN loss

# GPU defaults are the course's; without a GPU the CPU profile keeps `--test` to a few minutes on a laptop.
# Any flag given explicitly overrides its profile value.
PROFILES = {
    "gpu": dict(batch_size=128, image_size=224, val_resize_size=256, val_crop_size=224, val_batch_size=256),
    "cpu": dict(batch_size=32, image_size=64, val_resize_size=73, val_crop_size=64, val_batch_size=64),
}


LOADERS = []  # DataLoaders whose workers main() stops before exiting (see dlojz_data.close_loader)


class UserError(Exception):
    """Bad input the user can fix: printed as one line, exit status 2."""


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p = parser.add_argument_group("training")
    p.add_argument("-b", "--batch-size", type=int, default=None, help="batch size per process (default: 128; CPU profile: 32)")
    p.add_argument("-e", "--epochs", type=int, default=1, help="number of epochs (default: 1)")
    p.add_argument("--image-size", type=int, default=None, help="training crop size in px (default: 224; CPU profile: 64)")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate (default: 0.1)")
    p.add_argument("--wd", type=float, default=0.0, help="weight decay (default: 0.)")
    p.add_argument("--mom", type=float, default=0.9, help="momentum (default: 0.9)")
    p.add_argument("--label-smoothing", type=float, default=0.1, help="label smoothing of the loss (default: 0.1)")
    p.add_argument("--arch", default="resnet50", help="any torchvision classification model name (default: resnet50)")
    p.add_argument("--seed", type=int, default=123, help="random seed (default: 123)")

    p = parser.add_argument_group("modes")
    p.add_argument("--test", action="store_true", help="benchmark: stop after --test-nsteps steps, validate on 20 batches,\n"
                   "no W&B, no checkpoint, chronometer report")
    p.add_argument("--test-nsteps", type=int, default=50, help="steps in --test mode (default: 50)")
    p.add_argument("--synthetic", action="store_true", help="random tensors made once in memory: no disk, no decoding")
    p.add_argument("--eval-only", action="store_true", help="validate the checkpoint given by --resume and stop")

    p = parser.add_argument_group("data")
    p.add_argument("--data-root", default=None, help="folder with train/ and val/ (ImageNet or ImageFolder layout);\n"
                   "default: $DLOJZ_DATA, $ALL_CCFRSCRATCH/imagenet, $DSDIR/imagenet,\nelse the embedded data set")
    p.add_argument("--val-resize-size", type=int, default=None, help="validation resize (default: 256; CPU profile: 73)")
    p.add_argument("--val-crop-size", type=int, default=None, help="validation center crop (default: 224; CPU profile: 64)")
    p.add_argument("--val-batch-size", type=int, default=None, help="validation batch size per process (default: 256; CPU profile: 64)")

    p = parser.add_argument_group("DataLoader")
    p.add_argument("--num-workers", type=int, default=None, help="workers per process (default: CPUs per task, at most 16)")
    p.add_argument("--persistent-workers", default=True, action=argparse.BooleanOptionalAction, help="keep workers between epochs (default: on)")
    p.add_argument("--pin-memory", default=True, action=argparse.BooleanOptionalAction, help="page-locked host buffers (default: on)")
    p.add_argument("--non-blocking", default=True, action=argparse.BooleanOptionalAction, help="asynchronous host-to-GPU copies (default: on)")
    p.add_argument("--prefetch-factor", type=int, default=3, help="batches prefetched per worker, ignored with 0 workers (default: 3)")
    p.add_argument("--drop-last", default=False, action=argparse.BooleanOptionalAction, help="drop the last incomplete batch (default: off)")

    p = parser.add_argument_group("device and precision")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="(default: auto = cuda if available)")
    p.add_argument("--amp", default=None, action=argparse.BooleanOptionalAction, help="automatic mixed precision (default: on with CUDA, off on CPU)")
    p.add_argument("--amp-dtype", choices=("float16", "bfloat16"), default=None, help="AMP dtype (default: float16 on CUDA, bfloat16 on CPU)")
    p.add_argument("--channels-last", default=False, action=argparse.BooleanOptionalAction, help="NHWC memory format for model and inputs (default: off)")
    p.add_argument("--tf32", default=None, action=argparse.BooleanOptionalAction, help="TF32 matmul/cuDNN (default: on for Ampere and newer)")

    p = parser.add_argument_group("distribution")
    p.add_argument("--dist-timeout", type=float, default=600, help="seconds before a collective waiting for a dead rank fails (default: 600)")

    p = parser.add_argument_group("logging, checkpoints, resume")
    p.add_argument("--output-dir", default=None, help="checkpoints, metrics, traces (default: ./runs/<job name>_<job id or timestamp>)")
    p.add_argument("--metrics-json", default=None, help="write the run's final metrics to this JSON file (rank 0)")
    p.add_argument("--resume", default=None, help="'auto' (newest checkpoint in --output-dir, if any) or a checkpoint path")
    p.add_argument("--keep-checkpoints", type=int, default=3, help="checkpoints kept in --output-dir (default: 3)")
    p.add_argument("--wandb", default=True, action=argparse.BooleanOptionalAction, help="W&B logging on rank 0 (default: on; never in --test)")
    p.add_argument("--wandb-project", default="Imagenet Race Cup", help="(default: 'Imagenet Race Cup')")
    p.add_argument("--wandb-mode", choices=("offline", "online", "disabled"), default="offline", help="(default: offline: never needs the network)")
    return parser.parse_args(argv)


def fail(message):
    raise UserError(message)


def resolve_device(args, local_rank):
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            fail("--device cuda: no CUDA GPU is visible here; use --device cpu or run on a GPU node")
        if local_rank >= torch.cuda.device_count():
            fail(f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible): one task per GPU (--gres/--ntasks-per-node)")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def check_autocast(device, dtype):
    """Fail with one line, before any training, if this device cannot run autocast in `dtype`."""
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        fail(f"--amp-dtype bfloat16: {torch.cuda.get_device_name(device)} has no bfloat16 support; use --amp-dtype float16")
    try:
        conv = torch.nn.Conv2d(3, 4, 3).to(device)
        with torch.autocast(device.type, dtype=dtype):
            conv(torch.randn(1, 3, 8, 8, device=device)).float().sum().backward()
    except RuntimeError as err:
        fail(f"--amp-dtype {str(dtype).split('.')[-1]} cannot run on {device.type}: {str(err).splitlines()[0]}")


def check_writable(path):
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.write_text("ok")
        probe.unlink()
    except OSError as err:
        fail(f"--output-dir {path} is not writable ({err.strerror}); choose another folder")


def peak_memory_bytes(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def train(args):
    # Slurm's preemption warning (--signal=USR1@T) or SIGTERM: finish the current step, checkpoint, requeue.
    # Installed first: a signal arriving during start-up must not kill the job.
    stop = {"signal": None}

    def request_stop(signum, _frame):
        stop["signal"] = signal.Signals(signum).name

    signal.signal(signal.SIGUSR1, request_stop)
    signal.signal(signal.SIGTERM, request_stop)

    # ================================ INSTANTIATION: distribution ================================
    world_size, rank, local_rank = idr_torch.world_size, idr_torch.rank, idr_torch.local_rank
    distributed = world_size > 1
    device = resolve_device(args, local_rank)
    if distributed:
        idr_torch.init_process_group(backend="nccl" if device.type == "cuda" else "gloo",
                                     timeout=timedelta(seconds=args.dist_timeout))
    is_main = rank == 0
    log = print if is_main else (lambda *a, **k: None)

    # Fill what the user did not set from the GPU defaults or the CPU profile.
    profile = "gpu" if device.type == "cuda" else "cpu"
    unset = [k for k, v in PROFILES[profile].items() if getattr(args, k) is None]
    for key in unset:
        setattr(args, key, PROFILES[profile][key])
    if profile == "cpu" and unset:
        log("CPU profile (no GPU): " + " ".join(f"--{k.replace('_', '-')} {getattr(args, k)}" for k in unset)
            + "  (any flag given explicitly wins)")
    cpus_per_task = idr_torch.cpus_per_task
    if args.num_workers is None:
        args.num_workers = max(0, min(cpus_per_task, 16))
    elif args.num_workers > cpus_per_task:
        log(f"WARNING: --num-workers {args.num_workers} exceeds the {cpus_per_task} CPUs of this task: workers will compete")
    if args.amp is None:
        args.amp = device.type == "cuda"
    if args.amp_dtype is None:
        args.amp_dtype = "float16" if device.type == "cuda" else "bfloat16"
    if args.tf32 is None:
        args.tf32 = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8
    for flag in ("batch_size", "epochs", "image_size", "val_resize_size", "val_crop_size", "val_batch_size", "test_nsteps"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be at least 1 (got {getattr(args, flag)})")
    if args.num_workers < 0 or args.prefetch_factor < 1:
        fail("--num-workers must be >= 0 and --prefetch-factor >= 1")
    if args.eval_only and not args.resume:
        fail("--eval-only needs --resume CHECKPOINT (or --resume auto with --output-dir)")
    amp_dtype = getattr(torch, args.amp_dtype)
    if args.amp:
        check_autocast(device, amp_dtype)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # autotune convolutions for the fixed input size
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
        if args.amp and (args.batch_size % 8 or args.image_size % 8):
            log(f"WARNING: with AMP, Tensor Cores want multiples of 8: --batch-size {args.batch_size}, --image-size {args.image_size}")

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    # Output dir: the same on every rank (rank 0 names it), checked writable before anything long starts.
    if args.output_dir is None:
        job = os.environ.get("SLURM_JOB_NAME", "dlojz")
        job_id = os.environ.get("SLURM_JOB_ID") or datetime.now().strftime("%Y%m%d-%H%M%S")
        args.output_dir = os.path.join("runs", f"{job}_{job_id}")
    if distributed:
        holder = [args.output_dir]
        dist.broadcast_object_list(holder, src=0)
        args.output_dir = holder[0]
    output_dir = Path(args.output_dir)
    if is_main and not args.test:
        check_writable(output_dir)
    if is_main and args.metrics_json:
        check_writable(Path(args.metrics_json).resolve().parent)

    chrono = Chronometer(enabled=args.test, rank=rank, device=device)
    log(f">>> Training on {idr_torch.num_nodes} nodes and {world_size} processes ({idr_torch.current_API}), device {device}")

    # ================================ DATA SETS (the model needs the number of classes) ================================
    channels_last = args.channels_last
    if args.synthetic:
        classes = [str(i) for i in range(1000)]
        train_set = val_set = None
        data_desc = "synthetic (random tensors in memory)"
    else:
        root, found_by = resolve_data_root(args.data_root)
        if root is None:
            if is_main:  # one rank generates, the others wait for it (the folder is renamed into place atomically)
                root = embedded_dataset_root()
            if distributed:
                dist.barrier()
            root = embedded_dataset_root()
            log(f"No --data-root, $DLOJZ_DATA, $ALL_CCFRSCRATCH/imagenet or $DSDIR/imagenet: using the embedded "
                f"data set ({root}, 10 classes of shapes and textures)")
        train_set, val_set, classes, layout = build_datasets(
            root, TrainTransform(args.image_size), ValTransform(args.val_resize_size, args.val_crop_size), seed=args.seed)
        data_desc = f"{root} ({layout} layout, found by {found_by}): {len(train_set)} train / {len(val_set)} val images"
    log(f"data: {data_desc}, {len(classes)} classes")

    # ================================ INSTANTIATION: model, loss, optimizer ================================
    try:
        model = torchvision.models.get_model(args.arch, weights=None, num_classes=len(classes))
    except (ValueError, KeyError):
        import difflib
        names = torchvision.models.list_models(module=torchvision.models)
        close = difflib.get_close_matches(args.arch, names, n=3)
        fail(f"--arch {args.arch}: unknown torchvision classification model" + (f" (did you mean {', '.join(close)}?)" if close else ""))
    model = model.to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    log(f"model: {args.arch}, {sum(p.numel() for p in model.parameters()):,} parameters")
    model_without_ddp = model
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if device.type == "cuda" else None, gradient_as_bucket_view=True)

    mini_batch_size = args.batch_size
    global_batch_size = mini_batch_size * world_size
    log(f"global batch size: {global_batch_size} - mini batch size: {mini_batch_size}")

    criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    val_criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing, reduction="sum")
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.mom, weight_decay=args.wd)
    log(f"optimizer: SGD(lr={args.lr}, momentum={args.mom}, weight_decay={args.wd})")
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp and amp_dtype == torch.float16)
    autocast = (lambda: torch.autocast(device.type, dtype=amp_dtype)) if args.amp else contextlib.nullcontext

    # ================================ DATALOADER ================================
    log(f"DATALOADER workers={args.num_workers} persistent={args.persistent_workers} pin_memory={args.pin_memory} "
        f"non_blocking={args.non_blocking} prefetch_factor={args.prefetch_factor} drop_last={args.drop_last}")
    normalize = DeviceNormalize(device, channels_last=channels_last)
    if args.synthetic:
        train_loader = SyntheticLoader(IMAGENET_TRAIN_IMAGES, mini_batch_size, args.image_size, len(classes), device,
                                       channels_last, world_size, args.drop_last, seed=args.seed)
        val_loader = SyntheticLoader(IMAGENET_VAL_IMAGES, args.val_batch_size, args.val_crop_size, len(classes), device,
                                     channels_last, world_size, seed=args.seed + 1)
        train_sampler, train_batches, val_batches = None, train_loader, val_loader
        n_val = IMAGENET_VAL_IMAGES
    else:
        train_sampler = EpochSampler(train_set, world_size, rank, shuffle=True, seed=args.seed, drop_last=args.drop_last)
        loader_opts = dict(num_workers=args.num_workers, pin_memory=args.pin_memory and device.type == "cuda",
                           persistent_workers=args.persistent_workers, prefetch_factor=args.prefetch_factor)
        train_loader = make_loader(train_set, train_sampler, mini_batch_size, drop_last=args.drop_last, **loader_opts)
        val_loader = make_loader(val_set, ShardSampler(val_set, world_size, rank), args.val_batch_size,
                                 drop_last=False, **loader_opts)
        LOADERS.extend([train_loader, val_loader])  # closed by main(), whatever happens
        train_batches = DevicePrefetcher(train_loader, device, normalize, non_blocking=args.non_blocking)
        val_batches = DevicePrefetcher(val_loader, device, normalize, non_blocking=args.non_blocking)
        n_val = len(val_set)
    N_batch = len(train_loader)
    N_val_batch = math.ceil(n_val / world_size / args.val_batch_size)
    if N_batch == 0:
        fail(f"--batch-size {mini_batch_size} with --drop-last leaves no batch: the training set has "
             f"{len(train_set) // world_size} images per process; lower --batch-size or use --no-drop-last")

    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, steps_per_epoch=N_batch, epochs=args.epochs)

    # ================================ INITIALISATION: resume, W&B, signals ================================
    start_epoch, start_batch, global_step, wandb_id, resumed_from = 0, 0, 0, None, None
    if args.resume:
        if args.resume == "auto":
            state, resumed_from = ckpt.load_latest(output_dir)
            if state is None:
                if args.eval_only:
                    fail(f"--resume auto: no usable checkpoint in {output_dir}")
                log(f"--resume auto: no checkpoint in {output_dir}, starting from scratch")
        else:
            try:
                state, resumed_from = ckpt.load(args.resume), args.resume
            except ckpt.CheckpointError as err:
                fail(f"--resume: {err}")
        if resumed_from:
            try:
                model_without_ddp.load_state_dict(state["model"])
            except RuntimeError as err:
                fail(f"--resume {resumed_from}: the weights do not fit --arch {args.arch} with {len(classes)} classes "
                     f"({str(err).splitlines()[0][:120]})")
            if not args.eval_only:
                optimizer.load_state_dict(state["optimizer"])
                scheduler.load_state_dict(state["scheduler"])
                scaler.load_state_dict(state["scaler"])
                start_epoch, start_batch, global_step = state["epoch"], state["batch"], state["global_step"]
                wandb_id = state.get("wandb_id")
                torch.set_rng_state(state["rng"]["torch"])
                random.setstate(state["rng"]["python"])
                if device.type == "cuda" and state["rng"].get("cuda") is not None:
                    torch.cuda.set_rng_state(state["rng"]["cuda"], device)
            log(f"resumed from {resumed_from} (epoch {state['epoch'] + 1}, step {state['batch']}/{N_batch}, "
                f"global step {state['global_step']})")

    run = None
    if is_main and args.wandb and not args.test and not args.eval_only and args.wandb_mode != "disabled":
        import wandb  # imported here: slow to import, and never needed in --test
        os.environ.setdefault("WANDB_SILENT", "true")
        run = wandb.init(project=args.wandb_project, name=output_dir.name, dir=str(output_dir), mode=args.wandb_mode,
                         config=dict(vars(args), architecture=args.arch, world_size=world_size,
                                     global_batch_size=global_batch_size, optimizer="SGD", lr_scheduler="OneCycleLR"),
                         id=wandb_id, resume="allow" if wandb_id else None)
        wandb_id = run.id

    def save_checkpoint(epoch, batch):
        state = dict(model=model_without_ddp.state_dict(), optimizer=optimizer.state_dict(),
                     scheduler=scheduler.state_dict(), scaler=scaler.state_dict(), epoch=epoch, batch=batch,
                     global_step=global_step, args=vars(args), wandb_id=wandb_id,
                     rng=dict(torch=torch.get_rng_state(), python=random.getstate(),
                              cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None))
        path = ckpt.save(state, output_dir, ckpt.checkpoint_name(epoch, global_step), keep=args.keep_checkpoints)
        log(f"checkpoint written: {path}")
        return path

    # ================================ VALIDATION (a function: also used by --eval-only) ================================
    def validate(max_batches=None):
        """Loss and top-1 over exactly the images this run evaluates, summed on every rank then all-reduced."""
        if distributed:  # BN statistics drift per rank in training: validate rank 0's model, as checkpointed
            for buffer in model_without_ddp.buffers():
                dist.broadcast(buffer, 0)
        model_without_ddp.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, images
        with torch.no_grad():
            for iv, (val_images, val_labels) in enumerate(val_batches):
                if max_batches is not None and iv >= max_batches:
                    break
                with autocast():
                    val_outputs = model_without_ddp(val_images)
                loss = val_criterion(val_outputs.float(), val_labels)
                totals += torch.stack([loss.double(), (val_outputs.argmax(1) == val_labels).sum().double(),
                                       torch.tensor(val_labels.numel(), dtype=torch.float64, device=device)])
        if distributed:
            dist.all_reduce(totals)
        model_without_ddp.train()
        loss_sum, correct, count = totals.tolist()
        return loss_sum / max(count, 1), correct / max(count, 1), int(count)

    val_max_batches = 20 if args.test else None
    metrics = dict(world_size=world_size, global_batch_size=global_batch_size, steps=0, epochs=0, train_loss=None,
                   val_loss=None, val_accuracy=None, val_images=0, images_per_second=None,
                   compute_dtype=args.amp_dtype if args.amp else ("tf32" if args.tf32 else "float32"))

    chrono.start()
    run_start = time.perf_counter()
    if args.eval_only:
        chrono.validation()
        val_loss, val_accuracy, val_images = validate(val_max_batches)
        chrono.validation()
        log(f"##EVALUATION## {resumed_from}: Validation Loss: {val_loss:.4f}, Validation Accuracy: {val_accuracy:.4f} "
            f"({val_images} images, {chrono.val_time:.1f} s)")
        metrics.update(val_loss=val_loss, val_accuracy=val_accuracy, val_images=val_images)
        return finish(args, metrics, device, chrono, None, is_main, distributed)

    # ================================ TRAINING ================================
    log_lines = math.ceil(N_batch / 10)  # 10 console lines per epoch, as in the course
    interactive = sys.stdout.isatty() and "SLURM_JOB_ID" not in os.environ
    timed_steps, timed_seconds = 0, 0.0  # steady-state throughput, measured between synchronised log points
    last_mark = None
    warmup_steps = LOG_EVERY  # the first steps (cuDNN autotuning, allocator, workers starting) are not counted
    stop_reason = None
    model.train()
    for epoch in range(start_epoch, args.epochs):
        first_batch = start_batch if epoch == start_epoch else 0
        if train_sampler is not None:
            train_sampler.set_epoch(epoch)
            train_sampler.skip = first_batch * mini_batch_size
        else:
            train_loader.skip = first_batch
        running = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, images since last line
        epoch_totals = torch.zeros(3, dtype=torch.float64, device=device)
        first_nonfinite = torch.full((), -1.0, dtype=torch.float64, device=device)
        last_mark = None
        i = first_batch - 1
        batches = iter(train_batches)
        while True:
            chrono.dataload()
            try:
                images, labels = next(batches)
            except StopIteration:
                chrono.dataload()  # the end-of-epoch wait is not recorded as a load: no step follows it
                break
            chrono.dataload()
            i += 1
            if i == first_batch and epoch == start_epoch:
                log(f"image batch shape: {tuple(images.shape)}, dtype {images.dtype}")

            chrono.forward()
            optimizer.zero_grad(set_to_none=True)
            with autocast():
                outputs = model(images)
                loss = criterion(outputs, labels)
            chrono.forward()

            chrono.backward()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            chrono.backward()
            scheduler.step()
            global_step += 1
            if global_step == 1 or (i == first_batch and epoch == start_epoch):
                chrono.first_step_done()

            # Metrics stay on the device: no host synchronisation except at log points.
            with torch.no_grad():
                loss_d = loss.detach().double()
                batch_stats = torch.stack([loss_d * labels.numel(), (outputs.argmax(1) == labels).sum().double(),
                                           torch.tensor(labels.numel(), dtype=torch.float64, device=device)])
                running += batch_stats
                epoch_totals += batch_stats
                first_nonfinite = torch.where((first_nonfinite < 0) & ~torch.isfinite(loss_d),
                                              torch.tensor(float(global_step), dtype=torch.float64, device=device),
                                              first_nonfinite)

            end_of_test = args.test and global_step >= args.test_nsteps
            last_of_epoch = i == N_batch - 1
            console_line = (i + 1) % log_lines == 0 or last_of_epoch or end_of_test
            if global_step % LOG_EVERY == 0 or console_line:
                # One small all-reduce: the ranks agree on a stop signal or a NaN loss (the signal may reach them
                # at different steps; they stop at the same one).
                control = torch.stack([torch.tensor(1.0 if stop["signal"] else 0.0, dtype=torch.float64, device=device),
                                       first_nonfinite])
                if distributed:
                    dist.all_reduce(control, op=dist.ReduceOp.MAX)
                stop_requested, bad_step = control.tolist()  # synchronises with the device
                now = time.perf_counter()
                if last_mark is not None and last_mark[0] >= warmup_steps:
                    timed_steps += global_step - last_mark[0]
                    timed_seconds += now - last_mark[1]
                last_mark = (global_step, now)
                if bad_step >= 0:
                    kept = ckpt.list_checkpoints(output_dir) if output_dir.is_dir() else []
                    where = f"; last good checkpoint kept: {kept[-1]}" if kept else "; no checkpoint written"
                    raise TrainingDiverged(f"loss is not finite (nan/inf) at step {int(bad_step)} (epoch {epoch + 1}): "
                                           f"stopping{where}; lower --lr or check the data")
                if run is not None and global_step % LOG_EVERY == 0:
                    loss_sum, correct, count = running.tolist()
                    run.log({"train loss": loss.item(), "train accuracy": correct / max(count, 1),
                             "learning rate": scheduler.get_last_lr()[0]}, step=global_step)
                if console_line:
                    loss_sum, correct, count = running.tolist()
                    rate = timed_steps * global_batch_size / timed_seconds if timed_seconds else float("nan")
                    line = (f"Epoch {epoch + 1}/{args.epochs}, Step {i + 1}/{N_batch}, Time: {time.perf_counter() - run_start:.3f}, "
                            f"Loss: {loss_sum / max(count, 1):.4f}, Acc: {correct / max(count, 1):.4f}, "
                            f"{rate:.1f} images/s")
                    if interactive and is_main:
                        print("\r" + line, end="" if not last_of_epoch else "\n", flush=True)
                    else:
                        log(line, flush=True)
                    running.zero_()
                if stop_requested:
                    stop_reason = stop["signal"] or "signal on another rank"
                    break
            if end_of_test:
                break
        batches.close()  # leaving mid-epoch (test, stop signal): release this epoch's iterator now

        if interactive and is_main:
            print()
        loss_sum, correct, count = epoch_totals.tolist()
        if distributed:
            totals = torch.tensor([loss_sum, correct, count], dtype=torch.float64, device=device)
            dist.all_reduce(totals)
            loss_sum, correct, count = totals.tolist()
        metrics.update(train_loss=loss_sum / max(count, 1), train_accuracy=correct / max(count, 1))
        metrics["steps"] = global_step

        if stop_reason:
            # Preempted or at the time limit: checkpoint mid-epoch, requeue under Slurm, exit cleanly.
            log(f"{stop_reason} received: saving a checkpoint at epoch {epoch + 1}, step {i + 1}/{N_batch}")
            if is_main and not args.test:
                save_checkpoint(epoch, i + 1)
            if distributed:
                dist.barrier()
            if is_main and os.environ.get("SLURM_JOB_ID") and not args.test:
                print(f"requeue: scontrol requeue {os.environ['SLURM_JOB_ID']} (resume with --resume auto)", flush=True)
                subprocess.run(["scontrol", "requeue", os.environ["SLURM_JOB_ID"]], check=False)
            elif is_main:
                print(f"stopped cleanly; continue with --resume auto --output-dir {output_dir}", flush=True)
            metrics.update(stopped_by=stop_reason, epochs=epoch)
            return finish(args, metrics, device, chrono, run, is_main, distributed, stopped=True)

        # ================================ VALIDATION ================================
        chrono.validation()
        val_loss, val_accuracy, val_images = validate(val_max_batches)
        chrono.validation()
        metrics.update(val_loss=val_loss, val_accuracy=val_accuracy, val_images=val_images, epochs=epoch + 1)
        log("##EVALUATION STEP##")
        log(f"Epoch [{epoch + 1}/{args.epochs}], Validation Loss: {val_loss:.4f}, Validation Accuracy: "
            f"{val_accuracy:.4f} ({val_images} images)")
        log(f">>> Validation complete in: {chrono.val_time:.2f} s")
        if run is not None:
            run.log({"test accuracy": val_accuracy, "test loss": val_loss, "epoch": epoch + 1}, step=global_step)

        # ================================ CHECKPOINT ================================
        if is_main and not args.test:
            save_checkpoint(epoch + 1, 0)
        if args.test:
            break

    # ================================ REPORT ================================
    metrics["images_per_second"] = timed_steps * global_batch_size / timed_seconds if timed_seconds else None
    metrics["grad_scaler_scale"] = scaler.get_scale() if scaler.is_enabled() else None  # float16 loss scale
    flops = None
    if args.test and is_main:
        flops = train_flops_per_image(model_without_ddp, args.image_size, channels_last)
    ctx = dict(global_batch_size=global_batch_size, world_size=world_size, steps_per_epoch=N_batch,
               val_batches_done=min(val_max_batches or N_val_batch, N_val_batch), val_batches_total=N_val_batch,
               num_workers=args.num_workers, cpus_per_task=cpus_per_task, pin_memory=args.pin_memory,
               persistent_workers=args.persistent_workers, train_flops_per_image=flops,
               device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               compute_dtype=metrics["compute_dtype"], peak_memory_bytes=peak_memory_bytes(device))
    return finish(args, metrics, device, chrono, run, is_main, distributed, ctx=ctx, n_batch=N_batch)


class TrainingDiverged(Exception):
    """The loss became NaN/inf: stop (exit 3), keep the last good checkpoint."""


def finish(args, metrics, device, chrono, run, is_main, distributed, ctx=None, n_batch=None, stopped=False):
    """Report: chronometer, memory, metrics JSON; close W&B."""
    chrono.gather(_all_gather_object if distributed else None)
    metrics["max_memory_bytes"] = peak_memory_bytes(device)
    if is_main:
        if ctx is not None and chrono.enabled:
            output_dir = Path(args.output_dir)
            output_dir.mkdir(parents=True, exist_ok=True)
            trace = output_dir / "chrono_trace.json"
            ctx["trace_path"] = str(trace)
            chrono.write_trace(trace, ctx=ctx)
            chrono.display(ctx)
            metrics["chrono"] = chrono.summary(ctx)
            try:
                plot_trace(trace, output_dir / "timeline.png")
                print(f">>> Timeline plot: {output_dir / 'timeline.png'}")
            except Exception as err:  # a plot is a bonus: never lose the run for it
                print(f"WARNING: timeline plot not written: {err}")
        if n_batch is not None:
            print(f">>> Number of batch per epoch: {n_batch}")
        if device.type == "cuda":
            print(f">>> Max Memory Allocated: {metrics['max_memory_bytes']:,} bytes")
        else:
            print(f">>> Peak RSS (CPU): {metrics['max_memory_bytes']:,} bytes")
        if metrics.get("images_per_second"):
            print(f">>> Throughput (steady state, all ranks): {metrics['images_per_second']:.1f} images/s")
        if args.metrics_json:
            Path(args.metrics_json).parent.mkdir(parents=True, exist_ok=True)
            tmp = f"{args.metrics_json}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(metrics, f, indent=2, default=float)
            os.replace(tmp, args.metrics_json)
    if run is not None:
        run.finish()
    return metrics


def _all_gather_object(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def main(argv=None):
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=idr_torch.IdrTorchWarning)  # "not distributed" is fine alone
    rank = idr_torch.rank
    status = 0
    try:
        train(args)
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
        print(f"dlojz: rank {rank} failed: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
              file=sys.stderr, flush=True)
        status = 1
    for loader in LOADERS:
        close_loader(loader)
    if dist.is_available() and dist.is_initialized():
        if status == 0:
            dist.destroy_process_group()
        else:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)  # do not wait on peers or worker shutdown that may never come
    return status


if __name__ == "__main__":
    sys.exit(main())
