"""Every place dlojz reaches into torch's private attributes, in one module: what a torch upgrade may break is here
and nowhere else (`tests/test_modules.py` holds it). Written against torch 2.11; each function says what it reads.
Imports are inside the functions: importing this module imports no torch.

- `default_store()`: the default process group's key-value store (`distributed_c10d._get_default_store`).
- `flatten_mesh(mesh, dims, name)`: a DeviceMesh's dimensions as one more, by name (`DeviceMesh._flatten`).
- `flatten_dense(tensors)`, `unflatten_dense(flat, tensors)`: one buffer of many tensors and back
  (`torch._utils._flatten_dense_tensors`, DDP's bucketing).
- `flatten_state_dict(state)`, `unflatten_state_dict(flat, mapping)`: DCP's own flattening of a nested state dict
  (`torch.distributed.checkpoint._nested_dict`), so that keys match what DCP wrote.
- `schedule_stages(schedule)`, `schedule_microbatches(schedule)`: a pipelining schedule's stages (`_stage`, or
  `_stages` for the looped schedules) and its micro-batch count (`_n_microbatches`).
- `schedule_forward_prepared(schedule)`, `recv_buffers_for_backward(schedule)`: whether a schedule has built its
  receive buffers (`_stage_forward_initialized`), and those buffers made to require gradients (`args_recv_info`):
  torch before 2.13 sets that once, at the first step, which a first step in `eval` leaves off.
- `cpu_float8_takes_row_scales()`: whether the CPU's float8 matrix product (`torch._scaled_mm`) takes a scale per
  row, as the row-wise float8 recipes ask: 2.11's does not.
- `init_optimizer_state(optimizer)`: a fresh optimizer's state and the settings its first step adds to a group
  (LAMB's tensor `step`), as DCP's own loading makes them (`state_dict._init_optim_state`: one step of zero
  gradients at a learning rate of 0).
- `allow_recompiles(count)`: torch.compile's graphs a code object may hold raised to `count` at least
  (`torch._dynamo.config.recompile_limit`, 8 by default: a ResNet's blocks share one forward at 7 shapes, each in
  training and validation).
- `warm_compile_workers()`: start torch.compile's worker pool now (`torch._inductor.async_compile.AsyncCompile`).
- `shutdown_loader_workers(loader)`: a DataLoader's persistent workers stopped now (`_iterator._shutdown_workers`).
- `batch_norm_base()`: the class every BatchNorm (1d, 2d, 3d, SyncBatchNorm) derives from (`_BatchNorm`).
- `foreach_copy_(targets, sources)`, `foreach_lerp_(targets, sources, weight)`: one kernel for many tensors
  (`torch._foreach_*`).
- `held_after_forward(module, *inputs)`: the bytes a forward leaves alive (what it holds for the backward), its
  tensors' storages followed by weak reference (`UntypedStorage._weak_ref`, as torch's own memory tracker) under a
  dispatch mode (`torch.utils._python_dispatch`).
- `saved_storage_bytes(run, x, paused, seen)`: the bytes of the distinct storages autograd saves for the backward
  while `run(x)` runs, on the meta device too (storages told apart by their handles, `UntypedStorage._weak_ref`,
  not their addresses); `storage_handles(tensors)`, `forget_handles(handles)`.
- `child_slots(module)`, `own_slots(module)`, `is_persistent(module, name)`, `share_own_tensors(owner, holder)`:
  nn.Module's registries (`_modules`, `_parameters`, `_buffers`, their None entries included;
  `_non_persistent_buffers_set`), as a pipeline's stages are cut from a model and merged on a rank; with them,
  `prune(module, keep)` (what a stage does not keep dropped, None entries left in its place) and
  `take_own_tensors(holder, source)` (a module's own parameters and buffers registered on another).
- `move_forward_hook_last(module, handle)`: a forward hook run after the others (`_forward_hooks`, an ordered dict).
- `costly_ops()`: the ops whose outputs selective activation checkpointing keeps: the matrix products, the
  convolution and the fused attentions' kernels (`aten._scaled_dot_product_*`), and the collectives tensor
  parallelism sends (`torch.ops._c10d_functional`: recomputed, they would be sent again in the backward).
"""

import functools


