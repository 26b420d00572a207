"""dlojz's run settings: `resolve_config(args)` -> `Config`, from the flags that dlojz_lib/settings/flags.py parses.

`resolve_config(args)` fills what the user left unset (the GPU defaults, or the CPU profile without a GPU; AMP,
TF32 and DataLoader workers from the device and the Slurm task) and checks every flag, all before any process
group starts or any data is read: a typo costs one line and exit status 2, never a data scan. It returns a frozen
`Config`: nothing in the run changes a setting afterwards, except the output folder that rank 0 names for all
ranks (`dataclasses.replace`, in dlojz_lib.dist.setup_distributed).

Importing this module imports no torch (the functions that need it import it).
"""

import argparse
import dataclasses
import functools
import os
from datetime import datetime
from pathlib import Path

from dlojz_lib.checks import UserError, fail
from dlojz_lib.settings.flag_checks import check_data_variable, check_flags
from dlojz_lib.settings.flags import FROM_TIMM, FUSED, get_args_parser
from dlojz_lib.settings.launch import load_idr_torch
from dlojz_lib.settings.layout import Layout, resolve_layout
from dlojz_lib.settings.recipe import read_recipe

# GPU defaults are the course's; without a GPU the CPU profile keeps `--test` to a few minutes on a laptop, with the
# learning rate scaled to its smaller batch by the linear scaling rule (0.1 x 32/128: at 0.1, ResNet-50 at batch 32
# diverged on the embedded data; at 0.025, with zero-init residual blocks, 84 % validation accuracy in 2 epochs).
# Any flag given explicitly overrides its profile value.
PROFILES = {
    "gpu": dict(batch_size=128, image_size=224, val_resize_size=256, val_crop_size=224, val_batch_size=256, lr=0.1),
    "cpu": dict(batch_size=32, image_size=64, val_resize_size=73, val_crop_size=64, val_batch_size=64, lr=0.025),
}


def flag_type(action):
    """The type of a flag's value in `Config`, read from its row: a switch is a bool, a number its `Number`'s kind, a
    list of values a list (a tuple once resolved), None where the row's default is None (the feature off, or a value
    filled at start-up)."""
    if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
        kind = bool
    elif isinstance(action, argparse._AppendAction):
        kind = list[str]
    else:
        kind = getattr(action.type, "kind", action.type) or str
        if action.nargs not in (None, "?"):
            kind = tuple
    return kind | None if action.default is None else kind


def flag_fields(actions) -> list:
    """(name, type) of each flag among a parser's `actions`, in their order (its --help groups), once each: the
    hidden --no-FLAG forms share their flag's name."""
    fields = {}
    for action in actions:
        if action.dest != "help" and action.help != argparse.SUPPRESS:
            fields.setdefault(action.dest, flag_type(action))
    return list(fields.items())


def section_name(title):
    """A --help group's section name: the first word of its title (training, optimizer, memory, augmentation,
    validation, profiler, modes, data, dataloader, device, distribution, logging)."""
    return title.split()[0].rstrip(",").lower()


def flag_sections(parser) -> dict:
    """{section name: its flags' (name, type)}, one section per --help group with flags."""
    sections = {}
    for group in parser._action_groups:
        fields = flag_fields(group._group_actions)
        if fields and group.title != "options":  # (options: --config alone, the recipe files)
            sections[section_name(group.title)] = fields
    return sections


