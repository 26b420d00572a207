"""The model and what dlojz knows about it: creation by name, its adaptations, FLOPs, GPU peaks (activation
checkpointing: model.recompute).

- `create_model(arch, num_classes)`: any torchvision classification model by name, or any timm one as `timm:NAME`,
  random weights (no download), with `--drop-path`'s stochastic depth where the model has it;
  an unknown name is a `UserError` with the closest names. `classifier_name(model, num_classes)`: its head.
- `apply_blurpool(model)`: anti-aliased downsampling (`--blurpool`, Zhang 2019, as FFCV and Composer apply it): a
  3x3 binomial blur before each strided convolution of 16+ input channels, and max-pools that take the max at
  stride 1 then blur with the stride. Only classes change and the blur filter is a constant: the state dict keeps
  its keys and loads into the model with or without it.
- `pad_stem_channels(model)`: the first 3-channel convolution takes 4 (`--dali-pad-channels`: DALI writes RGB and a
  zero channel), its weight padded with zeros in each forward: the outputs are the 3-channel ones and the state
  dict keeps its shapes, so checkpoints load with or without it.
- `linear_probe(model, head)`: `--linear-probe`: every parameter but the head's frozen (`requires_grad=False`: no
  backward through the backbone) and the backbone kept in eval mode whatever `train()` says (its BatchNorm
  statistics and dropout fixed: the features are the pretrained backbone's); only the class changes.
- `adapt_module(training, pad_channels, model, num_classes, log)`: the three above as the flags ask for them, each
  said in one line (or refused in one where the model has nothing to change).
- `ModelEma(model, decay)`: `--model-ema`'s exponential moving average of the weights and buffers, updated without
  waiting for the device (torch's AveragedModel reads its step count back from the GPU every step);
  `ema_decay(memory, training, world_size)`: its decay per update, torchvision's rule with `--model-ema-adjust`.
- `saved_activation_bytes(model, image_size, channels_last, checkpointing, arch)`: bytes per image that autograd
  keeps for the backward, measured on a real forward of a CPU copy.
- `train_flops_per_image(model, image_size)`: training FLOPs of one image (FlopCounterMode on a weightless copy,
  its BatchNorm left out: it counts none);
  `peak_flops(device_name, dtype)`: the dense peak of V100/A100/H100/H200 GPUs, for the MFU.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect

import torch
import torchvision

from dlojz_lib.checks import UserError, fail
from dlojz_lib.model.float8 import as_plain_linears
from dlojz_lib.model.recompute import CheckpointedStage, enable_grad_checkpointing, plain_stages
from dlojz_lib.torch_internals import batch_norm_base, foreach_copy_, foreach_lerp_


def create_model(
    arch: str,
    num_classes: int,
    zero_init_residual: bool | None = False,
    image_size: int | None = None,
    drop_path: float | None = None,
) -> torch.nn.Module:
    """`arch`: a torchvision classification model name, or `timm:NAME` for any timm model (random weights: nothing
    is downloaded). `zero_init_residual`: the last BatchNorm scale of each residual block at 0 (torchvision's ResNet
    option), so that each block starts as the identity; None: where the model takes it (the run's default: a
    ResNet's loss falls from the first steps instead of climbing, as in timm and Goyal et al. 2017). `image_size`:
    the training size, for the timm models that fix one (vision transformers, CoAtNet), which then also take the
    validation's size. `drop_path`: the stochastic depth rate (timm's drop_path_rate, torchvision's
    stochastic_depth_prob), None for the model's own default; a model without stochastic depth refuses it."""
    check_arch(arch)
    if arch.startswith("timm:"):
        return create_timm_model(arch, num_classes, zero_init_residual, image_size, drop_path)
    # Some builders pass unknown options to their class, which swallows them (**kwargs): its signature says.
    builder = torchvision.models.get_model_builder(arch)
    model_class = builder.__annotations__.get("return")
    model_class = getattr(torchvision.models, model_class, None) if isinstance(model_class, str) else model_class
    takes = model_class is not None and "zero_init_residual" in inspect.signature(model_class.__init__).parameters
    if zero_init_residual and not takes:
        fail(f"--zero-init-residual: --arch {arch} does not take it (ResNet, ResNeXt and Wide ResNet models do)")
    options = dict(zero_init_residual=True) if takes and zero_init_residual in (True, None) else {}
    if drop_path is not None:
        if model_class is None or "stochastic_depth_prob" not in inspect.signature(model_class.__init__).parameters:
            fail(
                f"--drop-path: torchvision's {arch} has no stochastic depth (its ConvNeXt, EfficientNet, Swin and "
                f"MaxViT models have; timm's ResNets too: --arch timm:NAME)"
            )
        options["stochastic_depth_prob"] = drop_path
    try:
        return torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **options)
    except TypeError as err:  # Swin's builders set the rate themselves: the model's own rates are scaled to it
        if "stochastic_depth_prob" not in str(err):
            raise
        del options["stochastic_depth_prob"]
        model = torchvision.models.get_model(arch, weights=None, num_classes=num_classes, **options)
        layers = [m for m in model.modules() if isinstance(m, torchvision.ops.StochasticDepth)]
        deepest = max(layer.p for layer in layers)  # each block's rate rises with its depth to this one
        for layer in layers:
            layer.p = layer.p * drop_path / deepest
        return model


