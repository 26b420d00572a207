"""The flags' combinations, checked before torch is imported: what a flag means beside the others (each flag alone
is checked by its type in dlojz_lib/settings/flags.py's table as it is parsed). `check_flags` runs one check per topic;
`checked_values` parses and checks a command line (dlojz.py's first step, and dlojz_lab.py's check of each run of a
sweep); `check_command_line` is dlojz.py's first step itself. Every refusal is one line (UserError) that names the
flags and says what to do.
"""

import os
import re

from dlojz_lib.checks import UserError, fail, missing_data_variable
from dlojz_lib.settings.flags import CUDA_GRAPH_MODES, PATH_FLAGS, built_in_defaults, get_args_parser
from dlojz_lib.settings.layout import check_layout

# timm's --aa strings: a kind, then options, each a letter key and its number (rand-m7-mstd0.5-inc1)
TIMM_AUGMENT = re.compile(r"(rand|augmix|original|originalr|v0|v0r|3a)(-[a-z]+\d*(\.\d+)?)*")
# the sections each timm policy reads (timm.data.auto_augment): a section without a number, it skips without a word
TIMM_SECTIONS = {"rand": ("mstd", "mmax", "inc", "m", "n", "p"), "augmix": ("mstd", "m", "w", "d", "a", "b")}


def check_flags(values):
    """The checks of flags taken together, on the parsed values (a dict): no torch, no GPU, no file read; each flag
    alone was checked by its type as it was parsed. The CPU/GPU profile's values may still be None (unset): what
    compares them waits for resolve_config, which calls this again once they are filled. One function per topic."""
    for check in (
        check_images,
        check_starting_weights,
        check_sampling,
        check_schedule,
        check_augmentation,
        check_optimisation,
        check_speed,
        check_layout,
        check_run_mode,
    ):
        check(values)


def check_images(values):
    """The images' sizes: progressive resizing's resolutions, validation's crop, the unsynchronised window of --test."""
    if (values["min_res"] is None) != (values["max_res"] is None):
        fail("progressive resizing needs both --min-res and --max-res")
    unsync = values.get("test_unsync_steps")
    if unsync:  # (0: none, as resolve_config fills it without --test)
        if not values["test"]:
            fail(f"--test-unsync-steps {unsync} times the last steps of --test: add --test, or drop it")
        if unsync >= values["test_nsteps"]:
            fail(
                f"--test-unsync-steps {unsync} leaves no step to the chronometer: give fewer than --test-nsteps "
                f"{values['test_nsteps']}"
            )
    if values["min_res"] is not None:
        if values["min_res"] > values["max_res"]:
            fail(f"--min-res {values['min_res']} must be at most --max-res {values['max_res']}")
        if not values["start_ramp"] < values["end_ramp"]:
            fail(f"--start-ramp {values['start_ramp']} must be before --end-ramp {values['end_ramp']}")
        if values["synthetic"]:
            fail("--synthetic trains on one fixed batch: progressive resizing (--min-res/--max-res) needs the data")
    crop, resize = values["val_crop_size"], values["val_resize_size"]
    if crop is not None and resize is not None and crop > resize:
        fail(
            f"--val-crop-size {crop} must be at most --val-resize-size {resize} (the center crop is cut from the "
            "resized image)"
        )


