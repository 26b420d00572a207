"""--fsdp: models larger than one GPU's DDP copy, with PyTorch's FSDP2 (`fully_shard`) and sharded checkpoints.

DDP keeps on every GPU the whole model: float32 parameters and gradients (4 + 4 bytes a parameter) and the
optimizer's state (AdamW: 8 more), 16 bytes a parameter before any activation. FSDP keeps 1/N of each on each of
N ranks and gathers a block's parameters just before its forward (and again before its backward), then reduces
its gradients straight into their shards (reduce-scatter): the same arithmetic as DDP, in less memory, for one
all-gather more per block and step.

- `sharding_units(module)`: the blocks sharded one by one (residual blocks, transformer blocks); `shard_model`
  shards each, then the root (stem, head and whatever is left), with the mixed precision of --amp-dtype.
- `reshard(module)`: free the gathered parameters (after validation's forwards).
- `to_meta`, `fill_from_first_rank`: models built on the meta device. Every rank but the first builds the model's
  shapes only; the first builds it whole, with the seed a single process uses, keeps its values and turns meta too;
  every rank then cuts, splits and shards its meta model and gives storage to its own part only, which the first
  rank's values fill, one bucket of up to 64 MiB at a time: a rank's host memory holds its stage and shard, not the
  model (the first rank: the model once more, while it starts).
- `state_bytes(module, optimizer)`: this rank's bytes of parameters, gradients and optimizer state.
- `ShardedCheckpointSaver`, `load_sharded`: checkpoints written by every rank, each its own shards, with
  torch.distributed.checkpoint (DCP), into a folder `ckpt_eEEEE_sSSSSSSSSS.dcp` that appears complete or not at
  all (see dlojz_lib.checkpoint); DCP reshards on loading, so a run saved on 4 ranks resumes on 2.

Mixed precision (chosen here): parameters gathered and computed in the --amp-dtype (bfloat16 by default with
--fsdp), gradients reduced and kept in float32, like the float32 shards the optimizer updates; float16 is refused
(its loss scaler would have to agree on overflows across the shards, which the fused optimizers cannot take).
"""

import math
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

import dlojz_lib.checkpoint as ckpt
from dlojz_lib.model import families

# Class names of the blocks sharded one by one: torchvision's and timm's residual and transformer blocks.
BLOCK_SUFFIXES = (
    "Block",
    "Bottleneck",
    "BasicBlock",
    "InvertedResidual",
    "EncoderBlock",
    "EncoderLayer",
    "DecoderLayer",
)
# A sharded checkpoint's optimizer groups saved as a list (the first group's keys), not parameter by parameter
NESTED_GROUPS = "optimizer.param_groups.0."
# fill_from_first_rank's broadcasts: few enough collectives for a model's hundreds of tensors, and a bucket's copy
# small beside any GPU's memory
BROADCAST_BUCKET_BYTES = 64 << 20
KERNEL_CHOICE = ("fused", "foreach")  # an optimizer group's settings that say how it steps, not what it does


def holding_parameters(blocks):
    """The blocks that hold parameters (FSDP has nothing to shard in the others)."""
    return [block for block in blocks if any(True for _ in block.parameters())]


def sharding_units(module, family=None):
    """The blocks of `module`'s family (`family`: its row of model.families as the build resolved it; None: looked
    up) that hold parameters; for a model of no family, the outermost submodules whose class is a residual or
    transformer block (BLOCK_SUFFIXES), or if none, its children that hold parameters."""
    family = families.family_of(module) if family is None else family
    if family is not None:
        return holding_parameters(block for _, block in family.blocks(module))
    units = []

    def visit(parent):
        for child in parent.children():
            if type(child).__name__.endswith(BLOCK_SUFFIXES):
                units.append(child)
            else:
                visit(child)

    visit(module)
    if not units:
        units = holding_parameters(module.children())
    return units