def check_input_sizes(arch, zero_init_residual, sizes, drop_path=None):
    """One line before the data is read if the model cannot take square images of each of `sizes` px (a model made
    for one size, as torchvision's vision transformers): a forward on the meta device, no memory, no compute."""
    refusal = input_sizes_refusal(arch, zero_init_residual, tuple(sorted(set(sizes))), drop_path)
    if refusal is not None:
        fail(refusal)


# The verdict depends on the model's name and options and the sizes only: it is reached once a process, where the
# planner's layouts, HPO's trials and the recipes on several GPU counts resolve the same model again (a meta build
# and forward of an EfficientNet is 0.3 s on a CPU core).
@functools.lru_cache(maxsize=64)
def input_sizes_refusal(arch, zero_init_residual, sizes, drop_path) -> str | None:
    """The line refusing square images of each of `sizes` (sorted, distinct) px for this model, or None."""
    try:
        with torch.device("meta"):
            model = create_model(arch, 10, zero_init_residual, max(sizes), drop_path).eval()
    except UserError:  # an option the model does not take
        raise
    except Exception:  # noqa: BLE001  (a model that cannot be made on the meta device: made for real later)
        return None
    for size in sizes:
        try:
            with torch.no_grad():
                model(torch.empty(2, 3, size, size, device="meta"))
        except NotImplementedError:  # an operation without a meta kernel: nothing learnt
            return None
        except Exception as err:  # noqa: BLE001
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            return (
                f"--arch {arch} cannot take {size} px images ({reason[:120]}): give --image-size and "
                f"--val-crop-size the size it was made for, or another model"
            )
    return None


def check_arch(arch):
    """One line unless `arch` names a classification model that can be made here, without a download: torchvision's
    detection and segmentation models are refused (they would fetch a pretrained backbone)."""
    import difflib

    if not arch.startswith("timm:"):
        names = torchvision.models.list_models(module=torchvision.models)  # classification models only
        if arch not in names:
            close = difflib.get_close_matches(arch, names, n=3)
            fail(
                f"--arch {arch}: not a torchvision classification model"
                + (f" (did you mean {', '.join(close)}?)" if close else "; timm models: --arch timm:NAME")
            )
        return
    try:
        import timm
    except ImportError as err:
        fail(f"--arch {arch} needs timm, which does not import here ({err}): pip install timm")
    register_coatnet_7()
    name = arch[len("timm:") :]
    if name not in timm.list_models():
        import difflib

        close = difflib.get_close_matches(name, timm.list_models(), n=3)
        fail(
            f"--arch {arch}: unknown timm model"
            + (
                f" (did you mean {', '.join('timm:' + c for c in close)}?)"
                if close
                else " (python -c 'import timm; print(timm.list_models())')"
            )
        )


def register_coatnet_7():
    """timm:coatnet_7_224, the course's day-4 model, in timm's registry (random weights only): CoAtNet-7 (Dai et
    al. 2021, 2.44 B parameters) as timm's four-stage MaxxVit builds CoAtNets, with the paper's widths: a 192-wide
    stem, 8 MBConv blocks 1024 wide, its 42 transformer blocks 2048 wide at 1/16 of the image, then 2 at 3072; 2.43 B
    parameters. timm halves the map at every stage, so the paper's 8 MBConv blocks run at 1/8 of the image here and
    its 4 at 512 are left out."""
    import timm
    from timm.models import register_model

    if timm.models.is_model("coatnet_7_224"):
        return

    def coatnet_7_224(pretrained=False, pretrained_cfg=None, pretrained_cfg_overlay=None, cache_dir=None, **kwargs):
        from timm.models.maxxvit import MaxxVit, MaxxVitCfg

        if pretrained:
            raise ValueError("timm:coatnet_7_224 has no published weights")
        layout = MaxxVitCfg(embed_dim=(256, 1024, 2048, 3072), depths=(2, 8, 42, 2), stem_width=192,
                            head_hidden_size=3072)  # fmt: skip
        return MaxxVit(layout, **kwargs)

    register_model(coatnet_7_224)