def check_starting_weights(values):
    """Where the weights start: --pretrained or --initial-checkpoint, and a fine-tune's frozen backbone."""
    if values["pretrained"] is not None and values["initial_checkpoint"] is not None:
        fail("--pretrained and --initial-checkpoint both give the starting weights: give one of them")
    if values["fetch_weights"] and values["pretrained"] is None:
        fail("--fetch-weights fetches --pretrained's weights: add --pretrained [WEIGHTS]")
    if values["linear_probe"]:
        if values["pretrained"] is None and values["initial_checkpoint"] is None and not values["resume"]:
            fail(
                "--linear-probe trains a head on a frozen backbone: give the backbone's weights with --pretrained or "
                "--initial-checkpoint (or --resume the probe's run)"
            )
        given = [
            flag
            for flag, on in (
                ("--freeze-backbone-epochs", values["freeze_backbone_epochs"] is not None),
                ("--layer-decay", values["layer_decay"] is not None),
                ("--fsdp", values["fsdp"]),
            )
            if on
        ]
        if given:
            fail(f"--linear-probe freezes the backbone for the whole run: drop {', '.join(given)}")
    if values["teacher"] is None:
        given = [
            f"--{n.replace('_', '-')}"
            for n, d in (("distill_alpha", 0.5), ("distill_temperature", 1.0))
            if values[n] != d
        ]
        if given:
            fail(f"{', '.join(given)} set the distillation from a teacher: add --teacher CKPT|NAME, or drop them")
    elif values["pp"] > 1:
        fail(
            "--teacher with --pp: the loss is the last stage's, which has no images to give a teacher: drop one of them"
        )
    frozen = values["freeze_backbone_epochs"]
    if frozen is not None:
        if values["pretrained"] is None and values["initial_checkpoint"] is None and not values["resume"]:
            fail(
                f"--freeze-backbone-epochs {frozen} would keep random weights fixed: give the weights to start from "
                "with --pretrained or --initial-checkpoint (or --resume the fine-tuning run)"
            )
        if frozen >= values["epochs"]:
            fail(
                f"--freeze-backbone-epochs {frozen} must end before --epochs {values['epochs']}: the backbone would never learn"
            )
        if values["findlr"]:
            fail("--findlr sweeps the learning rate of every layer: leave out --freeze-backbone-epochs")


def check_sampling(values):
    """Which images an epoch sees: class balance, repeated augmentation, a subset of the training set."""
    for flag in ("class_weights", "balanced_sampler"):
        if values[flag] and values["synthetic"]:
            fail(
                f"--{flag.replace('_', '-')} balances the data's classes: --synthetic has none (leave one of them out)"
            )
    split = values["val_split"]
    if split is not None and split >= 1 and split != int(split):  # below 1 a share, from 1 a count of images
        fail(f"--val-split {split:g}: a share below 1 (0.1: a tenth), or a whole number of images per class")
    if values["ra_reps"] and values["balanced_sampler"]:
        fail("--ra-reps and --balanced-sampler each choose the epoch's images: give one of them")
    if values["ra_reps"] and values["synthetic"]:
        fail("--ra-reps repeats the data's images: --synthetic has none (leave one of them out)")
    if values["class_weights"] and values["balanced_sampler"]:
        fail(
            "--class-weights balanced and --balanced-sampler each make up for the imbalance; both would favour "
            "the rare classes twice: give one of them"
        )
    subset = values["train_subset"]
    if subset is not None:
        if subset >= 1 and not float(subset).is_integer():
            fail(f"--train-subset is a fraction in (0, 1) or a whole number of images per class (got {subset:g})")
        if values["synthetic"]:
            fail("--train-subset picks images of the data set, which --synthetic does not read: drop one of them")


def check_timm_magnitude(config):
    """Each section is one timm reads, with its number (v0-zzz trained as v0, said nowhere); timm clips an op's
    magnitude to [0, 10] (or to its `mmax`): rand-m100 would train as rand-m10, said nowhere."""
    policy, *sections = config.split("-")
    known = TIMM_SECTIONS.get(policy, ("mstd",))  # (AutoAugment's policies read mstd alone)
    for section in sections:
        key, number = re.fullmatch(r"([a-z]+)([\d.]*)", section).groups()
        if key not in known or not number:
            fail(
                f"--timm-augment {config}: section {section!r} is not one timm's {policy} reads ({', '.join(k + 'N' for k in known)}), "
                "which it would skip without a word; give one of them with its number, or drop it"
            )
    parts = dict(re.fullmatch(r"([a-z]+)([\d.]*)", part).groups() for part in sections)
    if "m" not in parts or not parts["m"]:
        return
    ceiling = float(parts["mmax"]) if parts.get("mmax") else 10.0
    if float(parts["m"]) > ceiling:
        fail(
            f"--timm-augment {config}: magnitude m{parts['m']} above timm's ceiling {ceiling:g}, which it would "
            f"train at instead; give m{ceiling:g} or less (or raise the ceiling with -mmax{parts['m']})"
        )


