"""dlojz's command line: the flags (`get_args_parser`), each with its bounds beside it (`Number`), and recipe files
read first (`--config FILE.toml`, several merged in order: `OneLineParser`, over dlojz_lib/settings/recipe.py). No
torch, no file but the recipe read: a mistyped flag or a value out of bounds is one line in a fraction of a second,
before torch is imported. The flags taken together are dlojz_lib/settings/flag_checks.py's (`check_flags`, and
dlojz.py's first step, `check_command_line`), the layout flags' dlojz_lib/settings/layout.py's; what needs the
machine (the device, libraries, output paths) is dlojz_lib/settings/config.py's.
"""

import argparse
import math
import sys

from dlojz_lib.checks import OneLineArgumentParser
from dlojz_lib.optim import OPTIMIZER_TABLE, SCHEDULERS
from dlojz_lib.settings.recipe import read_recipe

# The accepted values of --optimizer (dlojz_lib.optim's table, torch-free; --lr-scheduler's: SCHEDULERS there).
OPTIMIZERS = tuple(OPTIMIZER_TABLE)
FUSED = tuple(name for name, row in OPTIMIZER_TABLE.items() if row.fused)  # with a fused step in torch
FROM_TIMM = tuple(name for name, row in OPTIMIZER_TABLE.items() if row.source.startswith("timm."))
# The validation figures a run's best checkpoint, a study's objective and the lab's best run are chosen by:
# the name a flag takes -> (its key in the metrics JSON and --val-history, its name in a sentence).
VALIDATION_METRICS = {
    "top1": ("val_accuracy", "top-1"),
    "balanced_accuracy": ("val_balanced_accuracy", "balanced accuracy"),
    "macro_f1": ("val_macro_f1", "macro-F1"),
}


INT_LIMIT = 2**31 - 1  # a count (of epochs, steps, images) beyond it is a typo, and its products overflow int64
FLOAT_LIMIT = 1e30  # a finite float beyond it is a typo (1e308 epochs overflow a step count); timeouts: TIMEOUT_LIMIT_S
TIMEOUT_LIMIT_S = 365 * 24 * 3600.0  # a year: beyond it a timeout is a typo (timedelta overflows near 1e14 s)


class Number:
    """A flag's type and bounds, given beside the flag: argparse checks them as it reads the value (a recipe file's
    reader too), so `-b 0` or `--lr inf` is one line naming the flag before torch is imported. `low`/`high` are
    included unless `low_open`/`high_open`; NaN and the infinities are refused."""

    def __init__(self, kind, low=None, high=None, *, low_open=False, high_open=False):
        self.kind, self.low, self.high, self.low_open, self.high_open = kind, low, high, low_open, high_open
        self.__name__ = kind.__name__  # argparse names the type in its own messages

    def describe(self):
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low}"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {self.high}"
        return f"in {'(' if self.low_open else '['}{self.low}, {self.high}{')' if self.high_open else ']'}"

    def check(self, value):
        """`value` itself when within bounds, else argparse.ArgumentTypeError saying what to give."""

        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number {self.describe()} (got {value})")
        below = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        above = self.high is not None and (value >= self.high if self.high_open else value > self.high)
        if below or above:
            raise argparse.ArgumentTypeError(f"must be {self.describe()} (got {value})")
        if self.kind is int and abs(value) > INT_LIMIT:  # torch keeps counts in 64-bit integers: products overflow
            raise argparse.ArgumentTypeError(f"must be at most {INT_LIMIT:,} (got {value:.3g})")
        if abs(value) > FLOAT_LIMIT:
            raise argparse.ArgumentTypeError(f"must be {self.describe()}, at most {FLOAT_LIMIT:g} (got {value:g})")
        return value

    def __call__(self, text):
        try:
            value = self.kind(text)
        except ValueError:
            kind = "an integer" if self.kind is int else "a number"
            raise argparse.ArgumentTypeError(f"must be {kind} {self.describe()} (got {text!r})") from None
        return self.check(value)


# Below 8 px a ResNet's stem leaves less than a pixel; above 4096 px one image's activations fill a GPU.
PIXELS = Number(int, 8, 4096)
COUNT = Number(int, 1)  # a number of things: at least one
# --pp-schedule's schedules that hold several stages a rank (--pp-stages-per-rank)
LOOPED_SCHEDULES = ("interleaved", "zero-bubble")
WHOLE = Number(int, 0)  # a number that may be zero (workers), or a seed
NON_NEGATIVE = Number(float, 0)
POSITIVE = Number(float, 0, low_open=True)
FRACTION = Number(float, 0, 1)
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
MODES_OF_CHECKPOINTING = ("none", "full", "selective")  # --activation-checkpointing's
LR_SCALING_RULES = ("linear", "sqrt", "none")  # --lr-scaling: how the LR follows the global batch
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")  # the modes that record CUDA graphs
GRAPH_FREE_MODE = {"reduce-overhead": "default", "max-autotune": "max-autotune-no-cudagraphs"}  # the same, no graphs


def command_line(argv=None) -> set:
    """The words of the command line (`argv`, else this process's): which flags were given there, not by a recipe."""
    return set(map(str, sys.argv[1:] if argv is None else argv))


