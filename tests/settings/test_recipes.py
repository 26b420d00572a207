"""Recipe files (--config FILE.toml): precedence (command line > file > defaults and profile), one-line errors
naming the file and the key, and every recipe shipped in recipes/ parses and starts."""

import argparse
import math

import pytest
from conftest import ROOT, read_json

from dlojz_lib.checks import UserError
from dlojz_lib.settings.config import resolve_config
from dlojz_lib.settings.flags import get_args_parser

RECIPES = sorted((ROOT / "recipes").glob("*.toml"))


def resolve(*flags):
    return resolve_config(get_args_parser().parse_args(["--device", "cpu", *map(str, flags)]))


def recipe(tmp_path, text):
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


def test_the_file_fills_the_flags_and_the_command_line_wins(tmp_path):
    path = recipe(
        tmp_path,
        'lr = 0.5\nlabel-smoothing = 0.2\nlr_scheduler = "linear"\ntta-flip = true\n'
        "batch-size = 64\nrandaugment = [2, 9]\nwd = 0\n",
    )
    cfg = resolve("--config", path)
    assert (cfg.lr, cfg.label_smoothing, cfg.lr_scheduler, cfg.tta_flip) == (0.5, 0.2, "linear", True)
    assert (cfg.batch_size, cfg.randaugment, cfg.wd) == (64, (2, 9), 0.0)  # the file beats the CPU profile's 32
    assert cfg.config == [str(path)]
    assert any(note.startswith(f"recipe {path}: lr=0.5") for note in cfg.notes)
    cli = resolve("--config", path, "--lr", "0.1", "--label-smoothing", "0")
    assert (cli.lr, cli.label_smoothing, cli.lr_scheduler) == (0.1, 0.0, "linear")
    assert resolve().lr == 0.025 and resolve().batch_size == 32  # without the file: the profile


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("learning-rate = 0.5\n", "key 'learning-rate', not a dlojz flag"),
        ("lr = 'fast'\n", "key 'lr' must be a number"),
        ("epochs = 1.5\n", "key 'epochs' must be an integer"),
        ("tta-flip = 1\n", "key 'tta-flip' is a switch: true or false"),
        ("optimizer = 'adam'\n", "key 'optimizer' must be one of sgd, adamw"),
        ("randaugment = 2\n", "key 'randaugment' takes a list of 2 values"),
        ("lr = 0\n", "key 'lr' must be > 0 (got 0.0)"),  # a value out of the flag's bounds
        ("randaugment = [2, 50]\n", "key 'randaugment' must be in [0, 30] (got 50)"),
        ("label-smoothing = 1.5\n", "key 'label-smoothing' must be in [0, 1) (got 1.5)"),
        ("lr = \n", "not valid TOML"),
    ],
)
def test_a_bad_recipe_is_one_line_naming_the_file_and_the_key(tmp_path, text, fragment):
    path = recipe(tmp_path, text)
    with pytest.raises(UserError) as err:
        resolve("--config", path)
    message = str(err.value)
    assert message.startswith(f"--config {path}") and fragment in message and "\n" not in message


def test_a_missing_recipe_file_is_one_line(tmp_path, run_inline):
    proc = run_inline("--config", tmp_path / "nope.toml", "--device", "cpu")
    assert proc.returncode == 2 and proc.stderr.startswith(
        f"dlojz: error: --config {tmp_path / 'nope.toml'}: no such file"
    )