def check_augmentation(values):
    """The augmentation: one policy at a time, and what DALI's pipeline does not do."""
    policies = augmentation_policies(values)
    if len(policies) > 1:
        fail(f"{' and '.join(policies)}: one augmentation policy at a time (as torchvision's --auto-augment): give one")
    if values["timm_augment"] is not None and not TIMM_AUGMENT.fullmatch(values["timm_augment"]):
        fail(
            f"--timm-augment {values['timm_augment']!r} is not one of timm's augmentation strings (its --aa): "
            "rand-m7-mstd0.5-inc1 (RandAugment), augmix-m5-w3 (AugMix), original or v0 (AutoAugment)"
        )
    if values["timm_augment"] is not None:
        check_timm_magnitude(values["timm_augment"])
    if values["randaugment_mstd"] is not None and not values["randaugment"]:
        fail("--randaugment-mstd varies --randaugment's magnitude: add --randaugment N M")
    if values["data_backend"] == "dali":
        unsupported = [
            flag
            for flag, on in (
                ("--synthetic", values["synthetic"]),
                ("--min-res", values["min_res"] is not None),
                *((policy, True) for policy in augmentation_policies(values)),
                ("--ra-reps", values["ra_reps"] is not None),
                ("--random-erase", values["random_erase"] > 0),
                ("--val-interpolation bicubic", values["val_interpolation"] == "bicubic"),
            )
            if on
        ]
        if unsupported:
            fail(
                f"--data-backend dali does RandomResizedCrop and flip only: {', '.join(unsupported)} needs "
                f"--data-backend pytorch"
            )
        if values["dali_cache"] is not None and values["dali_decode"] == "roi":
            fail("--dali-cache keeps whole decoded images: drop --dali-decode roi (the cache decodes whole)")
        if values["dali_cache"] is not None and values["device"] == "cpu":
            fail("--dali-cache keeps decoded images in GPU memory: drop it on --device cpu")
    elif given := [
        f"--{name.replace('_', '-')}"
        for name, default in built_in_defaults(get_args_parser(), "dali_").items()
        if values[name] != default
    ]:
        fail(f"{', '.join(given)} set DALI's pipeline: add --data-backend dali, or drop them")


def check_optimisation(values):
    """The loss, the optimizer and the averaged weights (the schedule is check_schedule's)."""
    for flag in ("model_ema_steps", "model_ema_warmup", "model_ema_adjust", "ema_judges", "model_ema_warmup_copy"):
        if values[flag] and not values["model_ema"]:
            fail(f"--{flag.replace('_', '-')} sets how --model-ema averages: add --model-ema")
    if values["blurpool_maxpool"] is False and not values["blurpool"]:
        fail("--no-blurpool-maxpool sets which layers --blurpool blurs: add --blurpool")
    if values["bce_target_thresh"] is not None and not values["bce_loss"]:
        fail("--bce-target-thresh binarises --bce-loss's targets: add --bce-loss")
    if values["nesterov"] and values["optimizer"] != "sgd":
        fail(f"--nesterov is SGD's Nesterov momentum: --optimizer {values['optimizer']} has none; drop it")
    if values["nesterov"] and values["mom"] == 0:
        fail("--nesterov needs a momentum: --mom 0 has none")


def check_speed(values):
    """The speed-ups and the watchdogs: CUDA graphs' fixed shapes, FSDP's resharding, hang and straggler bounds,
    what activation checkpointing recomputes."""
    recomputes = values["grad_checkpointing"] or values["activation_checkpointing"] not in (None, "none")
    if values["grad_checkpointing"] and values["activation_checkpointing"] == "none":
        fail("--grad-checkpointing with --activation-checkpointing none: one recomputes, the other not; drop one")
    if values["ac_every"] > 1 and not recomputes:
        fail(
            f"--ac-every {values['ac_every']} sets which blocks --activation-checkpointing recomputes: add "
            "--activation-checkpointing full or selective"
        )
    if values["compile_mode"] in CUDA_GRAPH_MODES:
        # A CUDA graph replays one input shape: each new shape records another graph, and holds its memory.
        graphs = f"--compile-mode {values['compile_mode']} replays CUDA graphs of one input shape"
        if values["min_res"] is not None:
            fail(f"{graphs}: progressive resizing (--min-res) changes it every few epochs; drop one of them")
        if values["drop_last"] is False:
            fail(f"{graphs}: --no-drop-last adds the last, smaller batch; drop --no-drop-last")
        if values["grad_acc"] > 1:
            # A replay's gradients live in the graphs' memory pool, which the next micro-batch's replay reuses.
            fail(
                f"--compile-mode {values['compile_mode']} replays CUDA graphs, whose next replay overwrites the "
                f"gradients --grad-acc {values['grad_acc']} accumulates; use --compile-mode "
                "max-autotune-no-cudagraphs (or default) with --grad-acc, or --grad-acc 1"
            )
        # A graph's parameters are static inputs: FSDP gathers them into new memory every step (cudagraph trees
        # re-record, then stop replaying without a word), and a pipeline stage accumulates its micro-batches.
        layouts = [
            flag
            for flag, given in (("--fsdp", values["fsdp"]), (f"--tp {values['tp']}", values["tp"] > 1),
                                (f"--pp {values['pp']}", values["pp"] > 1))
            if given
        ]  # fmt: skip
        if layouts:
            fail(
                f"--compile-mode {values['compile_mode']} replays CUDA graphs, whose parameters must stay in place; "
                f"under {' and '.join(layouts)} they are gathered anew every step: use --compile (compiled block by block) or "
                "--compile-mode max-autotune-no-cudagraphs"
            )
    if values["global_batch"] is not None and values["grad_acc"] > 1:
        fail(
            f"--global-batch chooses --grad-acc from the ranks the job has: drop --grad-acc {values['grad_acc']} "
            "(--batch-size is the most a rank holds at once)"
        )
    if values["lr_scaling"] is not None and values["global_batch"] is None:
        fail("--lr-scaling says how --lr follows --global-batch: add --global-batch, the global batch --lr is for")
    if 0 < values["straggler_factor"] <= 1:
        fail(f"--straggler-factor {values['straggler_factor']:g}: above 1 (times the others' median), or 0 (off)")
    if 0 < values["hang_timeout"] < 5:
        fail(f"--hang-timeout {values['hang_timeout']:g}: at least 5 seconds (the ranks beat every few), or 0 (off)")