class OneLineParser(OneLineArgumentParser):
    """A bad flag is one line, as every other bad input (argparse would print the whole usage first). `--config
    FILE.toml` fills the flags' defaults from a recipe file before the command line is read: a flag given on the
    command line wins over the file, the file over the built-in defaults and the CPU/GPU profile."""

    def parse_args(self, args=None, namespace=None):
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config", action="append", default=[])
        recipe = {}
        self.recipe_files = {}  # flag's dest -> the recipe file that set it: an error about it names the file
        for config in pre.parse_known_args(args)[0].config:  # several: merged in order, a later file's key wins
            keys = read_recipe(self, config)
            recipe.update(keys)
            self.recipe_files.update(dict.fromkeys(keys, config))
        self.set_defaults(**recipe)
        namespace = super().parse_args(args, namespace)
        given = command_line(args)
        if getattr(namespace, "warmup_epochs", None) == 0 and "--warmup-epochs" in given:
            # no warm-up asked for on the command line: a recipe's warm-up shape goes with it
            for dest in ("warmup_start_factor", "warmup_method"):
                if dest in self.recipe_files and f"--{dest.replace('_', '-')}" not in given:
                    setattr(namespace, dest, None)
        if "--no-global-batch" in given and "--lr-scaling" not in given:  # a recipe's LR rule goes with its batch
            namespace.lr_scaling = None
        return namespace

    def from_recipe(self, message, argv) -> str:
        """`message` (a check's error) with the recipe file named when a flag it names was set there, not on the
        command line: the user then knows where to change it."""
        import re

        given = command_line(argv)
        for dest, config in getattr(self, "recipe_files", {}).items():
            flag = "--" + dest.replace("_", "-")
            if re.search(re.escape(flag) + r"(?![\w-])", message) and flag not in given:
                return f"{message} ({flag} is set by --config {config}: change it there, or give it here)"
        return message

    def add_argument_group(self, *args, **kwargs):
        group = FlagGroup(self, *args, **kwargs)
        self._action_groups.append(group)
        return group


class FlagGroup(argparse._ArgumentGroup):
    """A --help group whose flag rows take one more keyword: `clearable=True` marks a flag whose value turns a
    feature on (None: off), which gets a hidden --no-FLAG that clears a recipe's value."""

    def add_argument(self, *args, clearable=False, **kwargs):
        action = super().add_argument(*args, **kwargs)
        action.clearable = clearable
        return action


# The dests of the flags that name a file or a folder (--resume's unless `auto`): none may be empty, and a run records
# them absolute
PATH_FLAGS = ("data_root", "output_dir", "initial_checkpoint", "teacher", "metrics_json", "val_history", "resume")


def turns_a_feature_on(action) -> bool:
    """Whether a row of the flag table is a feature its value turns on: a flag that takes a value, off (None) by
    default, its help giving no default that fills None in (a profile's, one worked out from other flags)."""
    switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction))
    named = action.option_strings and action.option_strings[-1].startswith("--")
    said = (action.help or "").replace("\n", " ")
    filled = ("default" in said and "default: off" not in said) or action.dest in ("help", "config")
    return bool(named) and not switch and action.default is None and not filled and action.help != argparse.SUPPRESS


def clearable_flags(parser) -> list:
    """The dests of the flags with a --no- form: the rows marked `clearable`, and those that turn a feature on."""
    return [action.dest for action in parser._actions if getattr(action, "clearable", False)]


def built_in_defaults(parser, prefix) -> dict:
    """{dest: default} of the flags whose dest starts with `prefix` (e.g. the --dali-* flags), as their rows give
    them: from a parser no recipe has set defaults on."""
    return {
        action.dest: action.default
        for action in parser._actions
        if action.dest.startswith(prefix) and action.help != argparse.SUPPRESS
    }


def flag_like(parser, flag, **changes):
    """dlojz.py's `flag` added to another command's `parser` (a bench's) from its row in the flag table: its type and
    bounds, choices, default and kind of switch, as dlojz.py takes them; `changes` (a default, the help) are that
    command's own."""
    row = next(action for action in get_args_parser()._actions if flag in action.option_strings)
    if isinstance(row, argparse.BooleanOptionalAction):
        options = dict(action=argparse.BooleanOptionalAction)
    elif isinstance(row, argparse._StoreTrueAction):
        options = dict(action="store_true")
    else:
        options = dict(type=row.type, choices=row.choices, nargs=row.nargs, metavar=row.metavar)
    return parser.add_argument(flag, **options, **dict(dict(default=row.default, help=row.help), **changes))