def create_timm_model(arch, num_classes, zero_init_residual, image_size, drop_path=None):
    import timm

    name = arch[len("timm:") :]
    if zero_init_residual:
        fail(f"--zero-init-residual: --arch {arch}: a torchvision ResNet option; timm models set their own init")
    # Models with a fixed input size take the training size, and any other (validation's) with dynamic_img_size.
    extra = {} if drop_path is None else dict(drop_path_rate=drop_path)
    for options in (dict(img_size=image_size, dynamic_img_size=True), dict(img_size=image_size), {}):
        if image_size is None and options:
            continue
        try:
            return timm.create_model(name, pretrained=False, num_classes=num_classes, **options, **extra)
        except TypeError:
            continue
    if extra:
        fail(f"--drop-path: timm could not build --arch {arch} with drop_path_rate={drop_path} (no stochastic depth?)")
    fail(f"--arch {arch}: timm could not build it with num_classes={num_classes}")


def classifier_name(module, num_classes):
    """The classifier's name in `module`: its last Linear layer giving `num_classes` outputs (torchvision's fc,
    classifier[-1], heads.head; timm's head.fc or head), or None."""
    found = None
    for name, layer in module.named_modules():
        if isinstance(layer, torch.nn.Linear) and layer.out_features == num_classes:
            found = name
    return found


# ---------------------------------------------------------------------- a 4-channel stem
class ChannelPaddedConv2d(torch.nn.Conv2d):
    """A Conv2d given more input channels than its weight has: the weight is padded with zeros for them (the input's
    extra channels are zeros too), so the output is the unpadded convolution's. Its parameters are the Conv2d's."""

    def forward(self, input):
        extra = input.shape[1] - self.in_channels
        weight = self.weight
        if extra > 0:
            weight = torch.nn.functional.pad(weight, (0, 0, 0, 0, 0, extra))
            if input.is_contiguous(memory_format=torch.channels_last):  # the layout the kernel is chosen for
                weight = weight.contiguous(memory_format=torch.channels_last)
        return self._conv_forward(input, weight, self.bias)


def pad_stem_channels(model):
    """Make the first 3-channel Conv2d of `model` a ChannelPaddedConv2d, in place; its name, or None if it has none."""
    for name, module in model.named_modules():
        if type(module) is torch.nn.Conv2d and module.in_channels == 3 and module.groups == 1:
            module.__class__ = ChannelPaddedConv2d
            return name
    return None


# ---------------------------------------------------------------------- a linear probe
class LinearProbe:
    """A model whose backbone is a fixed feature extractor: train(True) trains the head alone (`probe_head`, a module
    name), the rest stays in eval mode (running statistics used and kept, no dropout)."""

    probe_head: str

    def train(self, mode=True):
        super().train(False)
        self.training = mode
        self.get_submodule(self.probe_head).train(mode)
        return self


def linear_probe(model, head):
    """Freeze every parameter of `model` outside `head` and keep them in eval mode (LinearProbe), in place; returns
    (parameters that train, all parameters)."""
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(head + "."))
    model.__class__ = type(f"LinearProbe{type(model).__name__}", (LinearProbe, type(model)), {})
    model.probe_head = head
    model.train(model.training)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return trained, sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------- anti-aliased downsampling
def binomial_kernel():
    """The 3x3 binomial low-pass filter ([1 2 1] x [1 2 1] / 16), shaped as one depthwise convolution's weight."""
    row = torch.tensor([1.0, 2.0, 1.0])
    return (row[:, None] * row[None, :] / 16).reshape(1, 1, 3, 3)


def blur(x, kernel, stride):
    """`x` filtered channel by channel with `kernel` (binomial_kernel()), zero padding, with `stride`. The kernel
    is the layer's buffer, on x's device already: one made here from Python numbers would be a blocking
    host-to-device copy at every forward."""
    channels = x.shape[1]
    weight = kernel.to(x.dtype).expand(channels, 1, 3, 3)
    return torch.nn.functional.conv2d(x, weight, stride=stride, padding=1, groups=channels)