def shard_model(module, reshard_after_forward, param_dtype, device, mesh=None, units=None, family=None, offload=False):
    """Shard `module` in place across the process group's ranks (each block, then the root), or across `mesh` (the
    data dimension of a (data, tensor) mesh: 2-D; HSDP's (replicate, shard): sharded along the second, replicated
    along the first). Its parameters become DTensors holding this rank's shard, on `device` (`offload`: in pinned
    host memory, copied to `device` for each block's forward and backward); `param_dtype`: what the gathered weights
    are cast to (the AMP dtype, or None: as held). `units`: the blocks to shard one by one (a pipeline stage's,
    which its family names on the whole model), or None: `sharding_units(module, family)`. Returns the number of
    blocks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    mesh = mesh if mesh is not None else init_device_mesh(device.type, (dist.get_world_size(),))
    kept = dict(mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))
    kept["offload_policy"] = CPUOffloadPolicy(pin_memory=True) if offload else OffloadPolicy()
    units = sharding_units(module, family) if units is None else holding_parameters(units)
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, **kept)
    # The root's own parameters (stem, head) are needed again at once by the backward: kept gathered.
    fully_shard(module, mesh=mesh, reshard_after_forward=False, **kept)
    return len(units)


def named_tensors(module):
    """(path, tensor) for each parameter and buffer of `module` (non-persistent buffers too: a relative position
    index is no less needed for being left out of state dicts)."""
    return [*module.named_parameters(), *module.named_buffers()]


def to_meta(module, ranks):
    """`module` (built whole on the first rank, on the meta device on the others) turned to the meta device on every
    rank, in place. Returns (catalogue, values): every tensor's path, shape and dtype in one order, the same on every
    rank; the first rank's tensors by path (None elsewhere), for fill_from_first_rank. The other ranks' random
    generator takes the first rank's state: what the model's initialisation drew on it, they drew nothing on meta
    tensors, and a single process's dropout follows from that state."""
    values = {path: tensor.detach() for path, tensor in named_tensors(module)} if ranks.is_main else None
    module.to(device="meta")  # (the detached tensors keep the first rank's storage)
    catalogue = [(path, tuple(tensor.shape), tensor.dtype) for path, tensor in named_tensors(module)]
    state = [torch.get_rng_state()]
    dist.broadcast_object_list(state, src=0)
    torch.set_rng_state(state[0])
    return catalogue, values