class RunSettings:
    """Every setting of a run: the flags (same names), the profile's values filled in, and what follows from the
    device and the Slurm task. Saved in checkpoints as `args` and given to W&B as its config.

    `Config`, the frozen dataclass of these settings, is generated from the parser's table (one field per flag, the
    flag's row its only definition) and the fields below that no flag sets."""

    def section(self, name):
        """The settings of one --help group (`cfg.section("logging").output_dir`), frozen: what a builder that
        needs one topic's flags takes, rather than the whole Config."""
        section = SECTIONS[name]
        return section(**{field.name: getattr(self, field.name) for field in dataclasses.fields(section)})

    @functools.cached_property
    def parallelism(self) -> Layout:
        """The run's layout as one record (settings.layout.Layout), read once from the layout flags that
        `resolve_layout` filled and checked: what the build, the unit pass and the pipeline ask, never the flags. A
        Config made anew (`dataclasses.replace`: the global batch's compile mode) reads its own."""
        return Layout.of(self)

    @property
    def autocast_dtype(self):
        import torch

        return getattr(torch, self.amp_dtype)

    @property
    def amp_torch_dtype(self):
        """AMP's torch dtype, None without --amp: what FSDP gathers the weights in, and what autocast runs."""
        return self.autocast_dtype if self.amp else None

    @property
    def writes_checkpoints(self):
        """The runs that train for real, and own their output folder (not --test, --eval-only, --loader-only)."""
        return not (self.test or self.eval_only or self.loader_only)

    @property
    def compute_dtype(self):
        """What the convolutions compute in: the AMP dtype, else tf32 or float32."""
        return self.amp_dtype if self.amp else ("tf32" if self.tf32 else "float32")


# What follows from the machine, after the flags: no flag sets these.
# (notes: the lines rank 0 prints once the run starts, profile values and warnings)
# (set_by_recipe: the flags whose value is the one a --config file gives: a check of what a flag does on this run
# says such a value once rather than refusing it, the recipe being written for other runs)
DERIVED_FIELDS = [("torch_device", str), ("cpus_per_task", int), ("notes", tuple, dataclasses.field(default=()))]
DERIVED_FIELDS += [("set_by_recipe", tuple, dataclasses.field(default=()))]
_FLAGS = get_args_parser()  # the table Config and its sections are made from (read once, at import)
Config = dataclasses.make_dataclass(
    "Config", flag_fields(_FLAGS._actions) + DERIVED_FIELDS, bases=(RunSettings,), frozen=True
)
Config.__module__ = __name__  # (make_dataclass's own is the caller's only from Python 3.12): pickled by name
SECTIONS = {
    name: dataclasses.make_dataclass(f"{name.title()}Settings", fields, frozen=True)
    for name, fields in flag_sections(_FLAGS).items()
}


def pretrained_preprocessing(values) -> list:
    """--pretrained: the validation resize and crop of the weights (and the training crop at that size) where not
    given on the command line; the note says what was taken and what dlojz does differently."""
    from dlojz_lib.model.pretrained import published_preprocessing

    published = published_preprocessing(values["arch"], values["pretrained"])
    if published is None:
        return []
    sizes = dict(
        val_resize_size=published["val_resize_size"],
        val_crop_size=published["val_crop_size"],
        image_size=published["val_crop_size"],
    )
    taken = {key: size for key, size in sizes.items() if values[key] is None}
    values.update(taken)
    note = f"--pretrained {values['pretrained']}: the weights' preprocessing"
    if taken:
        note += ": " + " ".join(f"--{key.replace('_', '-')} {size}" for key, size in taken.items())
    from dlojz_lib.data.transforms import IMAGENET_MEAN, IMAGENET_STD

    if (published["mean"], published["std"]) != (IMAGENET_MEAN, IMAGENET_STD):
        for key in ("mean", "std"):
            if values[key] is None:
                values[key] = published[key]
                note += f"{':' if not taken else ''} --{key} {' '.join(f'{value:g}' for value in published[key])}"
    note += f" (given flags win); resize {published['interpolation']}, dlojz's is antialiased bilinear"
    return [note]