def get_args_parser():
    # One flat list, grouped as --help shows it: split into functions, the flags would be harder to find.
    parser = OneLineParser(
        prog="dlojz",
        description="dlojz: ResNet-50 / ImageNet training, optimised flag by flag",
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument(
        "--config",
        action="append",
        default=None,
        metavar="FILE.toml",
        help="recipe file: one key per flag (lr = 0.5, label-smoothing = 0.1);\na flag given on the command line "
        "wins; several --config files merge in order (a later file's key wins);\n--no-FLAG turns off what a "
        "recipe turned on (--no-blurpool, --no-randaugment,\n--no-lr-milestones, ...)",
    )
    p = parser.add_argument_group("training")
    p.add_argument(
        "-b", "--batch-size", type=COUNT, default=None, help="batch size per process (default: 128; CPU profile: 32)"
    )
    p.add_argument("-e", "--epochs", type=COUNT, default=1, help="number of epochs (default: 1)")
    p.add_argument(
        "--image-size", type=PIXELS, default=None, help="training crop size in px (default: 224; CPU profile: 64)"
    )
    p.add_argument("--lr", type=POSITIVE, default=None, help="peak learning rate (default: 0.1; CPU profile: 0.025)")
    p.add_argument("--wd", type=NON_NEGATIVE, default=0.0, help="weight decay (default: 0.)")
    p.add_argument("--mom", type=Number(float, 0, 1, high_open=True), default=0.9, help="momentum (default: 0.9)")
    p.add_argument(
        "--label-smoothing",
        type=Number(float, 0, 1, high_open=True),
        default=0.1,
        help="label smoothing of the loss (default: 0.1)",
    )
    p.add_argument(
        "--bce-loss",
        action=argparse.BooleanOptionalAction,
        default=False,
        help='training loss: binary cross-entropy per class (timm\'s, as in "ResNet strikes back"), with\n'
        "--label-smoothing and MixUp/CutMix targets as timm gives them; validation's loss stays cross-entropy",
    )
    p.add_argument(
        "--bce-target-thresh",
        type=Number(float, 0, 1, high_open=True),
        default=None,
        metavar="T",
        help="--bce-loss: targets above T become 1, the others 0 (timm's --bce-target-thresh)",
        clearable=True,
    )
    p.add_argument(
        "--class-weights",
        choices=("balanced",),
        default=None,
        help="balanced: the training loss weighs each class by the inverse of its share of the training images\n"
        "(images / (classes x its images), as scikit-learn's); validation's loss stays unweighted",
        clearable=True,
    )
    p.add_argument(
        "--ra-reps",
        type=Number(int, 2, 16),
        default=None,
        metavar="N",
        help="repeated augmentation: each epoch shows 1/N of the images N times, each copy augmented on its own\n"
        "and on another rank (torchvision's --ra-sampler --ra-reps; the same steps per epoch)",
        clearable=True,
    )
    p.add_argument(
        "--balanced-sampler",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="each training epoch draws every class equally often (a rare class's images repeated, a large\n"
        "class's in part), as many draws as there are training images: the same steps per epoch",
    )
    p.add_argument(
        "--arch",
        default="resnet50",
        help="any torchvision classification model name, or timm:NAME\nfor any timm model (default: resnet50)",
    )
    p.add_argument(
        "--seed", type=Number(int, 0, 2**31 - 1), default=123, help="random seed, 0 to 2,147,483,647 (default: 123)"
    )
    p.add_argument(
        "--deterministic",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="deterministic kernels only (torch.use_deterministic_algorithms, cuDNN autotuning off): the same\n"
        "weights from the same run on the same machine and software, with slower kernels",
    )
    p.add_argument(
        "--blurpool",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="anti-aliased downsampling: blur before strided convolutions and max-pools",
    )
    p.add_argument(
        "--blurpool-maxpool",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--blurpool also blurs the strided max-pools (Composer's, the default); --no-blurpool-maxpool: the\n"
        "strided convolutions only, as FFCV's apply_blurpool",
    )
    p.add_argument(
        "--zero-init-residual",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="last BatchNorm scale of each residual block at 0: each block starts as the identity (default: on for "
        "the models that take it, torchvision's ResNet, ResNeXt and Wide ResNet)",
    )
    p.add_argument(
        "--clip-grad-norm",
        type=POSITIVE,
        default=None,
        metavar="X",
        help="clip the gradients' global norm to X (after unscaling)",
        clearable=True,
    )
    p.add_argument(
        "--pretrained",
        nargs="?",
        const="DEFAULT",
        default=None,
        metavar="WEIGHTS",
        help="start from the published weights of --arch (bare: its DEFAULT; else torchvision's name such as\n"
        "IMAGENET1K_V2, or timm's tag such as a1_in1k), read from the local cache only (torch hub's, Hugging\n"
        "Face's: never downloaded by a run; see --fetch-weights), new head as below",
        clearable=True,
    )
    p.add_argument(
        "--fetch-weights",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="where the internet is (a login node): download --pretrained's file into its local cache, check\n"
        "it against its published SHA-256, and exit",
    )
    p.add_argument(
        "--initial-checkpoint",
        default=None,
        metavar="PATH",
        help="start from these weights (a torchvision/timm state dict .pt/.pth, a .safetensors file, or a dlojz\n"
        "checkpoint's model), with a new head where the number of classes differs; a fresh optimizer, schedule and\n"
        "epoch count, unlike --resume (which wins when it finds a checkpoint)",
        clearable=True,
    )
    p.add_argument(
        "--freeze-backbone-epochs",
        type=COUNT,
        default=None,
        metavar="N",
        help="fine-tuning: the head alone learns for the first N epochs (the other parameters' gradients are\n"
        "dropped before each optimizer step), then every layer",
        clearable=True,
    )
    p.add_argument(
        "--teacher",
        default=None,
        metavar="CKPT|NAME",
        help="knowledge distillation: a dlojz checkpoint (or a run's folder), or torchvision's NAME or\n"
        "timm:NAME with its published DEFAULT weights from the offline cache, whose logits join the loss",
    )
    p.add_argument(
        "--distill-alpha",
        type=Number(float, 0, 1),
        default=0.5,
        metavar="A",
        help="--teacher: loss = (1 - A) x the labels' + A x T^2 x KL(teacher || student) (default: 0.5)",
    )
    p.add_argument(
        "--distill-temperature",
        type=POSITIVE,
        default=1.0,
        metavar="T",
        help="--teacher: the softmax temperature of both models in the distillation term (default: 1)",
    )
    p.add_argument(
        "--linear-probe",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the head alone learns for the whole run, on the frozen backbone's features (eval mode, no\n"
        "backward through it): the standard evaluation of a pretrained backbone",
    )
    p.add_argument(
        "--layer-decay",
        type=Number(float, 0, 1, low_open=True),
        default=None,
        metavar="F",
        help="fine-tuning: each block's learning rate is F times the next one's, from the head (x1) down to the\n"
        "stem (as timm's --layer-decay); blocks: timm's grouping, or each block of a torchvision model's stages",
        clearable=True,
    )
    p.add_argument(
        "--drop-path",
        type=FRACTION,
        default=None,
        metavar="R",
        help="stochastic depth rate, for models that have it (timm's drop_path_rate, torchvision's\n"
        "stochastic_depth_prob); default: the model's own (0 in timm, 0.1-0.5 in torchvision's ConvNeXt, Swin...)",
        clearable=True,
    )

    p = parser.add_argument_group("optimizer and schedule (dlojz_lib/optim/)")
    p.add_argument("--optimizer", default="sgd", choices=OPTIMIZERS, help="momentum/beta1 from --mom (default: sgd)")
    p.add_argument("--no-wd-norm-bias", action="store_true", help="no weight decay on norm layers and biases")
    for kind, what in (
        ("norm", "norm layers' weights and biases (torchvision's --norm-weight-decay)"),
        ("bias", "the other layers' biases (torchvision's --bias-weight-decay)"),
        ("embedding", "class tokens, position embeddings and timm's no_weight_decay() parameters\n"
         "(torchvision's --transformer-embedding-decay)"),
    ):  # fmt: skip
        p.add_argument(
            f"--{kind}-wd",
            type=NON_NEGATIVE,
            default=None,
            metavar="WD",
            help=f"weight decay of {what}; default: --wd (0 for norms and biases with --no-wd-norm-bias)",
            clearable=True,
        )
    p.add_argument(
        "--nesterov",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="sgd: Nesterov momentum (torchvision's --opt sgd_nesterov)",
    )
    p.add_argument(
        "--lr-scheduler",
        default="onecycle",
        choices=SCHEDULERS,
        help="stepped every optimizer step (default: onecycle)",
    )
    p.add_argument(
        "--warmup-epochs",
        type=NON_NEGATIVE,
        default=0.0,
        help="linear warm-up for cosine/step/constant/poly (default: 0)",
    )
    p.add_argument(
        "--warmup-start-factor",
        type=Number(float, 0, 1, high_open=True),
        default=None,
        metavar="F",
        help="the warm-up starts at F x --lr (torchvision's --lr-warmup-decay; default: 0)",
        clearable=True,
    )
    p.add_argument(
        "--warmup-method",
        choices=("linear", "constant"),
        default=None,
        help="linear: from --warmup-start-factor to 1 (default); constant: at it throughout the warm-up",
        clearable=True,
    )
    p.add_argument(
        "--min-lr",
        type=NON_NEGATIVE,
        default=None,
        help="cosine, linear, poly: the LR they decay to instead of 0 (torchvision's --lr-min, timm's --min-lr)",
        clearable=True,
    )
    p.add_argument(
        "--lr-per-epoch",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the LR (warm-up and decay) changes once per epoch, as torchvision's and timm's schedules step it\n"
        "(default: every optimizer step, smoother for short runs); not with onecycle",
    )
    p.add_argument(
        "--lr-step-size",
        type=COUNT,
        default=None,
        metavar="EPOCHS",
        help="step: multiply the LR by --lr-gamma every EPOCHS epochs (torchvision's StepLR)",
        clearable=True,
    )
    p.add_argument(
        "--lr-milestones",
        type=POSITIVE,
        nargs="+",
        default=None,
        metavar="EPOCH",
        help="step: multiply the LR by --lr-gamma at these epochs (MultiStepLR; default: 30, 60, 90 %% of the run)",
        clearable=True,
    )
    p.add_argument(
        "--lr-gamma",
        type=Number(float, 0, 1, low_open=True),
        default=None,
        help="step: the factor of each milestone (default: 0.1)",
        clearable=True,
    )
    p.add_argument(
        "--lr-peak-epoch", type=NON_NEGATIVE, default=2.0, help="linear: epoch of the peak, as FFCV's (default: 2)"
    )
    p.add_argument(
        "--lr-poly-power", type=POSITIVE, default=2.0, help="poly: power of the decay, as MLPerf's (default: 2)"
    )
    p.add_argument(
        "--findlr",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="LR range test: exponential sweep from 1e-8 to --lr over the run, no validation;\n"
        "writes findlr.csv and findlr.png, prints a suggested lr",
    )

    p = parser.add_argument_group("memory and speed")
    p.add_argument(
        "--grad-acc",
        type=COUNT,
        default=1,
        help="accumulate gradients over N micro-batches per optimizer step (default: 1)",
    )
    p.add_argument(
        "--keep-global-batch",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="resuming on another number of ranks: keep the checkpoint's global batch (hence its steps and LR\n"
        "schedule) by changing --grad-acc, where ranks x --batch-size divides it (the Slurm scripts' restarts)",
    )
    p.add_argument(
        "--global-batch",
        type=COUNT,
        default=None,
        help="images per optimizer step, kept on any number of ranks (a recipe's published global batch):\n"
        "--batch-size becomes the most a rank holds at once, and each rank's batch and --grad-acc are chosen\n"
        "at start-up (said in one block); --lr is the one for this global batch",
        clearable=True,
    )
    p.add_argument(
        "--lr-scaling",
        choices=LR_SCALING_RULES,
        default=None,
        help="with --global-batch: how --lr and --min-lr follow where the ranks cannot make that global batch\n"
        "exactly (the nearest is taken): linear (default), sqrt (the Adam/LAMB family's), none",
    )
    p.add_argument(
        "--grad-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="recompute activations of the model's stages in the backward (--activation-checkpointing full,\n"
        "unless it says selective)",
    )
    p.add_argument(
        "--activation-checkpointing",
        choices=MODES_OF_CHECKPOINTING,
        default=None,
        metavar="MODE",
        help="what the backward recomputes instead of keeping: none; full (each stage's forward, or each block's,\n"
        "as --grad-checkpointing); selective (each block keeps its matrix products', convolutions' and attentions'\n"
        "outputs and recomputes the cheap ops: norms, activations, additions; torchtitan's op-level policy)\n"
        "(default: none, or full with --grad-checkpointing)",
    )
    p.add_argument(
        "--ac-every",
        type=COUNT,
        default=1,
        metavar="N",
        help="--activation-checkpointing: only every N-th block recomputes (the 1st, the N+1-th...), the others keep\n"
        "their activations: memory traded for less recomputation (torchtitan's by layer; default: 1, every block)",
    )
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="torch.compile the model (compilation shows as the time to the first step); under --fsdp, --tp and\n"
        "--pp each block alone (fullgraph), the parallel hooks around the graphs eager, as torchtitan",
    )
    p.add_argument(
        "--compile-mode",
        choices=COMPILE_MODES,
        default=None,
        help="torch.compile's mode (implies --compile; default: default).\nreduce-overhead: the model's "
        "forward and backward replayed as\nCUDA graphs (static shapes: --drop-last, one resolution);\nmax-autotune: "
        "the fastest kernels found by trying them, and\nCUDA graphs (minutes of compilation); "
        "max-autotune-no-cudagraphs",
        clearable=True,
    )
    p.add_argument(
        "--sync-bn", action=argparse.BooleanOptionalAction, default=False, help="synchronised BatchNorm across ranks"
    )
    p.add_argument(
        "--model-ema",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep an exponential moving average of the weights, validated alongside",
    )
    p.add_argument(
        "--model-ema-decay",
        type=Number(float, 0, 1, low_open=True, high_open=True),
        default=0.9998,
        help="EMA decay per update (default: 0.9998)",
    )
    p.add_argument(
        "--model-ema-steps",
        type=COUNT,
        default=None,
        metavar="N",
        help="update the EMA every N optimizer steps (torchvision's --model-ema-steps; default: 1)",
        clearable=True,
    )
    p.add_argument(
        "--model-ema-warmup",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the EMA's decay grows as min(decay, (1 + u) / (10 + u)) over its first updates u (timm's)",
    )
    p.add_argument(
        "--ema-judges",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with --model-ema: the EMA's validation chooses `best` (--best-metric) and reaches --target-accuracy,\n"
        "as torchvision's published figures are the EMA weights'",
    )
    p.add_argument(
        "--model-ema-warmup-copy",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="during the LR's warm-up the EMA copies the weights at each update, averaging from its end\n"
        "(torchvision's train.py resets it there)",
    )
    p.add_argument(
        "--model-ema-adjust",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="torchvision's rule: the decay per update is 1 - (1 - --model-ema-decay) x global batch x\n"
        "--model-ema-steps / --epochs, computed at start-up from the GPUs the job has (its recipes give 0.99998)",
    )

    p = parser.add_argument_group("augmentation")
    p.add_argument(
        "--randaugment",
        type=Number(int, 0, 30),  # torchvision's magnitude bins: 0..30; more than 30 ops per image is no augmentation
        nargs=2,
        metavar=("N", "M"),
        default=None,
        help="RandAugment with N ops of magnitude M (torchvision's 0-30 scale: timm's m on its 0-10 scale x 3)",
        clearable=True,
    )
    p.add_argument(
        "--randaugment-mstd",
        type=Number(float, 0, 30),
        default=None,
        metavar="STD",
        help="--randaugment: each op's magnitude drawn from a normal law around M with this standard deviation,\n"
        "on the same 0-30 scale (timm's mstd x 3: its rand-m6-mstd0.5 is --randaugment 2 18 --randaugment-mstd 1.5)",
        clearable=True,
    )
    p.add_argument("--trivialaugment", action=argparse.BooleanOptionalAction, default=False, help="TrivialAugmentWide")
    p.add_argument(
        "--autoaugment",
        choices=("imagenet", "cifar10", "svhn"),
        default=None,
        metavar="POLICY",
        help="AutoAugment with the policy learnt on imagenet, cifar10 or svhn (torchvision's --auto-augment)",
        clearable=True,
    )
    p.add_argument(
        "--augmix",
        type=Number(int, 1, 10),
        default=None,
        metavar="SEVERITY",
        help="AugMix at this severity, 1-10 (torchvision's --auto-augment augmix: 3)",
        clearable=True,
    )
    p.add_argument(
        "--timm-augment",
        default=None,
        metavar="CONFIG",
        help="timm's own augmentation from its config string (timm's --aa), as timm's train.py builds it:\n"
        "rand-m7-mstd0.5-inc1 (RandAugment: each op with probability 0.5, the data set's mean as fill, random\n"
        "bilinear or bicubic), augmix-m5-w3, original or v0 (AutoAugment)",
        clearable=True,
    )
    p.add_argument(
        "--random-erase",
        type=Number(float, 0, 1),
        default=0.0,
        metavar="P",
        help="RandomErasing probability (default: 0)",
    )
    p.add_argument("--mixup-alpha", type=NON_NEGATIVE, default=0.0, help="batch-level MixUp alpha (default: 0 = off)")
    p.add_argument("--cutmix-alpha", type=NON_NEGATIVE, default=0.0, help="batch-level CutMix alpha (default: 0 = off)")

    p = parser.add_argument_group("validation and time to accuracy")
    p.add_argument(
        "--val-every", type=COUNT, default=1, metavar="N", help="validate every N epochs; the last always (default: 1)"
    )
    p.add_argument(
        "--target-accuracy",
        type=Number(float, 0, 1, low_open=True),
        default=None,
        metavar="A",
        help="stop at the first validation with top-1 >= A (0-1);\n"
        "the metrics JSON gets time_to_target_s and epochs_to_target",
        clearable=True,
    )
    p.add_argument(
        "--tta-flip",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="validation averages the logits of each image and its mirror",
    )
    p.add_argument(
        "--min-res",
        type=PIXELS,
        default=None,
        help="progressive resizing (FFCV's): training resolution in px up to --start-ramp",
        clearable=True,
    )
    p.add_argument(
        "--max-res",
        type=PIXELS,
        default=None,
        help="progressive resizing: training resolution in px from --end-ramp",
        clearable=True,
    )
    p.add_argument(
        "--start-ramp",
        type=Number(int, 0),
        default=0,
        help="progressive resizing: epoch (from 0) the ramp starts (default: 0)",
    )
    p.add_argument(
        "--end-ramp", type=Number(int, 0), default=0, help="progressive resizing: epoch (from 0) the ramp ends"
    )
    p.add_argument(
        "--res-step",
        type=Number(int, 1, 512),
        default=32,
        help="progressive resizing: resolutions are multiples of it (default: 32)",
    )

    p = parser.add_argument_group("profiler (torch.profiler)")
    p.add_argument(
        "--prof",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="profile a few steps; traces in <output-dir>/profiler (TensorBoard, Perfetto)",
    )
    p.add_argument("--prof-wait", type=Number(int, 0), default=1, help="steps skipped before profiling (default: 1)")
    p.add_argument("--prof-warmup", type=Number(int, 0), default=1, help="profiled steps thrown away (default: 1)")
    p.add_argument("--prof-active", type=COUNT, default=3, help="profiled steps recorded (default: 3)")

    p = parser.add_argument_group("modes")
    p.add_argument(
        "--test",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="benchmark: stop after --test-nsteps steps, validate on 20 batches,\n"
        "no W&B, no checkpoint, chronometer report",
    )
    p.add_argument("--test-nsteps", type=COUNT, default=50, help="steps in --test mode (default: 50)")
    p.add_argument(
        "--test-unsync-steps",
        type=Number(int, 0),
        default=None,
        help="the last steps of --test, timed as a whole without the\nchronometer's waits (the figure to compare "
        "with MLPerf's;\ndefault: half of --test-nsteps from 20 steps, else 0)",
    )
    p.add_argument(
        "--synthetic",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="random tensors made once in memory: no disk, no decoding",
    )
    p.add_argument(
        "--eval-only",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="validate the checkpoint given by --resume and stop",
    )
    p.add_argument(
        "--eval-ema",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with --eval-only: validate the checkpoint's EMA weights (a run with --model-ema) instead of its model",
    )
    p.add_argument(
        "--tensorboard",
        nargs="?",
        const="",
        default=None,
        clearable=True,
        metavar="DIR",
        help="also log W&B's scalars as TensorBoard event files (torch's SummaryWriter), rank 0: in DIR\n"
        "(default: the output folder's tensorboard/); a resumed run appends there",
    )
    p.add_argument(
        "--predictions",
        default=None,
        metavar="FILE.csv",
        help="with --eval-only: one row per validation image: its file, true and predicted class, and the\n"
        "top-5 classes with their probabilities",
    )
    p.add_argument(
        "--loader-only",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="time the training DataLoader alone (no model) over\n"
        "--test-nsteps batches: images/s overall and per worker",
    )

    p = parser.add_argument_group("data")
    p.add_argument(
        "--data-root",
        default=None,
        help="folder with train/ and val/ (ImageNet or ImageFolder layout);\n"
        "default: $DLOJZ_DATA, $ALL_CCFRSCRATCH/imagenet, $DSDIR/imagenet,\nelse the embedded data set",
    )
    p.add_argument(
        "--val-resize-size",
        type=PIXELS,
        default=None,
        help="validation resize of the shorter side in px (default: 256; CPU profile: 73)",
    )
    p.add_argument(
        "--val-crop-size",
        type=PIXELS,
        default=None,
        help="validation center crop in px (default: 224; CPU profile: 64)",
    )
    p.add_argument(
        "--val-interpolation",
        choices=("bilinear", "bicubic"),
        default="bilinear",
        help="validation resize filter (PIL's, antialiased): bilinear (torchvision's reference, default) or\n"
        "bicubic (timm's evaluation)",
    )
    p.add_argument(
        "--val-split",
        type=POSITIVE,
        default=None,
        metavar="F",
        help="--data-root is one folder of classes (no val/): validate on a stratified part of it, F < 1 a\n"
        "fraction of each class, F >= 1 that many images per class; the same in every run, listed in the output\n"
        "folder's val_split.txt, which a resumed run or --eval-only of its checkpoints uses",
        clearable=True,
    )
    p.add_argument(
        "--mean",
        type=Number(float, 0, 1),
        nargs=3,
        metavar=("R", "G", "B"),
        default=None,
        help="per-channel mean the images are normalised with, in [0, 1] (default: ImageNet's; with --pretrained:\n"
        "the weights')",
        clearable=True,
    )
    p.add_argument(
        "--std",
        type=Number(float, 0, 1, low_open=True),
        nargs=3,
        metavar=("R", "G", "B"),
        default=None,
        help="per-channel standard deviation, as --mean",
        clearable=True,
    )
    p.add_argument(
        "--val-batch-size",
        type=COUNT,
        default=None,
        help="validation batch size per process (default: 256; CPU profile: 64)",
    )
    p.add_argument(
        "--data-backend",
        choices=("pytorch", "dali"),
        default="pytorch",
        help="who decodes and augments: the DataLoader's workers (default),\n"
        "or NVIDIA DALI (on the GPU; its CPU backend without one)",
    )
    p.add_argument(
        "--dali-threads",
        type=COUNT,
        default=None,
        metavar="N",
        help="DALI's CPU threads for training (default on a GPU: 6, as MLPerf's\npipelines, or --num-workers where "
        "fewer; on the CPU: --num-workers);\nvalidation's pipeline takes 3 of them at most",
    )
    p.add_argument(
        "--dali-prefetch",
        type=COUNT,
        default=3,
        metavar="N",
        help="batches DALI prepares ahead, across epoch boundaries (default: 3)",
    )
    p.add_argument(
        "--dali-hw-decoder-load",
        type=FRACTION,
        default=None,
        metavar="F",
        help="share of the JPEGs for the A100/H100 hardware decoder,\nthe rest for nvJPEG's CPU+GPU decoding "
        "(default: 0.99, as MLPerf's H100/H200 pipelines)",
    )
    p.add_argument(
        "--dali-decode",
        choices=("roi", "whole"),
        default=None,
        help="training decode: roi decodes the random crop's region only (default),\nwhole decodes the image then "
        "crops (the way around a region-decoding\nfault; what --dali-cache needs)",
    )
    p.add_argument(
        "--dali-cache",
        type=POSITIVE,
        default=None,
        metavar="GB",
        help="keep decoded training images in this much GPU memory (DALI's\nthreshold cache, as NVIDIA's MLPerf "
        "configuration): the images\nit holds are decoded once, not every epoch (whole decode)",
    )
    p.add_argument(
        "--dali-antialias",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="antialias DALI's training resize (default: off, as NVIDIA's DALI\nResNet-50 pipelines: the CPU "
        "backend's resize then costs half;\nvalidation's resize is antialiased either way)",
    )
    p.add_argument(
        "--dali-pad-channels",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="DALI writes 4 channels (RGB and zeros) and the stem's weight is\npadded to match (zeros): the stem's "
        "convolution on tensor cores'\nwhole channel multiples, as MLPerf's ResNet-50",
    )
    p.add_argument(
        "--train-subset",
        type=POSITIVE,
        default=None,
        metavar="F",
        help="train on a fixed part of the training set, the same\n"
        "in every run whatever --seed: F < 1 a fraction, F >= 1 images per class\n(stratified; validation stays whole)",
        clearable=True,
    )

    p = parser.add_argument_group("DataLoader")
    p.add_argument(
        "--num-workers",
        type=Number(int, 0),
        default=None,
        help="workers per process (default: CPUs per task - 1, at most 16)",
    )
    p.add_argument(
        "--persistent-workers",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="keep workers between epochs (default: on)",
    )
    p.add_argument(
        "--pin-memory",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="page-locked host buffers (default: on)",
    )
    p.add_argument(
        "--non-blocking",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="asynchronous host-to-GPU copies (default: on)",
    )
    p.add_argument(
        "--prefetch-factor",
        type=COUNT,
        default=3,
        help="batches prefetched per worker, ignored with 0 workers (default: 3)",
    )
    p.add_argument(
        "--drop-last",
        default=None,
        action=argparse.BooleanOptionalAction,
        help="drop the last incomplete batch (default: off; on with --compile)",
    )

    p = parser.add_argument_group("device and precision")
    p.add_argument(
        "--device", choices=("auto", "cuda", "cpu"), default="auto", help="(default: auto = cuda if available)"
    )
    p.add_argument(
        "--amp",
        default=None,
        action=argparse.BooleanOptionalAction,
        help="automatic mixed precision (default: on with CUDA, off on CPU)",
    )
    p.add_argument(
        "--amp-dtype",
        choices=("float16", "bfloat16"),
        default=None,
        help="AMP dtype (default: float16 on CUDA, bfloat16 on CPU)",
    )
    p.add_argument(
        "--channels-last",
        default=False,
        action=argparse.BooleanOptionalAction,
        help="NHWC memory format for model and inputs (default: off)",
    )
    p.add_argument(
        "--tf32",
        default=None,
        action=argparse.BooleanOptionalAction,
        help="TF32 matmul/cuDNN (default: on for Ampere and newer)",
    )

    p = parser.add_argument_group("distribution")
    p.add_argument(
        "--dist-timeout",
        # below 10 s, the ranks of a busy node may not all have joined the process group
        type=Number(float, 10, TIMEOUT_LIMIT_S),
        default=600,
        help="seconds before a collective waiting for a dead rank fails (default: 600; at least 10)",
    )
    p.add_argument(
        "--hang-timeout",
        type=Number(float, 0, TIMEOUT_LIMIT_S),
        default=180,
        metavar="SECONDS",
        help="with several ranks: when no rank has moved on for this long, one line names the rank that hangs\n"
        "(silent: stopped or dead; stuck: alive outside the others' collective) and the job ends with status 7\n"
        "(default: 180, above a step's time, a checkpoint's or a recompilation's; 0: off)",
    )
    p.add_argument(
        "--straggler-factor",
        type=Number(float, 0),
        default=1.5,
        metavar="F",
        help="with several ranks: a rank whose forward takes F times the others' median at 3 log points in a row\n"
        "is named once in the log and in the metrics JSON (default: 1.5; 0: off)",
    )
    p.add_argument(
        "--fsdp",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="shard parameters, gradients and optimizer state across ranks (FSDP2, dlojz_lib/parallelism/fsdp.py)\n"
        "instead of DDP's full copy on each; sharded checkpoints (torch.distributed.checkpoint)",
    )
    p.add_argument(
        "--fsdp-reshard-after-forward",
        default=None,
        action=argparse.BooleanOptionalAction,
        help="--fsdp: free each block's gathered parameters after its forward and gather them again for\n"
        "the backward (ZeRO-3, default), or keep them until the backward (ZeRO-2-like: faster, more memory);\n"
        "with --pp off by default (resharded, a block is gathered again for each micro-batch: M + 1 all-gathers\n"
        "a step instead of 1, as torchtitan): --fsdp-reshard-after-forward forces it",
    )
    p.add_argument(
        "--layout",
        default=None,
        choices=("auto",),
        help="auto: the planner's pick for this job's ranks and memory (dlojz_lab.py plan: DDP, FSDP, HSDP over\n"
        "the nodes, --tp with --fsdp, or --pp where -b and the other flags allow a pipeline; with the activation\n"
        "checkpointing it needs unless given), said in one line at start-up",
    )
    p.add_argument(
        "--fsdp-replicate",
        type=COUNT,
        default=1,
        metavar="R",
        help="--fsdp: hybrid sharding (HSDP): R copies of the model, each sharded over 1/R of the data ranks\n"
        "(R = the number of nodes: parameters gathered within a node, over its fast links; only the gradients'\n"
        "all-reduce crosses the nodes, once a step). R must divide the data ranks (default: 1, plain FSDP)",
    )
    p.add_argument(
        "--fsdp-offload",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="--fsdp: parameters, gradients and optimizer state in pinned host memory (FSDP2's CPUOffloadPolicy),\n"
        "each block's copied to the GPU for its forward and backward, the optimizer's step on the CPU: a model\n"
        "that does not fit on the GPUs otherwise, at the cost of host-device copies (GPU runs only)",
    )
    p.add_argument(
        "--float8",
        default=None,
        choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"),
        help="train the linears of the model family's blocks in float8 (torchao's float8 training, scaled per\n"
        "tensor, per row, or per row with the weight gradient in high precision; linears whose sizes are not\n"
        "multiples of 16, small ones and the head stay as they were), FSDP's all-gathers in float8 with --fsdp\n"
        "and tensorwise; a GPU of compute capability 8.9+ (H100/H200 class) to be faster, with --compile; on the\n"
        "CPU a check of the numerics, not faster (default: off)",
    )
    p.add_argument(
        "--tp",
        type=COUNT,
        default=1,
        metavar="N",
        help="tensor parallelism over groups of N ranks (with --fsdp over the rest: 2-D): each rank of a group\n"
        "holds 1/N of every transformer block's weights and heads (timm's ViT and CoAtNet/MaxViT families,\n"
        "torchvision's ViT); the group shares a batch",
    )
    p.add_argument(
        "--sequence-parallel",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="--tp: between the blocks' matrix products the tokens are split over the group too (norms,\n"
        "residuals, dropouts on 1/N of them: 1/N of those activations, the same bytes sent)",
    )
    p.add_argument(
        "--check-replicas",
        type=Number(int, 0),
        default=0,
        metavar="N",
        help="--tp: every N optimizer steps, compare a checksum of each weight the tensor peers hold whole (norms,\n"
        "embeddings, the head) across each group, and end the run in one line naming the first that differs\n"
        "(default: 0, off; their gradients are averaged over the group at every step, so they should not)",
    )

    p.add_argument(
        "--pp",
        type=COUNT,
        default=1,
        metavar="N",
        help="pipeline parallelism over groups of N ranks (with --fsdp over the rest): the model cut into N\n"
        "stages of consecutive layers (stem with the first, head and loss with the last), each batch split into\n"
        "--pp-microbatches that flow through them (timm's ViT and CoAtNet/MaxViT, torchvision's ResNets and ViT)",
    )
    p.add_argument(
        "--pp-schedule",
        default="1f1b",
        choices=("gpipe", "1f1b", *LOOPED_SCHEDULES),
        help="--pp: the order the stages run the micro-batches in: all forwards then all backwards (gpipe),\n"
        "one forward one backward (1f1b: the same bubble, activations of N micro-batches at most), or with\n"
        "--pp-stages-per-rank V stages a rank, looped (interleaved 1F1B: a bubble V times smaller, V times the\n"
        "sends; zero-bubble: each micro-batch's weights' backward run apart, in the gaps)",
    )
    p.add_argument(
        "--pp-stages-per-rank",
        type=COUNT,
        default=None,
        metavar="V",
        help="--pp-schedule interleaved or zero-bubble: stages a rank holds (rank, rank + N, ...; default 2)",
    )
    p.add_argument(
        "--pp-microbatches",
        type=COUNT,
        default=None,
        metavar="M",
        help="--pp: micro-batches a batch is split into (at least N; default 2 N): the bubble, the time a stage\n"
        "waits, is (N - 1) / (M + N - 1) of a step; -b must be a multiple of M",
    )
    p.add_argument(
        "--pp-split",
        default="params",
        metavar="params|time|I,J,...",
        help="--pp: where the stages are cut: balanced by parameters (default), by each layer's measured forward\n"
        "time, or at the given layers (where stages 2, 3... start; layer 0 is the stem)",
    )

    p = parser.add_argument_group("logging, checkpoints, resume")
    p.add_argument(
        "--output-dir",
        default=None,
        help="checkpoints, metrics, traces (default: ./runs/<job name>_<job id or timestamp>)",
    )
    p.add_argument("--metrics-json", default=None, help="write the run's final metrics to this JSON file (rank 0)")
    p.add_argument(
        "--val-history",
        default=None,
        metavar="FILE.jsonl",
        help="append one JSON line per validation to this file (rank 0)",
    )
    p.add_argument(
        "--resume", default=None, help="'auto' (newest checkpoint in --output-dir, if any) or a checkpoint path"
    )
    p.add_argument(
        "--start-over",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="train from scratch in an --output-dir that holds a run (its files are moved into\n"
        "<output-dir>/previous-<time>/); without it, such a folder needs --resume",
    )
    p.add_argument(
        "--requeue",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="on a stop signal under Slurm, requeue the job after the\n"
        "checkpoint (default: on; dlojz_hpo.py's trials: off, the worker requeues)",
    )
    p.add_argument(
        "--keep-checkpoints",
        type=Number(int, 0),
        default=3,
        help="checkpoints kept in --output-dir (default: 3; 0: all), besides the best one",
    )
    p.add_argument(
        "--best-metric",
        choices=(*VALIDATION_METRICS, "none"),
        default="top1",
        help="the validation figure that names the run's best checkpoint: --output-dir's `best` names it and\n"
        "--keep-checkpoints never deletes it (default: top1; none: no best kept); --resume DIR/best loads it",
    )
    p.add_argument(
        "--checkpoint-every",
        type=NON_NEGATIVE,
        default=None,
        metavar="MINUTES",
        help="also checkpoint mid-epoch once this many minutes have passed since the last\n"
        "checkpoint, for a node that dies without warning (0: off; default: 30 on a GPU\n"
        "with --requeue, off on the CPU)",
        clearable=True,
    )
    p.add_argument(
        "--wandb",
        default=True,
        action=argparse.BooleanOptionalAction,
        help="W&B logging on rank 0 (default: on; never in --test)",
    )
    p.add_argument(
        "--wandb-project", default="Imagenet Race Cup", help="W&B project of the run (default: 'Imagenet Race Cup')"
    )
    p.add_argument(
        "--wandb-mode",
        choices=("offline", "online", "disabled"),
        default="offline",
        help="(default: offline: never needs the network)",
    )
    p.add_argument("--wandb-group", default=None, help="W&B group of the run (dlojz_hpo.py: the study)")
    # A feature a recipe turns on, turned off again from the command line: --no-FLAG (not listed in --help: the
    # --config help says it once), for the rows marked clearable and every flag whose value turns a feature on
    # (turns_a_feature_on: read from the table).
    for action in list(parser._actions):
        action.clearable = getattr(action, "clearable", False) or turns_a_feature_on(action)
        if action.clearable:
            name = action.option_strings[-1].removeprefix("--")
            parser.add_argument(
                f"--no-{name}", dest=action.dest, action="store_const", const=None, help=argparse.SUPPRESS
            )
    return parser
