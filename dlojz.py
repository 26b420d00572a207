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
from dlojz_transforms import DeviceNormalize, DevicePrefetcher, TrainTransform, ValTransform, decoder_description
import dlojz_optim as optim

LOG_EVERY = 10  # steps between W&B logs and between the ranks' checks for a stop signal or a NaN loss

# GPU defaults are the course's; without a GPU the CPU profile keeps `--test` to a few minutes on a laptop, with the
# learning rate scaled to its smaller batch by the linear scaling rule (0.1 x 32/128: at 0.1, ResNet-50 at batch 32
# diverged on the embedded data; at 0.025 it reached 71 % validation accuracy in 2 epochs).
# Any flag given explicitly overrides its profile value.
PROFILES = {
    "gpu": dict(batch_size=128, image_size=224, val_resize_size=256, val_crop_size=224, val_batch_size=256, lr=0.1),
    "cpu": dict(batch_size=32, image_size=64, val_resize_size=73, val_crop_size=64, val_batch_size=64, lr=0.025),
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
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default: 0.1; CPU profile: 0.025)")
    p.add_argument("--wd", type=float, default=0.0, help="weight decay (default: 0.)")
    p.add_argument("--mom", type=float, default=0.9, help="momentum (default: 0.9)")
    p.add_argument("--label-smoothing", type=float, default=0.1, help="label smoothing of the loss (default: 0.1)")
    p.add_argument("--arch", default="resnet50", help="any torchvision classification model name (default: resnet50)")
    p.add_argument("--seed", type=int, default=123, help="random seed (default: 123)")

    p = parser.add_argument_group("optimizer and schedule (dlojz_optim.py)")
    p.add_argument("--optimizer", default="sgd", help="sgd | adamw | lamb | lars | lion; momentum/beta1 from --mom (default: sgd)")
    p.add_argument("--no-wd-norm-bias", action="store_true", help="no weight decay on norm layers and biases")
    p.add_argument("--lr-scheduler", default="onecycle", help="onecycle | cosine | step | constant, stepped every optimizer step (default: onecycle)")
    p.add_argument("--warmup-epochs", type=float, default=0.0, help="linear warm-up for cosine/step/constant (default: 0)")
    p.add_argument("--findlr", action="store_true", help="LR range test: exponential sweep from 1e-8 to --lr over the run, no validation;\n"
                   "writes findlr.csv and findlr.png, prints a suggested lr")

    p = parser.add_argument_group("memory and speed")
    p.add_argument("--grad-acc", type=int, default=1, help="accumulate gradients over N micro-batches per optimizer step (default: 1)")
    p.add_argument("--grad-checkpointing", action="store_true", help="recompute activations of the model's stages in the backward")
    p.add_argument("--compile", action="store_true", help="torch.compile the model (compilation shows as the time to the first step)")
    p.add_argument("--sync-bn", action="store_true", help="synchronised BatchNorm across ranks")
    p.add_argument("--model-ema", action="store_true", help="keep an exponential moving average of the weights, validated alongside")
    p.add_argument("--model-ema-decay", type=float, default=0.9998, help="EMA decay per optimizer step (default: 0.9998)")

    p = parser.add_argument_group("augmentation")
    p.add_argument("--randaugment", type=int, nargs=2, metavar=("N", "M"), default=None, help="RandAugment with N ops of magnitude M")
    p.add_argument("--trivialaugment", action="store_true", help="TrivialAugmentWide")
    p.add_argument("--random-erase", type=float, default=0.0, metavar="P", help="RandomErasing probability (default: 0)")
    p.add_argument("--mixup-alpha", type=float, default=0.0, help="batch-level MixUp alpha (default: 0 = off)")
    p.add_argument("--cutmix-alpha", type=float, default=0.0, help="batch-level CutMix alpha (default: 0 = off)")

    p = parser.add_argument_group("profiler (torch.profiler)")
    p.add_argument("--prof", action="store_true", help="profile a few steps; traces in <output-dir>/profiler (TensorBoard, Perfetto)")
    p.add_argument("--prof-wait", type=int, default=1, help="steps skipped before profiling (default: 1)")
    p.add_argument("--prof-warmup", type=int, default=1, help="profiled steps thrown away (default: 1)")
    p.add_argument("--prof-active", type=int, default=3, help="profiled steps recorded (default: 3)")

    p = parser.add_argument_group("modes")
    p.add_argument("--test", action="store_true", help="benchmark: stop after --test-nsteps steps, validate on 20 batches,\n"
                   "no W&B, no checkpoint, chronometer report")
    p.add_argument("--test-nsteps", type=int, default=50, help="steps in --test mode (default: 50)")
    p.add_argument("--synthetic", action="store_true", help="random tensors made once in memory: no disk, no decoding")
    p.add_argument("--eval-only", action="store_true", help="validate the checkpoint given by --resume and stop")
    p.add_argument("--loader-only", action="store_true", help="time the training DataLoader alone (no model) over\n"
                   "--test-nsteps batches: images/s overall and per worker")

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