def fill_num_workers(values, cpus_per_task, notes):
    """--num-workers: by default one fewer than the task's CPUs (one core left to the training process, which feeds
    the GPU), at most 16; more than twice the CPUs refused, more than the CPUs warned of."""
    default_workers = max(0, min(cpus_per_task - 1, 16))
    if values["num_workers"] is None:
        values["num_workers"] = default_workers
    elif values["num_workers"] > 2 * cpus_per_task:  # each worker a process with its own decoded batches
        fail(
            f"--num-workers {values['num_workers']}: this task may use {cpus_per_task} CPUs (affinity or "
            f"SLURM_CPUS_PER_TASK); more than twice as many workers only compete for them and fill the memory: "
            f"give at most {2 * cpus_per_task} (default: {default_workers})"
        )
    elif values["num_workers"] > cpus_per_task:
        notes.append(
            f"WARNING: --num-workers {values['num_workers']} exceeds the {cpus_per_task} CPUs of this task: "
            "workers will compete"
        )


def fill_device_defaults(values, torch_device, notes):
    """What follows from the device where not given: page-locked buffers and periodic checkpoints on a GPU, AMP
    (float16 on a GPU without --fsdp, else bfloat16), TF32 from compute capability 8.0 (never on the CPU)."""
    import torch

    on_gpu = torch_device != "cpu"
    values["pin_memory"] = values["pin_memory"] and on_gpu  # page-locked buffers serve host-to-GPU copies only
    if values["checkpoint_every"] is None:  # a dead node loses 15 minutes on average, for a copy of the state
        values["checkpoint_every"] = 30.0 if on_gpu and values["requeue"] else 0.0
    if values["amp"] is None:
        values["amp"] = on_gpu
    if values["amp_dtype"] is None:  # FSDP: bfloat16, which needs no loss scaler across the shards
        values["amp_dtype"] = "float16" if on_gpu and not values["fsdp"] else "bfloat16"
    if values["tf32"] is None:
        values["tf32"] = on_gpu and torch.cuda.get_device_capability(torch_device)[0] >= 8
    elif values["tf32"] and not on_gpu:
        values["tf32"] = False
        notes.append("--tf32: no effect on the CPU (TF32 is a format of NVIDIA GPUs' matrix units); float32 it is")


def resolve_config(args, chosen=None) -> Config:
    """Fill the defaults that depend on the machine and check every flag; raise UserError on bad input. `chosen`:
    the Layout --layout auto picked (its flags replace the layout flags'), or None."""
    import torch

    check_launch()  # before idr_torch reads the launcher's variables
    check_flags(vars(args))  # as given (check_command_line's checks, for a caller that skipped it), then once filled
    idr_torch = load_idr_torch()
    values = vars(args).copy()
    if chosen is not None:  # --layout auto's pick: the run (and its args.toml) holds the layout's own flags
        values.update(chosen.flags(), layout=None)
    notes = []
    torch_device = local_device(args.device, idr_torch.local_rank)
    on_gpu = torch_device != "cpu"

    if values["pretrained"] is not None:  # the sizes the weights were evaluated at, where not given
        notes.extend(pretrained_preprocessing(values))
    if values["test_unsync_steps"] is None:  # half the steps, when the chronometer keeps 10 (5 after its warm-up)
        values["test_unsync_steps"] = (
            values["test_nsteps"] // 2 if values["test"] and values["test_nsteps"] >= 20 else 0
        )
    profile = PROFILES["gpu" if on_gpu else "cpu"]
    unset = [key for key in profile if values[key] is None]
    values.update({key: profile[key] for key in unset})
    if not on_gpu and unset:
        notes.append(
            "CPU profile (no GPU): "
            + " ".join(f"--{k.replace('_', '-')} {profile[k]}" for k in unset)
            + "  (any flag given explicitly wins)"
        )
    cpus_per_task = idr_torch.cpus_per_task
    fill_num_workers(values, cpus_per_task, notes)
    fill_device_defaults(values, torch_device, notes)
    resolve_layout(values, notes)  # the layout flags filled and checked: Config.parallelism's record
    if values["drop_last"] is None:
        # A last, smaller batch is a new input shape: a new cuDNN autotuning and, compiled, a recompilation.
        values["drop_last"] = bool(values["compile"])
        if values["compile"]:
            notes.append(
                "--compile: the last incomplete batch of each epoch is dropped (a new shape would recompile); "
                "--no-drop-last keeps it"
            )
    if values["randaugment"] is not None:
        values["randaugment"] = tuple(values["randaugment"])
    if values["output_dir"] is None:
        job = os.environ.get("SLURM_JOB_NAME", "dlojz")
        job_id = os.environ.get("SLURM_JOB_ID") or datetime.now().strftime("%Y%m%d-%H%M%S")
        values["output_dir"] = os.path.join("runs", f"{job}_{job_id}")
    set_by_recipe = []
    for recipe in values["config"] or ():
        given = read_recipe(get_args_parser(), recipe)
        notes.append(f"recipe {recipe}: " + ", ".join(f"{key}={values[key]}" for key in given))
        set_by_recipe += [key for key, value in given.items() if values[key] == value]
    cfg = Config(**values, torch_device=torch_device, cpus_per_task=cpus_per_task, set_by_recipe=tuple(set_by_recipe))
    check(cfg)
    if on_gpu:
        capability = torch.cuda.get_device_capability(torch_device)
        notes.extend(precision_notes(cfg.section("device"), cfg.compile, cfg.optimizer, capability))
    if on_gpu and cfg.sync_bn:
        notes.append(
            "--sync-bn: torch's SyncBatchNorm waits for the GPU once per BatchNorm layer in each training forward "
            "(it drops the ranks without images); worth it for small per-GPU batches only"
        )
    if on_gpu and cfg.amp and (cfg.batch_size % 8 or cfg.image_size % 8):
        notes.append(
            f"WARNING: with AMP, Tensor Cores want multiples of 8: --batch-size {cfg.batch_size}, "
            f"--image-size {cfg.image_size}"
        )
    return dataclasses.replace(cfg, notes=tuple(notes))