@pytest.mark.parametrize("path", RECIPES, ids=[p.name for p in RECIPES])
def test_every_shipped_recipe_parses_and_starts(path, tmp_path, run_inline, tiny_data):
    """Two steps of a tiny model with each recipe: the heavy values are overridden on the command line, as a user
    trying a recipe on a laptop would (a timm model for a timm model: its stochastic depth)."""
    metrics = tmp_path / "m.json"
    proc = run_inline(
        "--config",
        path,
        "--device",
        "cpu",
        "--arch",
        "timm:resnet18" if 'arch = "timm:' in path.read_text() else "resnet18",
        "--image-size",
        "32",
        "--min-res",
        "16",
        "--max-res",
        "32",
        "--start-ramp",
        "0",
        "--end-ramp",
        "1",
        "--val-resize-size",
        "36",
        "--val-crop-size",
        "32",
        "-b",
        "4",
        "--val-batch-size",
        "4",
        "--data-root",
        tiny_data,
        "--num-workers",
        "0",
        "--test",
        "--test-nsteps",
        "2",
        "--no-global-batch",  # the published one would be one step of hundreds of micro-batches here
        "--output-dir",
        tmp_path / "run",
        "--metrics-json",
        metrics,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"recipe {path}" in proc.stdout
    result = read_json(metrics)
    assert result["steps"] == 2 and math.isfinite(result["train_loss"])  # two optimizer steps of the recipe
    assert len(RECIPES) >= 4


# The published recipes, flag by flag as their source gives them (dlojz's names; the source in each file's header).
PUBLISHED = {
    "torchvision_resnet50_v2.toml": (
        "torchvision references/classification README, ResNet-50 IMAGENET1K_V2 (80.858 %)",
        dict(
            arch="resnet50",
            zero_init_residual=False,
            epochs=600,
            batch_size=128,
            lr=0.5,
            optimizer="sgd",
            mom=0.9,
            wd=2e-5,
            lr_scheduler="cosine",
            warmup_epochs=5,
            warmup_method="linear",
            warmup_start_factor=0.01,
            label_smoothing=0.1,
            mixup_alpha=0.2,
            cutmix_alpha=1.0,
            trivialaugment=True,
            random_erase=0.1,
            ra_reps=4,
            model_ema=True,
            model_ema_steps=32,
            model_ema_decay=0.99998,
            model_ema_adjust=True,
            ema_judges=True,
            model_ema_warmup_copy=True,
            image_size=176,
            val_resize_size=232,
            val_crop_size=224,
            norm_wd=0.0,
        ),
    ),
    "torchvision_mobilenet_v3_large.toml": (
        "torchvision references/classification README, MobileNetV3-Large IMAGENET1K_V1 (74.042 %)",
        dict(
            arch="mobilenet_v3_large",
            epochs=600,
            batch_size=128,
            lr=0.064,
            optimizer="rmsprop",
            mom=0.9,
            wd=1e-5,
            lr_scheduler="step",
            lr_step_size=2,
            lr_gamma=0.973,
            label_smoothing=0.0,
            autoaugment="imagenet",
            random_erase=0.2,
            image_size=224,
            val_resize_size=256,
            val_crop_size=224,
        ),
    ),
    "torchvision_convnext_tiny.toml": (
        "torchvision references/classification README, ConvNeXt-Tiny IMAGENET1K_V1 (82.520 %)",
        dict(
            arch="convnext_tiny",
            epochs=600,
            batch_size=128,
            optimizer="adamw",
            lr=1e-3,
            wd=0.05,
            norm_wd=0.0,
            lr_scheduler="cosine",
            warmup_epochs=5,
            warmup_method="linear",
            warmup_start_factor=0.01,
            label_smoothing=0.1,
            mixup_alpha=0.2,
            cutmix_alpha=1.0,
            trivialaugment=True,
            random_erase=0.1,
            ra_reps=4,
            model_ema=True,
            model_ema_steps=32,
            model_ema_decay=0.99998,
            model_ema_adjust=True,
            ema_judges=True,
            model_ema_warmup_copy=True,
            image_size=176,
            val_resize_size=236,
        ),
    ),
    "torchvision_vit_b_16.toml": (
        "torchvision references/classification README, ViT-B/16 IMAGENET1K_V1 (81.072 %)",
        dict(
            arch="vit_b_16",
            epochs=300,
            batch_size=512,
            optimizer="adamw",
            lr=0.003,
            wd=0.3,
            lr_scheduler="cosine",
            warmup_epochs=30,
            warmup_method="linear",
            warmup_start_factor=0.033,
            label_smoothing=0.11,
            mixup_alpha=0.2,
            cutmix_alpha=1.0,
            randaugment=[2, 9],
            clip_grad_norm=1.0,
            ra_reps=3,
            model_ema=True,
            model_ema_steps=32,
            model_ema_decay=0.99998,
            model_ema_adjust=True,
            ema_judges=True,
            model_ema_warmup_copy=True,
        ),
    ),
    "torchvision_efficientnet_v2_s.toml": (
        "torchvision references/classification README, EfficientNet-V2-S IMAGENET1K_V1 (84.228 %)",
        dict(
            arch="efficientnet_v2_s",
            epochs=600,
            batch_size=128,
            lr=0.5,
            wd=2e-5,
            norm_wd=0.0,
            lr_scheduler="cosine",
            warmup_epochs=5,
            warmup_method="linear",
            warmup_start_factor=0.01,
            label_smoothing=0.1,
            mixup_alpha=0.2,
            cutmix_alpha=1.0,
            trivialaugment=True,
            random_erase=0.1,
            ra_reps=4,
            model_ema=True,
            model_ema_steps=32,
            model_ema_decay=0.99998,
            model_ema_adjust=True,
            ema_judges=True,
            model_ema_warmup_copy=True,
            image_size=300,
            val_resize_size=384,
            val_crop_size=384,
        ),
    ),
    "torchvision_regnet_x_400mf.toml": (
        "torchvision references/classification README, RegNetX-400MF IMAGENET1K_V1 (72.834 %)",
        dict(
            arch="regnet_x_400mf",
            epochs=100,
            batch_size=128,
            wd=5e-5,
            lr=0.8,
            lr_scheduler="cosine",
            warmup_epochs=5,
            warmup_method="linear",
            warmup_start_factor=0.1,
            label_smoothing=0.0,
        ),
    ),
    "timm_rsb_a3_resnet50.toml": (
        "ResNet strikes back, table 1, A3 (78.1 %)",
        dict(
            arch="resnet50",
            epochs=100,
            batch_size=256,
            optimizer="lamb",
            lr=8e-3,
            wd=0.02,
            no_wd_norm_bias=True,
            lr_scheduler="cosine",
            warmup_epochs=5,
            bce_loss=True,
            bce_target_thresh=0.2,
            label_smoothing=0.0,
            mixup_alpha=0.1,
            cutmix_alpha=1.0,
            timm_augment="rand-m6-mstd0.5-inc1",
            image_size=160,
            val_resize_size=235,  # timm's floor(224 / 0.95)
            val_interpolation="bicubic",
            val_crop_size=224,
        ),
    ),
}
RSB_A1_A2 = dict(  # table 1's common values of A1 and A2, on timm's resnet50 (stochastic depth)
    arch="timm:resnet50",
    batch_size=256,
    optimizer="lamb",
    lr=5e-3,
    no_wd_norm_bias=True,
    lr_scheduler="cosine",
    warmup_epochs=5,
    bce_loss=True,
    bce_target_thresh=0.2,
    cutmix_alpha=1.0,
    timm_augment="rand-m7-mstd0.5-inc1",
    drop_path=0.05,
    ra_reps=3,
    image_size=224,
    val_resize_size=235,  # timm's floor(224 / 0.95)
    val_interpolation="bicubic",
    val_crop_size=224,
)
PUBLISHED["timm_rsb_a1_resnet50.toml"] = (
    "ResNet strikes back, table 1, A1 (80.4 %)",
    dict(RSB_A1_A2, epochs=600, wd=0.01, label_smoothing=0.1, mixup_alpha=0.2),
)
PUBLISHED["timm_rsb_a2_resnet50.toml"] = (
    "ResNet strikes back, table 1, A2 (79.8 %)",
    dict(RSB_A1_A2, epochs=300, wd=0.02, label_smoothing=0.0, mixup_alpha=0.1),
)


for _, published_flags in PUBLISHED.values():
    published_flags["lr_per_epoch"] = True  # torchvision's and timm's train.py step their schedulers once per epoch


# The sources that leave the residual BatchNorm scales at 1 (dlojz zero-inits them by default): torchvision's
# references/classification/train.py (torchvision.models.get_model without zero_init_residual), FFCV's
# ffcv-imagenet rn50 configs (torchvision's resnet50 as built), NVIDIA's MLPerf v4.0 ResNet-50 submission.
NO_ZERO_INIT = ("torchvision_resnet50_v2.toml", "race_rn50_16ep.toml", "race_rn50_88ep.toml", "mlperf_rn50_lars.toml")


@pytest.mark.parametrize("name", NO_ZERO_INIT)
def test_the_recipes_whose_source_does_not_zero_init_build_a_model_without_it(name):
    from dlojz_lib.model.zoo import create_model

    values = vars(get_args_parser().parse_args(["--config", str(ROOT / "recipes" / name)]))
    assert values["zero_init_residual"] is False
    model = create_model(values["arch"], 10, values["zero_init_residual"])
    assert model.layer1[0].bn3.weight.detach().eq(1).all()  # torchvision's init: scale 1 (zero-init: 0)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_published_recipe_gives_its_source_s_flags(name):
    source, flags = PUBLISHED[name]
    values = vars(get_args_parser().parse_args(["--config", str(ROOT / "recipes" / name)]))
    assert {flag: values[flag] for flag in flags} == flags, source
    header = (ROOT / "recipes" / name).read_text()
    assert source.split("(")[-1].rstrip(")") in header  # the source's figure, in the file's header


@pytest.mark.parametrize(
    "flags",
    [
        ["--pretrained"],  # the bare flag: its DEFAULT
        ["--pretrained", "IMAGENET1K_V1", "--lr-milestones", "30", "60", "--lr-scheduler", "step"],
        ["--randaugment", "2", "9", "--mean", "0.4", "0.5", "0.6", "--std", "0.2", "0.25", "0.3"],
    ],
)
def test_a_run_s_args_toml_is_read_back_by_config_for_every_kind_of_flag(flags, tmp_path):
    """The recipe dlojz writes beside a run (args.toml, HPO's best.toml) gives --config the same values: switches,
    numbers, strings, lists of a fixed length, one or more values (--lr-milestones), an optional value
    (--pretrained)."""
    from dlojz_lib.settings.recipe import read_recipe, recipe_text

    parser = get_args_parser()
    args = parser.parse_args(["--device", "cpu", *flags])
    path = recipe(tmp_path, recipe_text(args, parser))
    back = read_recipe(parser, path)
    given = {key: value for key, value in vars(args).items() if value is not None and key not in ("config", "help")}
    assert {key: list(v) if isinstance(v, tuple) else v for key, v in back.items()} == given


def test_every_flag_of_a_resolved_run_goes_through_args_toml_and_back(tmp_path):
    import dataclasses

    from dlojz_lib.settings.recipe import recipe_text

    cfg = resolve("--lr-milestones", "2", "4", "-e", "6", "--lr-scheduler", "step", "--randaugment", "2", "9")
    again = resolve("--config", recipe(tmp_path, recipe_text(cfg, get_args_parser())))
    differ = {
        field.name: (getattr(cfg, field.name), getattr(again, field.name))
        for field in dataclasses.fields(cfg)
        if field.name not in ("config", "notes", "set_by_recipe")
        and getattr(cfg, field.name) != getattr(again, field.name)
    }
    assert differ == {}


def test_a_recipe_s_switch_is_turned_off_from_the_command_line(tmp_path):
    path = recipe(tmp_path, "blurpool = true\nmodel-ema = true\ntta-flip = true\n")
    assert (resolve("--config", path).blurpool, resolve("--config", path).model_ema) == (True, True)
    cfg = resolve("--config", path, "--no-blurpool", "--no-model-ema", "--no-tta-flip")
    assert (cfg.blurpool, cfg.model_ema, cfg.tta_flip) == (False, False, False)


def test_every_switch_has_its_no_form():
    import argparse

    switches = [action for action in get_args_parser()._actions if action.nargs == 0 and action.dest != "help"]
    plain = [
        action.option_strings
        for action in switches
        if not isinstance(action, argparse.BooleanOptionalAction) and not action.option_strings[-1].startswith("--no-")
    ]
    assert len(switches) > 20 and plain == []


def test_an_error_about_a_recipe_s_key_names_the_file(tmp_path):
    from dlojz_lib.settings.flag_checks import checked_values

    path = recipe(tmp_path, "freeze-backbone-epochs = 1\n")
    with pytest.raises(UserError) as caught:
        checked_values(["--config", str(path), "--device", "cpu"])
    assert str(caught.value).endswith(
        f"(--freeze-backbone-epochs is set by --config {path}: change it there, or give it here)"
    )
    with pytest.raises(UserError) as caught:  # given on the command line: the file is not blamed
        checked_values(["--config", str(path), "--device", "cpu", "--freeze-backbone-epochs", "1"])
    assert "--config" not in str(caught.value)


def test_no_warm_up_on_the_command_line_leaves_a_recipe_s_warm_up_shape_out(tmp_path):
    """A short run of a recipe with a 5-epoch warm-up: --warmup-epochs 0 is enough (the recipe's start factor and
    method, which shaped a warm-up no longer there, go with it); given on the command line, they are still checked."""
    path = recipe(
        tmp_path,
        'lr-scheduler = "cosine"\nwarmup-epochs = 5\nwarmup-start-factor = 0.01\nwarmup-method = "linear"\n',
    )
    cfg = resolve("--config", path, "-e", "2", "--warmup-epochs", "0")
    assert (cfg.warmup_epochs, cfg.warmup_start_factor, cfg.warmup_method) == (0, None, None)
    with pytest.raises(UserError, match="shape the warm-up: give its length with --warmup-epochs"):
        resolve("--config", path, "-e", "2", "--warmup-epochs", "0", "--warmup-start-factor", "0.1")


def test_a_recipe_s_feature_is_cleared_with_its_no_form(tmp_path):
    """--randaugment, --ra-reps, --lr-milestones, --lr-step-size and the others a recipe sets: --no-FLAG turns each
    off (its value None, as without the recipe); every flag off by default that a value turns on has one
    (--no-float8, --no-layout, --no-dali-cache: generated from the flag table), a flag with a default (--lr) none."""
    from dlojz_lib.settings.flags import clearable_flags

    path = recipe(tmp_path, "randaugment = [2, 9]\nra-reps = 3\nlr-scheduler = 'step'\nlr-milestones = [2]\n"
                            "epochs = 4\ndrop-path = 0.1\narch = 'convnext_tiny'\nimage-size = 32\n")  # fmt: skip
    cfg = resolve("--config", path)
    assert (cfg.randaugment, cfg.ra_reps, cfg.lr_milestones, cfg.drop_path) == ((2, 9), 3, [2.0], 0.1)
    cfg = resolve("--config", path, "--no-randaugment", "--no-ra-reps", "--no-lr-milestones", "--no-drop-path")
    assert (cfg.randaugment, cfg.ra_reps, cfg.lr_milestones, cfg.drop_path) == (None, None, None, None)
    parser = get_args_parser()
    clearable = clearable_flags(parser)  # the rows marked clearable=True, and every flag that turns a feature on
    assert {"ra_reps", "norm_wd", "bias_wd", "checkpoint_every", "timm_augment", "float8", "layout", "dali_cache",
            "tensorboard", "teacher", "resume", "metrics_json"} <= {*clearable}  # fmt: skip
    off_by_default = [  # a value flag off (None) unless given, its help naming no default that fills it in
        action.dest for action in parser._actions
        if action.option_strings and action.default is None and action.nargs != 0 and action.help != argparse.SUPPRESS
        and not isinstance(action, argparse.BooleanOptionalAction) and action.dest != "config"
        and ("default" not in action.help.replace("\n", " ") or "default: off" in action.help.replace("\n", " "))
    ]  # fmt: skip
    assert off_by_default and set(off_by_default) <= set(clearable), sorted(set(off_by_default) - set(clearable))
    assert all(parser.parse_args([f"--no-{dest.replace('_', '-')}"]).__dict__[dest] is None for dest in clearable)
    with pytest.raises(SystemExit):  # a flag not marked has no --no- form
        parser.parse_args(["--no-lr"])


@pytest.mark.parametrize("gpus", [1, 4, 8, 32])
def test_the_ema_decay_follows_the_gpus_as_torchvision_s_train_py_computes_it(gpus):
    """torchvision's train.py: adjust = world size x batch x --model-ema-steps / epochs, decay = 1 - (1 - 0.99998)
    x adjust; the recipe gives 0.99998 and --model-ema-adjust, and dlojz computes it from the GPUs of the job."""
    import dataclasses

    from dlojz_lib.model.zoo import ema_decay

    cfg = resolve("--config", ROOT / "recipes" / "torchvision_resnet50_v2.toml")
    assert (cfg.model_ema_decay, cfg.model_ema_adjust) == (0.99998, True)
    assert ema_decay(cfg.section("memory"), cfg.section("training"), gpus) == pytest.approx(
        1 - 2e-5 * gpus * 128 * 32 / 600, abs=1e-12
    )
    assert ema_decay(cfg.section("memory"), cfg.section("training"), 8) == pytest.approx(
        0.998908, abs=1e-6
    )  # the value the recipe typed for 8 GPUs before
    assert (
        ema_decay(dataclasses.replace(cfg, model_ema_adjust=False).section("memory"), cfg.section("training"), gpus)
        == 0.99998
    )  # without the rule: as given


@pytest.mark.parametrize("name", ["race_rn50_16ep.toml", "race_rn50_88ep.toml"])
def test_the_race_headers_say_the_epochs_the_resolution_changes(name):
    """The header's "160 px up to epoch A, 192 px from epoch B" is what the recipe's ramp gives."""
    import re

    from dlojz_lib.data.augment import resolution_at

    text = (ROOT / "recipes" / name).read_text()
    last_low, first_high = map(
        int, re.search(r"160 px up to epoch\s*#?\s*(\d+), 192 px from epoch (\d+)", text).groups()
    )
    values = vars(get_args_parser().parse_args(["--config", str(ROOT / "recipes" / name)]))
    ramp = [values[key] for key in ("min_res", "max_res", "start_ramp", "end_ramp", "res_step")]
    sizes = [resolution_at(epoch, *ramp) for epoch in range(values["epochs"])]
    assert sizes.index(192) == first_high and sizes[last_low] == 160 and first_high == last_low + 1


def test_a_layout_refused_on_fewer_ranks_names_the_recipe_that_set_it(tmp_path, run_inline):
    """--tp 2 read back from a run's args.toml on one process: the refusal names the file that set it, as the other
    recipe refusals do; the same for --fsdp-replicate."""
    for key, flag in (("tp = 2", "--tp"), ("fsdp-replicate = 2", "--fsdp-replicate")):
        path = tmp_path / f"{flag[2:]}.toml"
        path.write_text(f"fsdp = true\n{key}\n")
        proc = run_inline("--device", "cpu", "--synthetic", "--arch", "timm:test_vit", "--image-size", "32",
                          "--test", "--test-nsteps", "1", "--no-wandb", "--config", path,
                          "--output-dir", tmp_path / flag[2:])  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        line = proc.stderr.strip().splitlines()[-1]
        assert f"({flag} is set by --config {path}: change it there, or give it here)" in line, line


def test_a_recipe_written_with_a_byte_order_mark_is_read(tmp_path):
    """An editor's UTF-8 byte-order mark before the first key was "not valid TOML" at column 1: it is left out."""
    path = tmp_path / "bom.toml"
    path.write_bytes(b"\xef\xbb\xbf" + b"lr = 0.5\nlabel-smoothing = 0.1\n")
    cfg = resolve("--config", path)
    assert (cfg.lr, cfg.label_smoothing) == (0.5, 0.1)