def train_transform(args):
    """The fast crop + flip of dlojz_transforms, then the optional policies (torchvision v2, on uint8 tensors)."""
    from torchvision.transforms import v2
    extra = []
    if args.randaugment:
        extra.append(v2.RandAugment(num_ops=args.randaugment[0], magnitude=args.randaugment[1]))
    if args.trivialaugment:
        extra.append(v2.TrivialAugmentWide())
    if args.random_erase > 0:
        extra.append(v2.RandomErasing(p=args.random_erase))
    crop_flip = TrainTransform(args.image_size)
    return v2.Compose([crop_flip, *extra]) if extra else crop_flip


def batch_mixing(args, num_classes):
    """MixUp and/or CutMix on the device batch (soft labels), or None."""
    from torchvision.transforms import v2
    mixes = []
    if args.mixup_alpha > 0:
        mixes.append(v2.MixUp(alpha=args.mixup_alpha, num_classes=num_classes))
    if args.cutmix_alpha > 0:
        mixes.append(v2.CutMix(alpha=args.cutmix_alpha, num_classes=num_classes))
    if not mixes:
        return None
    return mixes[0] if len(mixes) == 1 else v2.RandomChoice(mixes)


def saved_activation_bytes(model, image_size, channels_last, checkpointing, arch):
    """Bytes per image autograd keeps for the backward of a forward of a CPU copy of `model` (float32), with or
    without activation checkpointing: what --grad-checkpointing saves, per image, without risking an OOM."""
    import copy
    with (contextlib.nullcontext() if checkpointing else plain_stages(model)):
        net = copy.deepcopy(model).cpu().float().train()
    if checkpointing and not any(isinstance(m, CheckpointedStage) for m in net.modules()):
        enable_grad_checkpointing(net, arch)
    image = torch.randn(2, 3, image_size, image_size)  # 2: BatchNorm refuses a batch of 1 in training mode
    if channels_last:
        net, image = net.to(memory_format=torch.channels_last), image.contiguous(memory_format=torch.channels_last)
    kept = {}
    weights = {p.untyped_storage().data_ptr() for p in net.parameters()}  # saved too, but they are not activations

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:
            kept[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        net(image)
    return sum(kept.values()) // 2


class CheckpointedStage:
    """Mixed into a stage's class: its activations are recomputed in the backward instead of being kept."""

    def forward(self, *inputs):
        forward = super().forward
        if torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(forward, *inputs, use_reentrant=False)
        return forward(*inputs)


@contextlib.contextmanager
def plain_stages(model):
    """Temporarily without activation checkpointing: model FLOPs count no recomputation."""
    stages = [(m, type(m)) for m in model.modules() if isinstance(m, CheckpointedStage)]
    for module, cls in stages:
        module.__class__ = cls.__bases__[1]
    try:
        yield model
    finally:
        for module, cls in stages:
            module.__class__ = cls


def enable_grad_checkpointing(model, arch):
    """Recompute each stage's activations in the backward instead of keeping them (ResNet-like layer1..4, or the
    children of `.features`). Only the stages' classes change: parameters and checkpoint keys stay, copies work."""
    stages = [getattr(model, name) for name in ("layer1", "layer2", "layer3", "layer4") if hasattr(model, name)]
    if not stages and isinstance(getattr(model, "features", None), torch.nn.Sequential):
        stages = list(model.features)
    if not stages:
        fail(f"--grad-checkpointing: --arch {arch} has neither layer1..layer4 nor a .features Sequential to checkpoint")
    for stage in stages:
        stage.__class__ = type(f"Checkpointed{type(stage).__name__}", (CheckpointedStage, type(stage)), {})


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
    if args.grad_acc < 1:
        fail(f"--grad-acc must be at least 1 (got {args.grad_acc})")
    if args.findlr and (args.eval_only or args.loader_only):
        fail("--findlr trains: it cannot go with --eval-only or --loader-only")
    if not 0 < args.model_ema_decay < 1:
        fail(f"--model-ema-decay must be in (0, 1) (got {args.model_ema_decay})")
    if not 0 <= args.random_erase <= 1 or args.mixup_alpha < 0 or args.cutmix_alpha < 0:
        fail("--random-erase is a probability in [0, 1]; --mixup-alpha and --cutmix-alpha must be >= 0")
    if args.prof and (args.prof_wait < 0 or args.prof_warmup < 0 or args.prof_active < 1):
        fail("--prof-wait and --prof-warmup must be >= 0, --prof-active >= 1")
    if args.sync_bn and device.type != "cuda":
        fail("--sync-bn needs CUDA: torch's SyncBatchNorm works with GPU modules only")
    if args.loader_only and args.synthetic:
        fail("--loader-only times the DataLoader, which --synthetic does not use: drop one of them")
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
            root, train_transform(args), ValTransform(args.val_resize_size, args.val_crop_size), seed=args.seed)
        data_desc = f"{root} ({layout} layout, found by {found_by}): {len(train_set)} train / {len(val_set)} val images"
    log(f"data: {data_desc}, {len(classes)} classes")
    if not args.synthetic:
        log(f"JPEG decoding: {decoder_description()}")

    # ================================ INSTANTIATION: model, loss, optimizer ================================
    try:
        model = torchvision.models.get_model(args.arch, weights=None, num_classes=len(classes))
    except (ValueError, KeyError):
        import difflib
        names = torchvision.models.list_models(module=torchvision.models)
        close = difflib.get_close_matches(args.arch, names, n=3)
        fail(f"--arch {args.arch}: unknown torchvision classification model" + (f" (did you mean {', '.join(close)}?)" if close else ""))
    if args.sync_bn and distributed:
        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = model.to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if args.grad_checkpointing:
        enable_grad_checkpointing(model, args.arch)
    log(f"model: {args.arch}, {sum(p.numel() for p in model.parameters()):,} parameters")
    model_without_ddp = model  # what is checkpointed and validated
    ema = None
    if args.model_ema:
        ema = torch.optim.swa_utils.AveragedModel(
            model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(args.model_ema_decay), use_buffers=True)
    if distributed:
        model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[local_rank] if device.type == "cuda" else None, gradient_as_bucket_view=True)
    if args.compile:
        model = torch.compile(model)

    mini_batch_size = args.batch_size
    global_batch_size = mini_batch_size * world_size  # images per micro-step, all ranks
    step_batch_size = global_batch_size * args.grad_acc  # images per optimizer step
    log(f"global batch size: {step_batch_size} - mini batch size: {mini_batch_size}"
        + (f" - {args.grad_acc} accumulated micro-batches per optimizer step" if args.grad_acc > 1 else ""))

    criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)  # also takes mixup's soft labels
    val_criterion = torch.nn.CrossEntropyLoss(label_smoothing=args.label_smoothing, reduction="sum")
    try:
        optimizer = optim.build_optimizer(args.optimizer, optim.param_groups(model_without_ddp, args.wd, args.no_wd_norm_bias),
                                          lr=args.lr, momentum=args.mom, weight_decay=args.wd)
    except ValueError as err:
        fail(str(err))
    log(f"optimizer: {args.optimizer} (lr {args.lr}, momentum {args.mom}, weight decay {args.wd}"
        f"{', none on norms and biases' if args.no_wd_norm_bias else ''}); {optim.lr_scaling_line(args.lr, step_batch_size)}")
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

    if args.loader_only:
        metrics = measure_loader(train_loader, train_sampler, args.test_nsteps, args.num_workers, distributed, log)
        metrics.update(world_size=world_size, global_batch_size=global_batch_size)
        if is_main and args.metrics_json:
            write_json(args.metrics_json, metrics)
        return metrics

    steps_per_epoch = math.ceil(N_batch / args.grad_acc)  # optimizer steps: what schedules and logs count
    total_steps = args.epochs * steps_per_epoch
    scheduler, lr_finder = None, None
    try:
        if args.findlr:  # the course's range test: the finder sets the lr of every step, no scheduler
            lr_finder = optim.LRFinder(optimizer, 1e-8, args.lr, min(total_steps, args.test_nsteps) if args.test else total_steps)
        else:
            scheduler = optim.build_scheduler(args.lr_scheduler, optimizer, args.lr, total_steps,
                                              warmup_steps=round(args.warmup_epochs * steps_per_epoch))
    except ValueError as err:
        fail(str(err))
    mix = batch_mixing(args, len(classes))

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
            if ema is not None and state.get("ema") is not None:
                ema.load_state_dict(state["ema"])
            if not args.eval_only:
                optimizer.load_state_dict(state["optimizer"])
                if scheduler is not None:
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
    if is_main and args.wandb and not args.test and not args.eval_only and not args.findlr and args.wandb_mode != "disabled":
        import wandb  # imported here: slow to import, and never needed in --test
        os.environ.setdefault("WANDB_SILENT", "true")
        run = wandb.init(project=args.wandb_project, name=output_dir.name, dir=str(output_dir), mode=args.wandb_mode,
                         config=dict(vars(args), architecture=args.arch, world_size=world_size,
                                     global_batch_size=step_batch_size),
                         id=wandb_id, resume="allow" if wandb_id else None)
        wandb_id = run.id

    def save_checkpoint(epoch, batch):
        state = dict(model=model_without_ddp.state_dict(), optimizer=optimizer.state_dict(),
                     scheduler=scheduler.state_dict() if scheduler is not None else None,
                     ema=ema.state_dict() if ema is not None else None, scaler=scaler.state_dict(), epoch=epoch, batch=batch,
                     global_step=global_step, args=vars(args), wandb_id=wandb_id,
                     rng=dict(torch=torch.get_rng_state(), python=random.getstate(),
                              cuda=torch.cuda.get_rng_state(device) if device.type == "cuda" else None))
        path = ckpt.save(state, output_dir, ckpt.checkpoint_name(epoch, global_step), keep=args.keep_checkpoints)
        log(f"checkpoint written: {path}")
        return path

    # ================================ VALIDATION (a function: also used by --eval-only) ================================
    def validate(net, max_batches=None):
        """Loss and top-1 over exactly the images this run evaluates, summed on every rank then all-reduced."""
        if distributed:  # BN statistics drift per rank in training: validate rank 0's model, as checkpointed
            for buffer in net.buffers():
                dist.broadcast(buffer, 0)
        net.eval()
        totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, images
        with torch.no_grad():
            for iv, (val_images, val_labels) in enumerate(val_batches):
                if max_batches is not None and iv >= max_batches:
                    break
                with autocast():
                    val_outputs = net(val_images)
                loss = val_criterion(val_outputs.float(), val_labels)
                totals += torch.stack([loss.double(), (val_outputs.argmax(1) == val_labels).sum().double(),
                                       torch.full((), float(val_labels.numel()), dtype=torch.float64, device=device)])
        if distributed:
            dist.all_reduce(totals)
        net.train()
        loss_sum, correct, count = totals.tolist()
        return loss_sum / max(count, 1), correct / max(count, 1), int(count)

    val_max_batches = 20 if args.test else None
    metrics = dict(world_size=world_size, global_batch_size=step_batch_size, steps=0, epochs=0, train_loss=None,
                   val_loss=None, val_accuracy=None, val_images=0, images_per_second=None,
                   compute_dtype=args.amp_dtype if args.amp else ("tf32" if args.tf32 else "float32"))

    chrono.start()
    run_start = time.perf_counter()
    if args.eval_only:
        chrono.validation()
        val_loss, val_accuracy, val_images = validate(model_without_ddp, val_max_batches)
        chrono.validation()
        log(f"##EVALUATION## {resumed_from}: Validation Loss: {val_loss:.4f}, Validation Accuracy: {val_accuracy:.4f} "
            f"({val_images} images, {chrono.val_time:.1f} s)")
        metrics.update(val_loss=val_loss, val_accuracy=val_accuracy, val_images=val_images)
        return finish(args, metrics, device, chrono, None, is_main, distributed)

    # ================================ TRAINING ================================
    # 10 console lines per epoch, as in the course, at optimizer-step boundaries.
    log_lines = math.ceil(math.ceil(N_batch / 10) / args.grad_acc) * args.grad_acc
    interactive = sys.stdout.isatty() and "SLURM_JOB_ID" not in os.environ
    live_line_open = False
    micro_steps, timed_micro_steps, timed_seconds = 0, 0, 0.0  # steady-state throughput between synchronised points
    warmup_micro_steps = LOG_EVERY * args.grad_acc  # cuDNN autotuning, allocator, workers starting: not counted
    stop_reason = None
    label = torch.profiler.record_function if args.prof else (lambda name: contextlib.nullcontext())
    profiler = None
    if args.prof:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=args.prof_wait, warmup=args.prof_warmup, active=args.prof_active, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(str(output_dir / "profiler"), worker_name=f"rank{rank}"))
        profiler.start()
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
            with label("data_loading"):
                try:
                    images, labels = next(batches)
                except StopIteration:
                    chrono.dataload()  # the end-of-epoch wait is not recorded as a load: no step follows it
                    break
            chrono.dataload()
            i += 1
            micro_steps += 1
            if i == first_batch and epoch == start_epoch:
                log(f"image batch shape: {tuple(images.shape)}, dtype {images.dtype}")
            targets = labels
            if mix is not None:  # soft labels; the loss and the train accuracy take them as they are
                images, targets = mix(images, labels)
            last_of_epoch = i == N_batch - 1
            optimizer_step = (i + 1) % args.grad_acc == 0 or last_of_epoch
            # Accumulating micro-batches: no gradient all-reduce until the last one.
            sync_context = model.no_sync if (distributed and not optimizer_step) else contextlib.nullcontext

            chrono.forward()
            with sync_context():
                with autocast():
                    with label("forward"):
                        outputs = model(images)
                    with label("loss"):
                        loss = criterion(outputs, targets)
                chrono.forward()

                chrono.backward()
                with label("backward"):
                    scaler.scale(loss / args.grad_acc).backward()
            if optimizer_step:
                with label("optimizer_step"):
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad(set_to_none=True)
                    if ema is not None:
                        ema.update_parameters(model_without_ddp)
            chrono.backward()
            if profiler is not None:
                profiler.step()
            if i == first_batch and epoch == start_epoch:
                chrono.first_step_done()  # includes start-up, cuDNN autotuning and torch.compile
            if not optimizer_step:
                continue
            global_step += 1
            if scheduler is not None:
                scheduler.step()

            # Metrics stay on the device: no host synchronisation except at log points.
            with torch.no_grad():
                loss_d = loss.detach().double()
                batch_stats = torch.stack([loss_d * labels.numel(),
                                           optim.soft_target_accuracy(outputs, targets).double() * labels.numel(),
                                           torch.full((), float(labels.numel()), dtype=torch.float64, device=device)])
                running += batch_stats
                epoch_totals += batch_stats
                # torch.full / a Python scalar: torch.tensor(x, device=cuda) would copy from the host and wait
                first_nonfinite = torch.where((first_nonfinite < 0) & ~torch.isfinite(loss_d), float(global_step),
                                              first_nonfinite)
            if lr_finder is not None:  # the range test needs every step's loss: one synchronisation per step
                lr_finder.step(loss.item(), batch_stats[1].item() / labels.numel())
                if not math.isfinite(lr_finder.losses[-1]) or global_step >= lr_finder.num_steps:
                    break
                continue

            end_of_test = args.test and global_step >= args.test_nsteps
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
                if last_mark is not None and last_mark[0] >= warmup_micro_steps:
                    timed_micro_steps += micro_steps - last_mark[0]
                    timed_seconds += now - last_mark[1]
                last_mark = (micro_steps, now)
                if bad_step >= 0:
                    kept = ckpt.list_checkpoints(output_dir) if output_dir.is_dir() else []
                    where = f"; last good checkpoint kept: {kept[-1]}" if kept else "; no checkpoint written"
                    raise TrainingDiverged(f"loss is not finite (nan/inf) at step {int(bad_step)} (epoch {epoch + 1}): "
                                           f"stopping{where}; lower --lr or check the data")
                if run is not None and global_step % LOG_EVERY == 0:
                    loss_sum, correct, count = running.tolist()
                    run.log({"train loss": loss.item(), "train accuracy": correct / max(count, 1),
                             "learning rate": optimizer.param_groups[0]["lr"]}, step=global_step)
                if console_line:
                    loss_sum, correct, count = running.tolist()
                    # No rate until steps past the warm-up have been timed.
                    rate = (f", {timed_micro_steps * global_batch_size / timed_seconds:.1f} images/s"
                            if timed_seconds else ", warming up")
                    line = (f"Epoch {epoch + 1}/{args.epochs}, Step {i + 1}/{N_batch}, Time: {time.perf_counter() - run_start:.3f}, "
                            f"Loss: {loss_sum / max(count, 1):.4f}, Acc: {correct / max(count, 1):.4f}{rate}")
                    if interactive and is_main:  # one live line, rewritten in place, ended with the epoch
                        print("\r" + line, end="" if not last_of_epoch else "\n", flush=True)
                        live_line_open = not last_of_epoch
                    else:
                        log(line, flush=True)
                    running.zero_()
                if stop_requested:
                    stop_reason = stop["signal"] or "signal on another rank"
                    break
            if end_of_test:
                break
        batches.close()  # leaving mid-epoch (test, stop signal): release this epoch's iterator now

        if live_line_open:  # the epoch was left before its last line (--test, stop signal): end the live line
            print()
            live_line_open = False
        loss_sum, correct, count = epoch_totals.tolist()
        if distributed:
            totals = torch.tensor([loss_sum, correct, count], dtype=torch.float64, device=device)
            dist.all_reduce(totals)
            loss_sum, correct, count = totals.tolist()
        metrics.update(train_loss=loss_sum / max(count, 1), train_accuracy=correct / max(count, 1))
        metrics["steps"] = global_step

        if lr_finder is not None:
            if lr_finder.losses and (not math.isfinite(lr_finder.losses[-1]) or global_step >= lr_finder.num_steps):
                break
            continue  # the sweep goes on over the next epoch, without validation

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
            return finish(args, metrics, device, chrono, run, is_main, distributed)

        # ================================ VALIDATION ================================
        chrono.validation()
        val_loss, val_accuracy, val_images = validate(model_without_ddp, val_max_batches)
        chrono.validation()
        metrics.update(val_loss=val_loss, val_accuracy=val_accuracy, val_images=val_images, epochs=epoch + 1)
        log("##EVALUATION STEP##")
        log(f"Epoch [{epoch + 1}/{args.epochs}], Validation Loss: {val_loss:.4f}, Validation Accuracy: "
            f"{val_accuracy:.4f} ({val_images} images)")
        log(f">>> Validation complete in: {chrono.val_time:.2f} s")
        if ema is not None:
            ema_loss, ema_accuracy, _ = validate(ema.module, val_max_batches)
            metrics.update(ema_val_loss=ema_loss, ema_val_accuracy=ema_accuracy)
            log(f"Epoch [{epoch + 1}/{args.epochs}], EMA model: Validation Loss: {ema_loss:.4f}, "
                f"Validation Accuracy: {ema_accuracy:.4f}")
        if run is not None:
            run.log({"test accuracy": val_accuracy, "test loss": val_loss, "epoch": epoch + 1}, step=global_step)

        # ================================ CHECKPOINT ================================
        if is_main and not args.test:
            save_checkpoint(epoch + 1, 0)
        if args.test:
            break
    if profiler is not None:
        profiler.stop()
        log(f">>> Profiler traces: {output_dir / 'profiler'} (tensorboard --logdir {output_dir / 'profiler'}, "
            "or open the .json in https://ui.perfetto.dev)")
    if lr_finder is not None and is_main:
        output_dir.mkdir(parents=True, exist_ok=True)
        lr_finder.write_csv(output_dir / "findlr.csv")
        lr_finder.plot(output_dir / "findlr.png")
        suggested, rule = lr_finder.suggestion()
        metrics.update(findlr_suggested_lr=suggested, findlr_csv=str(output_dir / "findlr.csv"))
        print(f">>> LR finder: {len(lr_finder.lrs)} steps from {lr_finder.lrs[0]:.2e} to {lr_finder.lrs[-1]:.2e}; "
              f"suggested --lr {suggested:.3g} ({rule})")
        print(f">>> LR finder: {output_dir / 'findlr.csv'}, {output_dir / 'findlr.png'}")

    # ================================ REPORT ================================
    metrics["images_per_second"] = timed_micro_steps * global_batch_size / timed_seconds if timed_seconds else None
    metrics["grad_scaler_scale"] = scaler.get_scale() if scaler.is_enabled() else None  # float16 loss scale
    flops = None
    if args.test and is_main:
        with plain_stages(model_without_ddp):  # model FLOPs: the recomputation is not useful work
            flops = train_flops_per_image(model_without_ddp, args.image_size, channels_last)
        if args.grad_checkpointing:  # what checkpointing saves, estimated from one image (float32)
            plain, kept = (saved_activation_bytes(model_without_ddp, args.image_size, channels_last, c, args.arch)
                           for c in (False, True))
            metrics.update(activation_bytes_per_image=kept, activation_bytes_per_image_without_checkpointing=plain)
    ctx = dict(global_batch_size=global_batch_size, world_size=world_size, steps_per_epoch=N_batch,
               val_batches_done=min(val_max_batches or N_val_batch, N_val_batch), val_batches_total=N_val_batch,
               num_workers=args.num_workers, cpus_per_task=cpus_per_task, pin_memory=args.pin_memory,
               persistent_workers=args.persistent_workers, train_flops_per_image=flops,
               device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               compute_dtype=metrics["compute_dtype"], peak_memory_bytes=peak_memory_bytes(device))
    return finish(args, metrics, device, chrono, run, is_main, distributed, ctx=ctx, n_batch=N_batch)