def precision_notes(device, compile, optimizer, capability):
    """What a float16 run on this GPU should know: bfloat16 needs no GradScaler where the GPU has it (compute
    capability 8.0 and newer), but in eager mode it costs a BatchNorm model cuDNN's batch norm (torch gives
    bfloat16's to its own kernels: dlojz_lib.model.zoo.batch_norm_on_native_kernels); an optimizer without a fused step
    waits for the GPU at every float16 step."""
    notes = []
    # what bfloat16 costs where it is an option: nothing compiled; in eager mode, a BatchNorm model's batch norm
    cost = "" if compile else " (without --compile, a BatchNorm model's batch norm then leaves cuDNN: ~22 % slower)"
    if device.amp and device.amp_dtype == "float16":
        if capability[0] >= 8:
            notes.append(
                "AMP float16 with a GradScaler (loss scaling, skipped overflow steps); on this GPU "
                f"--amp-dtype bfloat16 needs no GradScaler{cost}"
            )
        if optimizer not in FUSED:
            notes.append(
                f"WARNING: --optimizer {optimizer} has no fused step: the float16 GradScaler reads its "
                "overflow flag on the host, one GPU synchronisation per optimizer step; "
                + (f"--amp-dtype bfloat16 avoids it{cost}" if capability[0] >= 8 else f"{', '.join(FUSED)} avoid it")
            )
    return notes