@torch.no_grad()
def fill_from_first_rank(parts, catalogue, values, device, offloaded=False):
    """`parts` (this rank's modules on the meta device: a model sharded by FSDP, or its pipeline stages, cut,
    parallelised and sharded on meta) given storage on `device` for what they hold (`offloaded`: the parameters in
    host memory, where FSDP's CPU offload keeps them), then filled with the first rank's `values`: each tensor of
    `catalogue` broadcast in turn (in buckets of one dtype, one bucket's memory at a time), a rank keeping its
    stage's tensors and, of a DTensor, its own shard. A tensor-parallel q, k or v part takes its third of the fused
    tensor (timm's qkv, torchvision's in_proj_weight). Every rank calls it, with the same catalogue."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from dlojz_lib.parallelism.tensor import PARTS, fused_name

    targets = {}  # the catalogue's path -> [(this rank's tensor, the part of a fused qkv or None)]
    for part in parts:
        part.to_empty(device=torch.device("cpu") if offloaded else device)
        for holder in part.modules() if offloaded else ():  # the buffers run where the forward does
            for name, buffer in list(holder.named_buffers(recurse=False)):
                setattr(holder, name, buffer.to(device))
        for path, tensor in named_tensors(part):
            whole, piece = fused_name(path)
            targets.setdefault(whole, []).append((tensor, piece))
    for path, full in _broadcast_in_buckets(catalogue, values, device):
        for tensor, piece in targets.pop(path, ()):
            value = full if piece is None else full.chunk(len(PARTS))[PARTS.index(piece)]
            if isinstance(tensor, DTensor):  # this rank's shard: a slice of the value, no message
                value = distribute_tensor(value, tensor.device_mesh, tensor.placements, src_data_rank=None).to_local()
                tensor = tensor.to_local()
            tensor.copy_(value)
    if targets:
        raise ValueError(f"no value for {', '.join(sorted(targets))}: the ranks built different models")


def _broadcast_in_buckets(catalogue, values, device):
    """(path, the first rank's tensor) for each entry of `catalogue`, sent by the first rank in buckets of up to
    BROADCAST_BUCKET_BYTES of one dtype: one broadcast a bucket, not one a tensor (each pays a collective's latency),
    and one bucket's memory at a time (a tensor larger than a bucket goes alone)."""
    bucket, size = [], 0
    for path, shape, dtype in catalogue:
        nbytes = math.prod(shape) * dtype.itemsize
        if bucket and (dtype != bucket[0][2] or size + nbytes > BROADCAST_BUCKET_BYTES):
            yield from _broadcast_bucket(bucket, values, device)
            bucket, size = [], 0
        bucket.append((path, shape, dtype))
        size += nbytes
    if bucket:
        yield from _broadcast_bucket(bucket, values, device)


def _broadcast_bucket(bucket, values, device):
    dtype = bucket[0][2]
    if values is not None:  # (the first rank's copies freed as they go into the bucket)
        flat = torch.cat([values.pop(path).to(device).reshape(-1) for path, _, _ in bucket])
    else:
        flat = torch.empty(sum(math.prod(shape) for _, shape, _ in bucket), dtype=dtype, device=device)
    dist.broadcast(flat.view(torch.uint8) if dtype == torch.bool else flat, src=0)  # (gloo sends no bool)
    offset = 0
    for path, shape, _ in bucket:
        count = math.prod(shape)
        yield path, flat[offset : offset + count].view(shape)
        offset += count


def reshard(module):
    """Free every gathered copy of parameters in the sharded `module` (each rank keeps its shards)."""
    from torch.distributed.fsdp import FSDPModule

    for submodule in module.modules():
        if isinstance(submodule, FSDPModule):
            submodule.reshard()


def _local_bytes(tensor):
    from dlojz_lib.parallelism.tensor import local

    mine = local(tensor)
    return mine.numel() * mine.element_size()


def state_bytes(module, optimizer):
    """This rank's bytes of parameters, of gradients (float32 like the parameters: DDP's buckets or FSDP's
    sharded gradients, whether or not they exist right now) and of optimizer state."""
    params = list(module.parameters())
    optimizer_bytes = sum(
        _local_bytes(value) for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value)
    )
    return dict(
        parameter_bytes=sum(_local_bytes(p) for p in params),
        gradient_bytes=sum(_local_bytes(p) for p in params if p.requires_grad),
        optimizer_bytes=optimizer_bytes,
    )


# ---------------------------------------------------------------------- sharded checkpoints
class ShardedCheckpointSaver:
    """What CheckpointSaver saves, for a sharded model: every rank copies its shards of the model and optimizer into
    host memory (the pause) and a thread writes them (`dcp.async_save`, its collectives on a gloo group of their
    own, apart from training's) into a staging folder. `wait()`, at the next save or the run's end, waits for every
    rank's write; rank 0 then adds the rest (`ckpt.SHARDED_META`: position, schedule, scaler, random generators, the
    run's config, all as they were at the step) and renames the folder into place. Every rank calls `save` and
    `wait`."""

    background = True
    unwritten = ()  # a failed write raises its error from wait() (CheckpointSaver's warn-and-go-on is not for shards)

    def last_unwritten(self):
        return None

    def __init__(self, output_dir, keep, device, fixed, is_main, model, optimizer, scheduler, scaler):
        self.output_dir, self.keep, self.device, self.fixed, self.is_main = (
            Path(output_dir),
            keep,
            device,
            fixed,
            is_main,
        )
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self._group = dist.new_group(backend="gloo")  # collective: every rank makes its saver
        self._pending = None  # (future, meta, staging, name, best) of the checkpoint being written

    def save(self, position, best=False):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        self.wait()  # one checkpoint at a time, in order
        name = ckpt.checkpoint_name(position["epoch"], position["global_step"], sharded=True)
        staging = self.output_dir / f".{name}.tmp"
        if self.is_main:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while writing
        dist.barrier()
        # --pp: each stage's optimizer has its own parameter groups; their settings are saved parameter by parameter
        # (by name, torchtitan's layout), or the stages' groups would overwrite each other's
        flat = StateDictOptions(flatten_optimizer_state_dict=self.fixed["args"].get("pp", 1) > 1)
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=flat)
        future = dcp.async_save(
            {"model": model_state, "optimizer": optimizer_state}, checkpoint_id=staging, process_group=self._group
        )
        meta = None
        if self.is_main:
            meta = ckpt.to_host(
                dict(
                    self.fixed,
                    **position,
                    scheduler=self.scheduler.state_dict() if self.scheduler else None,
                    scaler=self.scaler.state_dict(),
                    rng=ckpt.rng_state(self.device),
                )
            )
        self._pending = (future, meta, staging, name, best)
        return self.output_dir / name

    def wait(self):
        """The checkpoint being written, if any, put in place once every rank has written its shards."""
        if self._pending is None:
            return
        future, meta, staging, name, best = self._pending
        self._pending = None
        future.result()
        dist.barrier(group=self._group)
        if self.is_main:
            ckpt.publish_folder(meta, staging, self.output_dir, name, self.keep, best)
        dist.barrier(group=self._group)  # nobody goes on (and maybe stops) before the checkpoint is in place