class TrainingDiverged(Exception):
    """The loss became NaN/inf: stop (exit 3), keep the last good checkpoint."""


def finish(args, metrics, device, chrono, run, is_main, distributed, ctx=None, n_batch=None):
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
        if metrics.get("activation_bytes_per_image"):
            kept, plain = metrics["activation_bytes_per_image"], metrics["activation_bytes_per_image_without_checkpointing"]
            batch = args.batch_size
            print(f">>> --grad-checkpointing: activations kept for the backward {kept * batch / 2**30:.3f} GiB per batch of "
                  f"{batch} instead of {plain * batch / 2**30:.3f} GiB (saves {(plain - kept) * batch / 2**30:.3f} GiB; "
                  f"float32 estimate from one image)")
        if n_batch is not None:
            print(f">>> Number of batch per epoch: {n_batch}")
        if device.type == "cuda":
            print(f">>> Max Memory Allocated: {metrics['max_memory_bytes']:,} bytes")
        else:
            print(f">>> Peak RSS (CPU): {metrics['max_memory_bytes']:,} bytes")
        if metrics.get("images_per_second"):
            print(f">>> Throughput (steady state, all ranks): {metrics['images_per_second']:.1f} images/s")
        if args.metrics_json:
            write_json(args.metrics_json, metrics)
    if run is not None:
        run.finish()
    return metrics