class BlurConv2d(torch.nn.Conv2d):
    """A strided convolution that sees its input low-pass filtered first (FFCV's BlurPool): less aliasing."""

    def forward(self, x):
        return super().forward(blur(x, self.blur_kernel, 1))


class MaxBlurPool2d(torch.nn.MaxPool2d):
    """Max-pool at stride 1, then blur with the stride (Zhang 2019's MaxBlurPool, Composer's)."""

    def forward(self, x):
        pooled = torch.nn.functional.max_pool2d(
            x, self.kernel_size, 1, self.padding, self.dilation, ceil_mode=self.ceil_mode
        )
        return blur(pooled, self.blur_kernel, self.stride)


def apply_blurpool(model, min_channels=16, maxpool=True):
    """Blur before each strided Conv2d with at least `min_channels` inputs (the stem's 3-channel conv keeps its
    own), and with `maxpool` (Composer's) turn each strided MaxPool2d into a MaxBlurPool2d; without it the
    convolutions only, as FFCV's apply_blurpool. Returns how many layers changed."""
    changed = 0
    device = next(model.parameters(), torch.empty(0)).device
    for module in model.modules():
        if type(module) is torch.nn.Conv2d and max(module.stride) > 1 and module.in_channels >= min_channels:
            module.__class__ = BlurConv2d
        elif maxpool and type(module) is torch.nn.MaxPool2d and module.stride not in (1, (1, 1)):
            module.__class__ = MaxBlurPool2d
        else:
            continue
        # A buffer follows the model to its device; non-persistent: the state dict's keys stay torchvision's.
        module.register_buffer("blur_kernel", binomial_kernel().to(device), persistent=False)
        changed += 1
    return changed


# ---------------------------------------------------------------------- exponential moving average
class ModelEma(torch.optim.swa_utils.AveragedModel):
    """The exponential moving average of `model`'s weights and buffers, `decay` per update, updated at every
    `every`-th optimizer step (`due(step)`); with `warmup`, the decay of update u is min(decay, (1 + u) / (10 + u)),
    timm's, so that the first updates do not keep the random start. The update count is kept in Python
    (`updates`) so that no update waits for the device; `n_averaged` stays in the state dict, as AveragedModel
    writes it, so that checkpoints of either load into the other."""

    def __init__(self, model, decay, every=1, warmup=False):
        super().__init__(model, use_buffers=True)
        self.decay, self.every, self.warmup = decay, every, warmup
        self.updates = 0
        self.copy_updates = 0  # --model-ema-warmup-copy: the first updates copy the weights (the LR's warm-up)

    def due(self, step):
        """Whether optimizer step `step` (counted from 1) updates the average."""
        return step % self.every == 0

    @torch.no_grad()
    def update_parameters(self, model):
        averaged = [*self.module.parameters(), *self.module.buffers()]
        current = [t.detach() for t in (*model.parameters(), *model.buffers())]
        floating = [(a, c) for a, c in zip(averaged, current) if a.is_floating_point()]
        decay = min(self.decay, (1 + self.updates) / (10 + self.updates)) if self.warmup else self.decay
        if self.updates <= self.copy_updates:  # the first copies, as AveragedModel does; torchvision's warm-up too
            foreach_copy_([a for a, _ in floating], [c for _, c in floating])
        else:
            foreach_lerp_([a for a, _ in floating], [c for _, c in floating], 1.0 - decay)
        for a, c in zip(averaged, current):
            if not a.is_floating_point():  # BatchNorm's num_batches_tracked: the model's count
                a.copy_(c)
        self.n_averaged += 1  # on the device, without reading it
        self.updates += 1

    def load_state_dict(self, state_dict, strict=True, assign=False):
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.updates = int(self.n_averaged)  # once, at resume
        return result


def ema_decay(memory, training, world_size) -> float:
    """The EMA's decay per update: --model-ema-decay, or with --model-ema-adjust torchvision's rule (train.py):
    1 - min(1, (1 - decay) x images a step x --model-ema-steps / --epochs), so that a recipe's EMA averages over the
    same share of its training whatever the number of GPUs (images a step: world size x batch x --grad-acc).
    `memory`, `training`: the settings of those groups."""
    if not memory.model_ema_adjust:
        return memory.model_ema_decay
    adjust = world_size * training.batch_size * memory.grad_acc * (memory.model_ema_steps or 1) / training.epochs
    return 1.0 - min(1.0, (1.0 - memory.model_ema_decay) * adjust)