def local_device(device_flag, local_rank):
    """This rank's device as a string: one GPU per task, picked by the local rank among the GPUs this task sees
    (all of the node's, or only its own when Slurm binds GPUs to tasks), or the CPU."""
    import torch

    if device_flag == "cpu" or (device_flag == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        fail(
            "--device cuda: no CUDA GPU is visible here"
            + (driver_too_old() or "")
            + "; use --device cpu or run on a GPU node"
        )
    index = local_rank % torch.cuda.device_count()
    check_kernels(index)
    return f"cuda:{index}"


CUDA12_HINT = (
    "install a CUDA 12 build of torch (pip install torch --index-url <PyTorch's wheel index>/whl/cu126) "
    "or load the site's PyTorch (module load pytorch-gpu/...)"
)


def kernels_run_on(arch, device_cc):
    """Whether the code torch lists as `arch` (sm_86, sm_90a, sm_100f, compute_90...) runs on a GPU of compute
    capability `device_cc` (89 for 8.9); None for a name this rule cannot read. A cubin runs on the GPUs of its major
    version from its own minor on (torch's `_device_requirement`, which knows the exceptions, where it has one),
    an arch-specific one (sm_90a) on its own GPU only, a family one (sm_100f) on its family; PTX (compute_XY) is
    compiled at load time for any newer GPU."""
    import torch

    kind, _, version = arch.partition("_")
    suffix = version[-1:] if version[-1:].isalpha() else ""
    number = version[: len(version) - len(suffix)]
    if kind not in ("sm", "compute") or not number.isdigit() or suffix not in ("", "a", "f"):
        return None
    code_cc = int(number)
    if suffix == "a":
        return device_cc == code_cc
    if kind == "compute" and not suffix:
        return device_cc >= code_cc
    requirement = None if suffix else getattr(torch.cuda, "_device_requirement", lambda code: None)(code_cc)
    if requirement is not None:
        return device_cc in requirement
    return device_cc // 10 == code_cc // 10 and device_cc >= code_cc  # a family build, or one torch does not know


def check_kernels(index):
    """Fail in one line if this torch has no kernels for the GPU (the pinned CUDA 13 wheel stops at sm_75: no V100)."""
    import torch

    if torch.version.cuda is None:  # a ROCm build lists gfx targets, and HIP checks them itself
        return
    major, minor = torch.cuda.get_device_capability(index)
    archs = torch.cuda.get_arch_list()
    verdicts = [kernels_run_on(arch, 10 * major + minor) for arch in archs]
    if any(verdicts) or all(verdict is None for verdict in verdicts):  # (an empty or unreadable list: torch knows)
        return
    fail(
        f"this torch {torch.__version__} (CUDA {torch.version.cuda}) has no kernels for "
        f"{torch.cuda.get_device_name(index)} (sm_{major}{minor}; built for {', '.join(archs)}): {CUDA12_HINT}"
    )


def driver_too_old():
    """', the NVIDIA driver ... is too old for this torch's CUDA' when NVML says so, else None."""
    try:
        import pynvml

        pynvml.nvmlInit()
        driver_cuda = pynvml.nvmlSystemGetCudaDriverVersion()  # e.g. 12040 for CUDA 12.4
        driver = pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # no NVML, no driver: nothing more to say
        return None
    import torch

    needed = tuple(int(x) for x in (torch.version.cuda or "0.0").split(".")[:2])
    if (driver_cuda // 1000, driver_cuda % 1000 // 10) < needed:
        driver = driver.decode() if isinstance(driver, bytes) else driver
        return (
            f": the NVIDIA driver {driver} supports CUDA up to {driver_cuda // 1000}.{driver_cuda % 1000 // 10}, "
            f"this torch needs CUDA {torch.version.cuda}; {CUDA12_HINT}"
        )
    return None


def check_launch():
    """The launcher's variables whole and consistent (dlojz_lib.settings.launch): never N copies of one silent process."""
    from dlojz_lib.settings.launch import launch_problem

    if (problem := launch_problem(os.environ)) is not None:
        fail(problem)


def check(cfg: Config):
    """What needs the machine or the files: the device, the libraries a flag needs, the output paths."""
    values = dataclasses.asdict(cfg)
    check_flags(values)
    check_data_variable(values)
    if cfg.torch_device == "cpu" and cfg.parallelism.cuda_graphs:
        fail(
            f"--compile-mode {cfg.compile_mode} records CUDA graphs, which need a GPU: on the CPU use "
            "--compile-mode default or max-autotune-no-cudagraphs"
        )
    from dlojz_lib.checkpoint import resumes_a_checkpoint

    starts_from_weights = not resumes_a_checkpoint(cfg.resume, cfg.output_dir)  # (a resumed run: its checkpoint's)
    sizes = [size for size in (cfg.image_size, cfg.val_crop_size, cfg.min_res, cfg.max_res) if size]
    check_model_sources(cfg.section("training"), sizes, cfg.optimizer, starts_from_weights)
    check_on_device(cfg.parallelism, cfg.torch_device, cfg.section("memory"), cfg.section("device"))
    if cfg.wandb and cfg.wandb_mode == "online" and not (cfg.test or cfg.eval_only or cfg.findlr):
        check_wandb_login()
    if cfg.data_backend == "dali":
        from dlojz_lib.data.dali import check_available

        if (reason := check_available()) is not None:
            fail(reason)
    if load_idr_torch().rank == 0:  # what rank 0 writes, checked before the run rather than found after it
        check_run_outputs(cfg.section("logging"), cfg.section("modes"), cfg.data_root)


def check_on_device(layout, torch_device, memory, device):
    """What the run's device takes: FSDP's own settings, SyncBN's CUDA modules, FSDP's offload and float8 on a GPU,
    the AMP dtype's kernels. `layout`: the run's Layout; `memory`, `device`: those --help groups' settings."""
    import torch

    on_cpu = torch_device == "cpu"
    if layout.fsdp:
        check_fsdp(memory, device)
    if memory.sync_bn and on_cpu:
        fail("--sync-bn needs CUDA: torch's SyncBatchNorm works with GPU modules only")
    if layout.offload and on_cpu:
        fail(
            "--fsdp-offload keeps the shards in host memory and copies each block's to the GPU for its forward and "
            "backward: this run is on the CPU, whose shards are in host memory already; drop --fsdp-offload"
        )
    if layout.float8 is not None:
        check_float8(layout.float8, torch_device, device.amp, compiled=memory.compile)
    if device.amp:
        check_autocast(torch.device(torch_device), getattr(torch, device.amp_dtype))


def check_model_sources(training, sizes, optimizer, starts_from_weights):
    """The model and what it starts from, before the data is scanned: its name and input `sizes`, timm for timm's
    optimizers, the teacher, the --initial-checkpoint file and the --pretrained weights (unless the run resumes a
    checkpoint, whose weights it takes). `training`: the training group's settings."""
    from dlojz_lib.model.zoo import check_arch, check_input_sizes

    check_arch(training.arch)
    check_input_sizes(training.arch, training.zero_init_residual, sizes, training.drop_path)
    if optimizer in FROM_TIMM:  # timm is imported only for them
        try:
            import timm.optim  # noqa: F401
        except ImportError as err:
            fail(
                f"--optimizer {optimizer} needs timm, which does not import here ({err}): pip install timm, "
                f"or use --optimizer {' or '.join(FUSED)}"
            )
    if training.teacher is not None and not Path(training.teacher).exists():  # a model name: known, weights cached
        from dlojz_lib.model.pretrained import published_weights_file

        try:
            check_arch(training.teacher)
            published_weights_file(training.teacher, "DEFAULT")
        except UserError as err:
            fail(f"--teacher {training.teacher}: no such checkpoint, and as a model name: {err}")
    if training.initial_checkpoint is not None and starts_from_weights:
        from dlojz_lib.model.pretrained import check_weights_file

        check_weights_file(training.initial_checkpoint)
    if training.pretrained is not None and starts_from_weights:
        from dlojz_lib.model.pretrained import published_weights_file

        published_weights_file(training.arch, training.pretrained)  # in the local cache, or one line saying how


def check_run_outputs(logging, modes, data_root):
    """The folders and files a run writes (`logging` and `modes`: the settings of those groups): outside the data
    set it reads, writable, not a run's own file under another flag, no two the same."""
    from dlojz_lib.checks import check_output_folder, check_side_outputs
    from dlojz_lib.data.datasets import written_inside_data
    from dlojz_lib.log import tensorboard_folder

    if not modes.synthetic:  # before any folder is made: what the run writes is not in what it reads
        written = {"--output-dir": logging.output_dir, "--predictions": modes.predictions}
        if modes.tensorboard is not None:
            written["--tensorboard"] = tensorboard_folder(modes.tensorboard, logging.output_dir)
        if (problem := written_inside_data(data_root, written)) is not None:
            fail(problem)
    check_output_folder(logging.output_dir, "--output-dir")  # --test too: the chronometer's trace and plot go there
    if modes.tensorboard:  # (its default, the output folder's tensorboard/, is made with the output folder)
        check_output_folder(modes.tensorboard, "--tensorboard")
    side = {
        "--metrics-json": (logging.metrics_json, "metrics"),
        "--val-history": (logging.val_history, "history"),
        "--predictions": (modes.predictions, "predictions"),
    }
    for flag, (path, _) in side.items():
        if path:  # (writable, not a folder: check_side_outputs below)
            check_not_a_run_file(path, flag, logging.output_dir)
    check_side_outputs(side)


def check_not_a_run_file(path, flag, output_dir):
    """A metrics file written over one of the files a run writes in its folder under their own names would break a
    resume (a JSON text in `latest`) or be overwritten at the next checkpoint: refused, naming the flag."""
    from dlojz_lib.checkpoint import BEST, LATEST, NAME_RE, RUN_LOCK
    from dlojz_lib.data.datasets import VAL_SPLIT_FILE
    from dlojz_lib.log import ARGS_FILE, CHRONO_TRACE, FINDLR_CSV, FINDLR_PNG, TIMELINE
    from dlojz_lib.metrics import CONFUSION_PNG, PER_CLASS_CSV

    run_files = (LATEST, BEST, ARGS_FILE, CHRONO_TRACE, TIMELINE, FINDLR_CSV, FINDLR_PNG, RUN_LOCK, VAL_SPLIT_FILE)
    run_files += (PER_CLASS_CSV, CONFUSION_PNG)

    path = Path(path)
    if path.resolve().parent != Path(output_dir).resolve():
        return
    name = path.name.removesuffix(".sha256")
    if name in run_files or NAME_RE.match(name) or path.name == "profiler":
        fail(f"{flag} {path}: a file the run itself writes in --output-dir {output_dir}; give another name")


def check_wandb_login():
    """W&B online needs an API key ($WANDB_API_KEY, or `wandb login`'s entry in ~/.netrc): without one, wandb.init
    would ask for it on a terminal nobody reads, or fail with its own traceback at the start of training."""
    import netrc
    from urllib.parse import urlparse

    if os.environ.get("WANDB_API_KEY"):
        return
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        if netrc.netrc(os.environ.get("NETRC")).authenticators(host):
            return
    except (OSError, netrc.NetrcParseError):
        pass
    fail(
        f"--wandb-mode online: no W&B API key here ($WANDB_API_KEY unset, no {host} entry in ~/.netrc); run "
        "`wandb login` on a login node, or keep the default --wandb-mode offline and `wandb sync` the run later"
    )


def check_fsdp(memory, device):
    """One line for each flag that cannot go with --fsdp."""
    if memory.sync_bn:
        fail(
            "--fsdp with --sync-bn: FSDP shards parameters, not BatchNorm's statistics, and synchronised "
            "BatchNorm is a DDP feature; drop --sync-bn (or use a model without BatchNorm)"
        )
    if memory.model_ema:
        fail(
            "--fsdp with --model-ema: the averaged copy would be a whole unsharded model on every rank; drop "
            "--model-ema"
        )
    if device.amp and device.amp_dtype == "float16":
        fail(
            "--fsdp with --amp-dtype float16: the loss scaler would have to agree on overflows across shards; "
            "use --amp-dtype bfloat16 (the default with --fsdp) or --no-amp"
        )


TORCHAO_VERSION = "0.18.0"  # requirements.txt's pin (a test holds them equal)


def check_float8(recipe, torch_device, amp=False, compiled=False):
    """--float8 where it runs: torchao installed, and a GPU of compute capability 8.9 or more or the CPU (a check of
    the numerics there: model.build says so, on a torch whose CPU kernels take the recipe and whose compiler builds
    float8 there); rowwise_with_gw_hp without autocast; else one line."""
    import importlib.util

    import torch

    if importlib.util.find_spec("torchao") is None:
        fail(
            f"--float8 {recipe}: float8 training is torchao's, which is not installed here: pip install "
            f"torchao=={TORCHAO_VERSION} (for torch 2.11 or later); or drop --float8"
        )
    if recipe == "rowwise_with_gw_hp" and amp:
        fail(
            "--float8 rowwise_with_gw_hp: torchao computes its weight gradients from the saved input and the output's "
            "gradient as they are, which autocast leaves in two dtypes: use --float8 rowwise, or --no-amp"
        )
    if torch_device == "cpu":
        check_float8_on_cpu(recipe, compiled)
        return
    capability = torch.cuda.get_device_capability(torch.device(torch_device))
    if capability < (8, 9):
        name = torch.cuda.get_device_name(torch.device(torch_device))
        fail(
            f"--float8 {recipe}: {name} (compute capability {capability[0]}.{capability[1]}) has no float8 matrix "
            "products (8.9 or more: L4, H100, H200, B200); drop --float8"
        )


def check_float8_on_cpu(recipe, compiled):
    """--float8 on the CPU as this torch takes it: row-wise where its product takes row scales, --compile from 2.14
    (2.11's inductor writes float8 C++ that does not build); else one line naming the version."""
    import torch

    from dlojz_lib.torch_internals import cpu_float8_takes_row_scales

    if recipe != "tensorwise" and not cpu_float8_takes_row_scales():
        fail(
            f"--float8 {recipe} on the CPU: this torch {torch.__version__} has no CPU float8 product with a scale "
            "per row (requirements.txt's 2.14.1 has; GPUs from 2.11): use --float8 tensorwise here, or a GPU"
        )
    if compiled and torch.torch_version.TorchVersion(torch.__version__) < "2.14":
        fail(
            f"--float8 {recipe} --compile on the CPU: this torch {torch.__version__}'s compiler writes CPU float8 "
            "code that does not build (requirements.txt's 2.14.1 builds it; GPUs from 2.11): drop --compile, or a GPU"
        )


def check_autocast(device, dtype):
    """Fail with one line, before any training, if this device cannot run autocast in `dtype`."""
    import torch

    # Emulated bfloat16 (V100) runs, but slower than float32: refuse it.
    if (
        device.type == "cuda"
        and dtype == torch.bfloat16
        and not torch.cuda.is_bf16_supported(including_emulation=False)
    ):
        fail(
            f"--amp-dtype bfloat16: {torch.cuda.get_device_name(device)} has no bfloat16 support; use --amp-dtype float16"
        )
    try:
        conv = torch.nn.Conv2d(3, 4, 3).to(device)
        with torch.autocast(device.type, dtype=dtype):
            conv(torch.randn(1, 3, 8, 8, device=device)).float().sum().backward()
    except RuntimeError as err:
        fail(f"--amp-dtype {str(dtype).split('.')[-1]} cannot run on {device.type}: {str(err).splitlines()[0]}")


def set_in_recipe(message, configs) -> str:
    """`message` (a refusal) with the recipe file among `configs` (--config's, in order) that set a flag it names,
    as the parser's own refusals say it (`from_recipe`): `--tp 2` read back from a run's args.toml."""
    parser = get_args_parser()
    argv = [arg for config in configs or () for arg in ("--config", str(config))]
    parser.parse_args(argv)  # (its recipe files, flag by flag)
    return parser.from_recipe(message, argv)