def check_run_mode(values):
    """What the run does: train, resume or start over, find the LR, validate a checkpoint, or time the loader."""
    for flag in PATH_FLAGS:
        if values.get(flag) is not None and not str(values[flag]).strip():  # ("": the current folder, silently)
            name = "--" + flag.replace("_", "-")
            fail(f"{name} is empty: give a path (or leave {name} out for its default)")
    if values["start_over"] and values["resume"]:
        fail("--start-over trains from scratch, --resume continues a run: give one of them")
    if values["resume"] == "auto" and values["output_dir"] is None and not os.environ.get("SLURM_JOB_ID"):
        fail(
            "--resume auto without --output-dir: outside a Slurm job the default folder is named by the time, "
            "a new one each run, so there is never anything to resume; give --output-dir"
        )
    if values["findlr"] and (values["eval_only"] or values["loader_only"]):
        fail("--findlr trains: it cannot go with --eval-only or --loader-only")
    if values["synthetic"] and values["data_root"]:
        fail("--synthetic trains on random tensors and reads no data: drop --data-root, or --synthetic")
    if values["loader_only"] and values["eval_only"]:
        fail("--loader-only times the training DataLoader alone, --eval-only validates a checkpoint: give one of them")
    if values["loader_only"] and values["synthetic"]:
        fail("--loader-only times the DataLoader, which --synthetic does not use: drop one of them")
    for flag in ("eval_ema", "predictions"):
        if values[flag] and not values["eval_only"]:
            fail(f"--{flag.replace('_', '-')} goes with --eval-only --resume CHECKPOINT: add them, or drop it")
    if values["predictions"] and values["synthetic"]:
        fail("--predictions names each image's file: --synthetic has none (leave one of them out)")
    if values["eval_only"] and not values["resume"]:
        fail("--eval-only needs --resume CHECKPOINT (or --resume auto with --output-dir)")
    recomputes = values["grad_checkpointing"] or values["activation_checkpointing"] not in (None, "none")
    # (--eval-only with a run's own flags, recomputation among them, is how a run is evaluated: taken as it is)
    if recomputes and values["linear_probe"]:  # nothing is kept for a backward that does not run through the blocks
        fail(
            "--activation-checkpointing/--grad-checkpointing with --linear-probe, which trains the head alone: "
            "nothing to recompute; drop it"
        )


def augmentation_policies(values):
    """The augmentation policies given (torchvision v2 on the uint8 crops), as their flags."""
    given = (
        ("--randaugment", values["randaugment"]),
        ("--trivialaugment", values["trivialaugment"]),
        ("--autoaugment", values["autoaugment"] is not None),
        ("--augmix", values["augmix"] is not None),
        ("--timm-augment", values["timm_augment"] is not None),
    )
    return [flag for flag, on in given if on]