def adapt_module(training, pad_channels, module, num_classes, log):
    """What the flags change in the model's own modules, in place (classes and flags only: the state dict keeps its
    keys): --blurpool's blurred downsampling, --linear-probe's frozen backbone, --dali-pad-channels' 4-channel stem."""
    if training.blurpool:
        changed = apply_blurpool(module, maxpool=training.blurpool_maxpool)
        layers = "strided convolutions and max-pools" if training.blurpool_maxpool else "strided convolutions (FFCV's)"
        if changed == 0:
            fail(f"--blurpool: --arch {training.arch} has no {layers} to blur")
        log(f"BlurPool: {changed} {layers} blur their input first")
    if training.linear_probe:
        head = classifier_name(module, num_classes)
        if head is None:
            fail(
                f"--linear-probe: --arch {training.arch} has no Linear layer with {num_classes} outputs to train alone"
            )
        trained, total = linear_probe(module, head)
        log(
            f"--linear-probe: only the head ({head}, {trained:,} of {total:,} parameters) trains, on the backbone's "
            "features: the backbone frozen, in eval mode (its BatchNorm statistics kept), no backward through it"
        )
    if pad_channels:
        stem = pad_stem_channels(module)
        if stem is None:
            fail(f"--dali-pad-channels: --arch {training.arch} has no 3-channel convolution to pad: drop the flag")
        log(f"--dali-pad-channels: DALI writes 4 channels, {stem}'s weight is padded with zeros to take them")


def saved_activation_bytes(model, image_size, channels_last, checkpointing, arch):
    """Bytes per image autograd keeps for the backward of a forward of a CPU copy of `model` (float32), with or
    without activation checkpointing: what --grad-checkpointing saves, per image, without risking an OOM."""
    with contextlib.nullcontext() if checkpointing else plain_stages(model):
        net = without_sync_batchnorm(copy.deepcopy(model))
    # a meta copy (--fsdp's unsharded shapes) gets uninitialised CPU memory: only sizes are counted
    if any(p.is_meta for p in net.parameters()):
        net = net.to_empty(device="cpu")
        for buffer in net.buffers():  # (an index table, a CoAtNet's relative positions: indices in range)
            if not buffer.is_floating_point():
                buffer.zero_()
    net = net.cpu().float().train()
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


def without_sync_batchnorm(module):
    """`module` with each SyncBatchNorm turned back into a BatchNorm2d (same weights and statistics), which a
    forward in training mode outside the process group and on the CPU accepts."""

    def plain(sync):
        batch_norm = torch.nn.BatchNorm2d(
            sync.num_features, sync.eps, sync.momentum, sync.affine, sync.track_running_stats
        )
        batch_norm.load_state_dict(sync.state_dict())
        return batch_norm.train(sync.training)

    return with_each_replaced(module, torch.nn.SyncBatchNorm, plain)


def with_each_replaced(module, kind, replacement):
    """`module` with each module of class `kind` in it (itself included) put back as replacement(that module)."""
    if isinstance(module, kind):
        return replacement(module)
    for name, child in module.named_children():
        setattr(module, name, with_each_replaced(child, kind, replacement))
    return module


# ---------------------------------------------------------------------- FLOPs and peaks
def train_flops_per_image(
    model: torch.nn.Module, image_size: int, channels_last: bool = False, in_channels: int = 3, batch_size: int = 2
) -> float:
    """Training FLOPs (forward + backward) for one image, counted by FlopCounterMode.

    The model is copied to the "meta" device (shapes only: no weights copied, no memory kept, the model's
    parameters, gradients and BatchNorm statistics untouched). Unwraps DDP (``.module``) and torch.compile
    (``._orig_mod``). Call it before attaching hooks that expect real tensors (e.g. wandb.watch).
    batch_size: images counted at once (2 keeps BatchNorm happy); the result is divided by it.
    """
    from torch.utils.flop_counter import FlopCounterMode

    model = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        model = model.module
    # Eval mode: conv/matmul FLOPs are the same, and SyncBatchNorm does not reach for a process group.
    meta_model = as_plain_linears(meta_copy(model)).eval()  # (float8's: the same products, counted plain)
    meta_model = without_batch_norm(meta_model)
    images = torch.empty(batch_size, in_channels, image_size, image_size, device="meta")
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
        meta_model = meta_model.to(memory_format=torch.channels_last)
    counter = FlopCounterMode(display=False)
    with counter:
        outputs = meta_model(images)
        _sum_outputs(outputs).backward()
    return counter.get_total_flops() / batch_size