def write_json(path, obj):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, default=float)
    os.replace(tmp, path)


def measure_loader(loader, sampler, nsteps, num_workers, distributed, log):
    """--loader-only: batches/s of the DataLoader alone, after the workers' start-up, summed over the ranks."""
    warmup = max(1, min(10, nsteps // 5))  # worker start-up and first prefetches are not the steady state
    images, epoch, t0, done = 0, 0, None, 0
    while done < warmup + nsteps:
        sampler.set_epoch(epoch)
        for batch_images, _ in loader:
            done += 1
            if done == warmup:
                t0 = time.perf_counter()
            elif done > warmup:
                images += batch_images.shape[0]
            if done >= warmup + nsteps:
                break
        epoch += 1
    rate = images / (time.perf_counter() - t0)
    total = sum(_all_gather_object(rate)) if distributed else rate
    per_worker = rate / num_workers if num_workers else rate
    log(f">>> DataLoader alone: {rate:.1f} images/s per process ({per_worker:.1f} per worker, {num_workers} workers), "
        f"{total:.1f} images/s for all processes, over {nsteps} batches after {warmup} warm-up batches")
    log(f">>> A GPU eating 2,500 images/s (ResNet-50, AMP, A100) needs about {math.ceil(2500 / per_worker)} such workers")
    return dict(loader_images_per_second=total, loader_images_per_second_per_process=rate,
                loader_images_per_second_per_worker=per_worker, loader_batches=nsteps, num_workers=num_workers)


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
    LOADERS.clear()
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