def load_sharded(path, module, optimizer=None):
    """Load a sharded checkpoint's model (and optimizer) shards into the sharded `module` (and `optimizer`),
    whatever the number of ranks that wrote it. Every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
    )

    from dlojz_lib.parallelism.tensor import qkv_layouts_differ

    saved_keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if optimizer is not None:
        flat = StateDictOptions(flatten_optimizer_state_dict=not any(k.startswith(NESTED_GROUPS) for k in saved_keys))
        model_state, optimizer_state = get_state_dict(module, optimizer, options=flat)
        state = {"model": model_state, "optimizer": optimizer_state}
    else:
        state = {"model": get_model_state_dict(module)}
    saved_model = [key.removeprefix("model.") for key in saved_keys if key.startswith("model.")]
    check_saved_shapes(saved_keys, state["model"])  # before any rank reads: one line, not DCP's per-rank errors
    try:
        if qkv_layouts_differ(saved_model, state["model"]):
            load_across_qkv_layouts(path, state, saved_keys)
        else:
            dcp.load(state, checkpoint_id=path)
    except CheckpointException as err:  # a BaseException: every rank's failures, one line of the first
        raise ValueError(f"the checkpoint does not load: {str(err).strip().splitlines()[0][:200]}") from None
    set_model_state_dict(module, state["model"])
    if optimizer is not None:
        set_optimizer_state(module, optimizer, state["optimizer"])


def check_saved_shapes(saved, model_state):
    """ValueError naming the first parameter whose whole shape in a sharded checkpoint (its metadata, `saved`) is
    not this run's model's (a position embedding of another length: another --image-size)."""
    differ = [
        (key, list(saved["model." + key].size), list(value.shape))
        for key, value in model_state.items()
        if torch.is_tensor(value)
        and hasattr(saved.get("model." + key), "size")
        and tuple(saved["model." + key].size) != tuple(value.shape)
    ]
    if differ:
        key, theirs, ours = differ[0]
        more = f" (and {len(differ) - 1} more)" if len(differ) > 1 else ""
        raise ValueError(f"the checkpoint's {key} is {theirs}, this run's {ours}{more}")


def saved_sources(key, saved):
    """Where the value of `key` (a flattened state dict key: model.NAME, optimizer.state.NAME.ENTRY or
    optimizer.param_groups.NAME.SETTING) is in a checkpoint whose keys are `saved`, across the two qkv namings:
    ("same", [key]), ("part", [the fused key], index of the part), ("fuse", [the q, k and v keys]), or None."""
    from dlojz_lib.parallelism.tensor import PARTS, fused_name, part_name

    if key in saved:
        return "same", [key], None
    for prefix in ("model.", "optimizer.state.", "optimizer.param_groups."):
        if key.startswith(prefix):
            rest = key.removeprefix(prefix)
            name, suffix = (rest, "") if prefix == "model." else (rest.rsplit(".", 1)[0], "." + rest.rsplit(".", 1)[1])
            fused, part = fused_name(name)
            if part is not None and prefix + fused + suffix in saved:
                return "part", [prefix + fused + suffix], PARTS.index(part)
            names = [part_name(name, p) for p in PARTS]
            parts = [] if None in names else [prefix + part + suffix for part in names]
            if parts and all(k in saved for k in parts):
                return "fuse", parts, None
    return None


def load_across_qkv_layouts(path, state, saved):
    """dcp.load of `state` from a checkpoint written under the other qkv naming (--tp N's q, k and v apart, or
    --tp 1's fused qkv): the keys that match load as they are; a converted weight or optimizer entry is read whole
    (every rank the full tensor: a conversion between layouts, not a step's work), fused or split, then distributed
    over the target's own mesh and placements. The optimizer's groups keep this run's parameter names."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.tensor import DTensor, distribute_tensor

    from dlojz_lib.torch_internals import flatten_state_dict, unflatten_state_dict

    flat, mapping = flatten_state_dict(state)
    request, same, converted = {}, [], {}
    for key in flat:
        if key.endswith(".params") and key.startswith("optimizer.param_groups."):
            continue  # this run's parameter names
        found = saved_sources(key, saved)
        if found is None:
            raise KeyError(f"the checkpoint has no {key}")
        kind, sources, index = found
        if kind == "same":
            request[key] = flat[key]
            same.append(key)
            continue
        converted[key] = found
        for source in sources:
            meta = saved[source]
            if isinstance(meta, TensorStorageMetadata):
                request.setdefault(source, torch.empty(meta.size, dtype=meta.properties.dtype))
            else:
                request.setdefault(source, None)  # an object (a setting): DCP puts it in
    dcp.load(request, checkpoint_id=path)
    for key in same:
        flat[key] = request[key]  # (a tensor loaded in place; an object replaced)
    for key, (kind, sources, index) in converted.items():
        values = [request[source] for source in sources]
        target = flat[key]
        if not torch.is_tensor(target):
            flat[key] = values[0]  # a setting: q's (or the fused one's) for each part
            continue
        if target.dim() == 0:
            whole = values[0]
        elif kind == "part":
            whole = values[0].chunk(3)[index]
        else:
            whole = torch.cat(values)
        if isinstance(target, DTensor):
            local = distribute_tensor(whole.to(target.device, target.dtype), target.device_mesh, target.placements)
            target.to_local().copy_(local.to_local())
        else:
            target.copy_(whole)
    state.update(unflatten_state_dict(flat, mapping))


def set_optimizer_state(module, optimizer, state):
    """A checkpoint's optimizer state into `optimizer` (over `module`'s shards or whole parameters). Parameters that
    have not stepped yet have no state (the backbone while --freeze-backbone-epochs holds it), as in a fresh
    optimizer: not an error."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    flat = "param_groups" not in state  # saved parameter by parameter (--pp)
    options = StateDictOptions(strict=False, flatten_optimizer_state_dict=flat)
    if flat:  # torch reads back only the settings a group already has: the others (a schedule's max_lr,
        # initial_lr ..., in a group built without its schedule) get a place first, once the optimizer's first step
        # has made its own (LAMB's tensor step: a None in its place would be stepped)
        from dlojz_lib.torch_internals import init_optimizer_state

        init_optimizer_state(optimizer)
        names = {id(parameter): name for name, parameter in module.named_parameters()}
        for group in optimizer.param_groups:
            first = names.get(id(group["params"][0])) if group["params"] else None
            settings = [key for key in state if first and key.startswith(f"param_groups.{first}.")]
            for key in settings:
                group.setdefault(key.removeprefix(f"param_groups.{first}."), None)
    # which kernel steps the parameters is this run's: a checkpoint of whole parameters may hold fused SGD, which
    # has no kernel for shards
    kernels = [{key: group[key] for key in KERNEL_CHOICE if key in group} for group in optimizer.param_groups]
    set_optimizer_state_dict(module, optimizer, state, options=options)
    for group, kernel in zip(optimizer.param_groups, kernels, strict=True):
        group.update(kernel)


def load_full_weights(module, weights):
    """An ordinary checkpoint's weights (rank 0's full tensors, every rank reads them) into a sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(module, weights, options=StateDictOptions(full_state_dict=True))


def match_sharded_forwards(net, images, forwards, loaders, training, max_batches, tta_flip):
    """FSDP: as many forwards as the rank with the most validation batches (each gathers every rank's shards), then
    the blocks kept gathered after their forward (--no-fsdp-reshard-after-forward) freed."""
    for _ in range(forwards, min(loaders.n_val_batches_most, max_batches or loaders.n_val_batches_most)):
        with training.autocast():  # (every rank has an image: build_loaders checks it)
            net(images[:1])
            if tta_flip:
                net(images[:1].flip(3))
    reshard(net)