def child_slots(module) -> dict:
    """`module`'s submodule registry, by name, None entries included (what a pruned model keeps as placeholders):
    the dict itself (`nn.Module._modules`), which the caller may change in place."""
    return module._modules


def own_slots(module) -> tuple:
    """`module`'s own parameter and buffer registries (`_parameters`, `_buffers`), None entries included: the dicts
    themselves, which the caller may change in place."""
    return module._parameters, module._buffers


def is_persistent(module, name) -> bool:
    """Whether `module`'s own buffer `name` goes into its state dict (`_non_persistent_buffers_set`)."""
    return name not in module._non_persistent_buffers_set


def share_own_tensors(owner, holder):
    """`owner` reads its own parameters and buffers from `holder`'s registries from now on (one registry for both:
    what a wrapper puts on `holder`, its shards or gathered parameters, is what `owner`'s code reads)."""
    owner._parameters, owner._buffers = holder._parameters, holder._buffers


def prune(module, keep, prefix=""):
    """Drop from `module`, in place, every parameter and buffer for which keep(path) is False, and the submodules
    under which nothing is kept (entries set to None: state dicts and parameters() skip them); keep reads the
    paths of parameters and buffers only."""
    children = child_slots(module)
    for name, child in list(children.items()):
        if child is None:
            continue
        path = prefix + name
        kept = [keep(f"{path}.{sub}") for sub, _ in (*child.named_parameters(), *child.named_buffers())]
        if all(kept):  # all of it, or stateless (an activation, a pooling, a dropout: the forwards still call it)
            continue
        if any(kept):
            prune(child, keep, path + ".")
        else:
            children[name] = None
    for registry in own_slots(module):
        for name in list(registry):
            if registry[name] is not None and not keep(prefix + name):
                registry[name] = None


def take_own_tensors(holder, source):
    """`source`'s own parameters and buffers (not its submodules'; a pruned one's None entries left out) registered
    on `holder` under the same names, each buffer as persistent as it was."""
    parameters, buffers = own_slots(source)
    for name, parameter in parameters.items():
        if parameter is not None:
            holder.register_parameter(name, parameter)
    for name, buffer in buffers.items():
        if buffer is not None:
            holder.register_buffer(name, buffer, persistent=is_persistent(source, name))


def move_forward_hook_last(module, handle):
    """The forward hook of `handle` runs after `module`'s other forward hooks (`_forward_hooks`, in order)."""
    module._forward_hooks.move_to_end(handle.id)


def flatten_mesh(mesh, dims, name):
    """Dimensions `dims` of `mesh` as one more, `name` (`DeviceMesh._flatten`, as torchtitan names its data-parallel
    ranks across HSDP's replicate and shard dimensions): `mesh[name]` from then on."""
    return mesh[dims]._flatten(name)


def default_store():
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_store()


def flatten_dense(tensors):
    import torch

    return torch._utils._flatten_dense_tensors(tensors)


def unflatten_dense(flat, tensors):
    import torch

    return torch._utils._unflatten_dense_tensors(flat, tensors)


def flatten_state_dict(state):
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state)


def unflatten_state_dict(flat, mapping):
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    return unflatten_state_dict(flat, mapping)


def schedule_stages(schedule):
    """One stage, or several for the looped schedules."""
    return getattr(schedule, "_stages", None) or [schedule._stage]


def schedule_forward_prepared(schedule) -> bool:
    """Whether a schedule has run its first step, which builds its stages' receive buffers
    (`_stage_forward_initialized`, `_stages_forward_initialized` for the looped schedules)."""
    return bool(getattr(schedule, "_stage_forward_initialized", False)) or bool(
        getattr(schedule, "_stages_forward_initialized", False)
    )


def recv_buffers_for_backward(schedule):
    """The receive buffers of a schedule's stages made to require gradients (`args_recv_info`'s `buffer`): torch
    before 2.13 decides it once, as it builds them at the first step, so a schedule whose first step is a forward-only
    `eval` (a validation before any training step, a resumed run's first) has buffers no gradient flows back through;
    2.13 and later decide it at each forward, from the step's grad mode: nothing done there."""
    import torch

    if torch.torch_version.TorchVersion(torch.__version__) >= "2.13":
        return
    from torch.distributed.pipelining.stage import _RecvInfo

    for stage in schedule_stages(schedule):
        for infos in getattr(stage, "args_recv_info", {}).values():
            for info in infos:
                if isinstance(info, _RecvInfo) and isinstance(info.buffer, torch.Tensor) and info.buffer.is_leaf:
                    info.buffer.requires_grad_(True)