def without_batch_norm(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with each BatchNorm (timm's with its activation too) an Identity: FlopCounterMode counts no
    normalisation or activation, the shapes stay, and BatchNorm's meta kernel, a Python decomposition, is most of a
    ResNet's count (ResNet-18: 0.31 s against 0.02 s on a CPU core)."""
    return with_each_replaced(module, batch_norm_base(), lambda batch_norm: torch.nn.Identity())


def meta_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of `model` on the "meta" device: shapes only, no weights copied (deepcopy with a memo that maps
    every parameter and buffer to a meta tensor)."""
    memo = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (
            torch.nn.Parameter(meta, requires_grad=tensor.requires_grad)
            if isinstance(tensor, torch.nn.Parameter)
            else meta
        )
    return copy.deepcopy(model, memo)


def _sum_outputs(outputs):
    if isinstance(outputs, torch.Tensor):
        return outputs.float().sum()
    if isinstance(outputs, dict):
        outputs = list(outputs.values())
    return sum(_sum_outputs(o) for o in outputs if isinstance(o, (torch.Tensor, list, tuple, dict)))


def batch_norm_on_native_kernels(module, device_type: str, amp_dtype: str | None, compiled: bool) -> bool:
    """Whether this model's batch norm runs on torch's native CUDA kernels instead of cuDNN's: in eager mode torch
    gives cuDNN a batch norm whose input is float16 or float32 and its own kernels to bfloat16's (aten's
    _select_batch_norm_backend; tests/test_gpu_checks.py holds the rule), which costs a ResNet-50 about 22 % of its
    step on an H200 (forward +55 %, backward +13 %). torch.compile generates the batch norm itself: no cost there."""
    if device_type != "cuda" or amp_dtype != "bfloat16" or compiled:
        return False
    return any(isinstance(m, batch_norm_base()) for m in module.modules())


BFLOAT16_BATCH_NORM = (
    "WARNING: --amp-dtype bfloat16 without --compile: torch runs this model's batch norm on its own kernels, not "
    "cuDNN's as for float16 (a ResNet-50 step about 22 % slower on an H200); --amp-dtype float16 (the default on a "
    "GPU) or --compile avoid it"
)


# Dense (no sparsity) peaks in FLOP/s per GPU: NVIDIA data sheets. Keys: substring of the lower-cased device name,
# most specific first. "tf32" = float32 matmuls on tensor cores; V100 has no TF32 nor bfloat16 units.
_PEAKS = [
    ("v100s", {"float16": 130e12, "float32": 16.4e12, "tf32": 16.4e12}),
    ("v100-pcie", {"float16": 112e12, "float32": 14e12, "tf32": 14e12}),
    ("v100", {"float16": 125e12, "float32": 15.7e12, "tf32": 15.7e12}),  # SXM2 (Jean Zay)
    ("a100", {"float16": 312e12, "bfloat16": 312e12, "tf32": 156e12, "float32": 19.5e12}),
    ("h100 pcie", {"float16": 756e12, "bfloat16": 756e12, "tf32": 378e12, "float32": 51.2e12}),
    ("h100 nvl", {"float16": 835e12, "bfloat16": 835e12, "tf32": 417.5e12, "float32": 60e12}),
    ("h100", {"float16": 989.4e12, "bfloat16": 989.4e12, "tf32": 494.7e12, "float32": 66.9e12}),  # SXM5
    ("h200 nvl", {"float16": 835e12, "bfloat16": 835e12, "tf32": 417.5e12, "float32": 60e12}),
    ("h200", {"float16": 989.4e12, "bfloat16": 989.4e12, "tf32": 494.7e12, "float32": 66.9e12}),
]


def peak_flops(device_name: str, compute_dtype: str) -> float | None:
    """Dense peak FLOP/s of one V100/A100/H100/H200 for compute_dtype ("float16", "bfloat16", "float32",
    "tf32"); None for other devices or a dtype the GPU has no units for."""
    name = device_name.lower()
    for key, peaks in _PEAKS:
        if key in name:
            return peaks.get(compute_dtype.lower())
    return None