def check_schedule(values):
    """The schedule's flags that the chosen --lr-scheduler would not use: refused rather than ignored."""
    scheduler = values["lr_scheduler"]
    used_by = dict(
        warmup_start_factor=("cosine", "step", "constant", "linear", "poly"),
        warmup_method=("cosine", "step", "constant", "linear", "poly"),
        min_lr=("cosine", "linear", "poly"),
        lr_step_size=("step",),
        lr_milestones=("step",),
        lr_gamma=("step",),
    )
    for name, schedulers in used_by.items():
        if values[name] is not None and scheduler not in schedulers:
            fail(
                f"--{name.replace('_', '-')} sets --lr-scheduler {' or '.join(schedulers)}, not {scheduler}"
                + (" (its own warm-up starts at lr/25)" if scheduler == "onecycle" and "warmup" in name else "")
                + ": give one of them with --lr-scheduler, or drop it"
            )
    # the schedule's lengths and shapes that have a default: refused when set and the scheduler does not read them
    read_by = dict(warmup_epochs=("cosine", "step", "constant", "poly"), lr_peak_epoch=("linear",),
                   lr_poly_power=("poly",))  # fmt: skip
    defaults = built_in_defaults(get_args_parser(), "")  # (the parser built once: it has some 200 flags)
    for name, schedulers in read_by.items():
        if values[name] != defaults[name] and scheduler not in schedulers:
            fail(
                f"--{name.replace('_', '-')} {values[name]:g} shapes --lr-scheduler {' or '.join(schedulers)}; "
                f"{scheduler} does not read it"
                + (
                    " (its own warm-up: 30% of the steps, from lr/25)"
                    if scheduler == "onecycle" and "warmup" in name
                    else ""
                )
                + ": give one of them with --lr-scheduler, or drop it"
            )
    if values["lr_per_epoch"] and scheduler == "onecycle":
        fail("--lr-per-epoch: onecycle (torch's OneCycleLR) is a per-step schedule: choose another or drop it")
    warmup_given = [
        f"--{n.replace('_', '-')}" for n in ("warmup_start_factor", "warmup_method") if values[n] is not None
    ]
    if warmup_given and scheduler != "linear" and values["warmup_epochs"] == 0:
        fail(f"{' and '.join(warmup_given)} shape the warm-up: give its length with --warmup-epochs")
    if values["lr_step_size"] is not None and values["lr_milestones"] is not None:
        fail("--lr-step-size and --lr-milestones both place the LR's steps: give one of them")
    milestones = values["lr_milestones"] or []
    if milestones and (milestones != sorted(set(milestones)) or milestones[-1] >= values["epochs"]):
        fail(
            f"--lr-milestones {' '.join(f'{m:g}' for m in milestones)}: give increasing epochs before the end "
            f"(--epochs {values['epochs']})"
        )


def check_data_variable(values):
    """$DLOJZ_DATA naming no folder, when the data is read (not with --data-root or --synthetic): one line."""
    if not values["data_root"] and not values["synthetic"] and (problem := missing_data_variable(os.environ)):
        fail(problem)


def checked_values(argv=None) -> dict:
    """The flags' values of a command line once parsed and checked (the parser exits 2 with its one line; the checks
    raise UserError): what dlojz.py checks first, and dlojz_lab.py for each run of a sweep."""
    parser = get_args_parser()
    values = vars(parser.parse_args(argv))
    try:
        check_flags(values)
    except UserError as err:
        raise UserError(parser.from_recipe(str(err), argv)) from None
    check_data_variable(values)
    return values


def check_command_line(argv=None):
    """dlojz.py's first step, before torch is imported: `--help`, a mistyped flag, a value out of its bounds, flags
    that do not go together or a half-set launch environment end here in one line (exit status 2). Returns nothing:
    main() parses again."""
    import sys

    from dlojz_lib.checks import say_refusal
    from dlojz_lib.settings.launch import launch_problem, launch_rank, launch_world_size

    if (problem := launch_problem(os.environ)) is not None:
        print(f"dlojz: error: {problem}", file=sys.stderr, flush=True)  # every copy: which rank it is is unknown
        sys.exit(2)
    try:
        checked_values(argv)
    except UserError as err:
        # every rank reads the same command line: rank 0 says it, unless the launcher ended the job first
        say_refusal(f"dlojz: error: {err}", launch_rank(os.environ), launch_world_size(os.environ))
        sys.exit(2)