def cpu_float8_takes_row_scales() -> bool:
    import torch

    a = torch.ones(2, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(2, 1), scale_b=torch.ones(1, 2), out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def schedule_microbatches(schedule):
    return schedule._n_microbatches


def init_optimizer_state(optimizer):
    from torch.distributed.checkpoint.state_dict import _init_optim_state

    _init_optim_state(optimizer)


def allow_recompiles(count):
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, count)


def warm_compile_workers():
    """False when this torch has no inductor (nothing to start)."""
    try:
        from torch._inductor.async_compile import AsyncCompile
    except ImportError:
        return False
    AsyncCompile.warm_pool()
    return True


def shutdown_loader_workers(loader):
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    if hasattr(loader, "_iterator"):
        loader._iterator = None


def foreach_copy_(targets, sources):
    import torch

    torch._foreach_copy_(targets, sources)


def foreach_lerp_(targets, sources, weight):
    import torch

    torch._foreach_lerp_(targets, sources, weight)


def batch_norm_base():
    import torch

    return torch.nn.modules.batchnorm._BatchNorm


@functools.cache  # read at every checkpointed forward: the set is made once
def costly_ops():
    import torch

    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution.default}
    for attention in (  # the fused attentions' kernels, those of this build
        aten._scaled_dot_product_flash_attention,
        aten._scaled_dot_product_efficient_attention,
        aten._scaled_dot_product_cudnn_attention,
        aten._scaled_dot_product_flash_attention_for_cpu,
    ):
        ops.add(attention.default)
    functional = torch.ops._c10d_functional  # DTensor's collectives, and the wait that completes each
    for collective in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "wait_tensor"):
        ops.add(getattr(functional, collective).default)
    return ops


def held_after_forward(module, *inputs):
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    made = []

    class Made(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                    storage = tensor.untyped_storage()
                    made.append((storage._weak_ref(), storage.data_ptr(), storage.nbytes()))
            return out

    with Made():
        output = module(*inputs)
    own = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *module.buffers())}
    alive = {}  # by storage: a tensor's views count once
    for ref, pointer, size in made:
        if not torch.UntypedStorage._expired(ref) and pointer not in own:
            alive[pointer] = size
        torch.UntypedStorage._free_weak_ref(ref)
    del output
    return sum(alive.values())


def saved_storage_bytes(run, x, paused=(), seen=None):
    """(bytes, output): the bytes of the storages autograd saves for the backward while `run(x)` runs, each storage
    once and none of `seen` (handle -> bytes, filled in: storages already counted, the parameters' among them; a
    meta tensor's storage has no address, its handle tells it apart), nothing saved inside the forwards of the
    modules `paused`; and `run(x)`."""
    import torch

    seen = {} if seen is None else seen
    depth = 0  # > 0 inside a paused module's forward
    found = 0

    def pack(tensor):
        nonlocal found
        if depth == 0:
            storage = tensor.untyped_storage()
            handle = storage._weak_ref()
            if handle in seen:
                torch.UntypedStorage._free_weak_ref(handle)
            else:
                seen[handle] = storage.nbytes()
                found += storage.nbytes()
        return tensor

    def enter(*_):
        nonlocal depth
        depth += 1

    def leave(*_):
        nonlocal depth
        depth -= 1

    hooks = [h for m in paused for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out = run(x)
    finally:
        for hook in hooks:
            hook.remove()
    return found, out


def storage_handles(tensors) -> dict:
    """handle -> bytes of the storages of `tensors` (a model's parameters: for saved_storage_bytes' `seen`)."""
    found = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        found[storage._weak_ref()] = storage.nbytes()
    return found


def forget_handles(handles):
    """Release the storage handles of `handles` (saved_storage_bytes' `seen`, storage_handles')."""
    import torch

    for handle in handles:
        torch.UntypedStorage._free_weak_ref(handle)
