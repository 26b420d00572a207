"""The run's layout as one record (dlojz_lib/settings/layout.py): `Layout`, made from the flags once they are
filled (`resolve_layout`), read as `Config.parallelism`; its rules as problems, which dlojz.py refuses and the
planner leaves out."""

import ast
import dataclasses
import subprocess
import sys

import pytest
from conftest import ROOT, clean_env

from dlojz_lib.checks import UserError
from dlojz_lib.settings.config import resolve_config
from dlojz_lib.settings.flags import get_args_parser
from dlojz_lib.settings.layout import Layout, layout_problems


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --output-dir (./runs/...) is made and checked writable


def resolve(*flags, chosen=None):
    return resolve_config(get_args_parser().parse_args(["--device", "cpu", *map(str, flags)]), chosen)


def parsed(*flags) -> dict:
    return vars(get_args_parser().parse_args(["--device", "cpu", *map(str, flags)]))


def test_every_field_of_the_record_says_what_it_is_in_a_line():
    """Each field of Layout is followed by its one-line docstring (what a reader of the record sees first)."""
    tree = ast.parse((ROOT / "dlojz_lib" / "settings" / "layout.py").read_text())
    record = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Layout")
    body = record.body
    fields = [(i, node.target.id) for i, node in enumerate(body) if isinstance(node, ast.AnnAssign)]
    assert [name for _, name in fields] == [field.name for field in dataclasses.fields(Layout)]
    undocumented = [
        name
        for i, name in fields
        if not (isinstance(body[i + 1], ast.Expr) and isinstance(body[i + 1].value, ast.Constant))
        or "\n" in body[i + 1].value.value
    ]
    assert not undocumented, undocumented


def test_the_config_carries_the_layout_its_flags_resolve_to():
    """--fsdp --pp 2 on the CPU: the record holds the degrees, the defaults the resolver filled (2 p micro-batches,
    no resharding after a stage's forward, 1 stage a rank under 1F1B) and what each unit does (--grad-checkpointing
    as full checkpointing, --compile-mode's --compile, bfloat16 gathers)."""
    cfg = resolve("--fsdp", "--pp", "2", "--grad-checkpointing", "--compile-mode", "max-autotune-no-cudagraphs")
    assert cfg.parallelism == Layout(
        fsdp=True, pp=2, microbatches=4, reshard_after_forward=False, checkpointing="full", compile=True,
        compile_mode="max-autotune-no-cudagraphs", param_dtype=None,
    )  # fmt: skip
    assert cfg.parallelism.compiled_by_block and not cfg.parallelism.cuda_graphs
    assert cfg.parallelism.builds_on_meta(is_main=False) and not cfg.parallelism.builds_on_meta(is_main=True)
    assert cfg.parallelism.name == "PP 2 x FSDP"
    cut = resolve("--fsdp", "--pp", "2", "--pp-schedule", "interleaved", "--pp-split", "1,2,3", "-b", "8")
    assert (cut.parallelism.stages_per_rank, cut.parallelism.split, cut.parallelism.schedule) == (
        2,
        (1, 2, 3),
        "interleaved",
    )
    plain = resolve("--amp", "--amp-dtype", "bfloat16")
    assert plain.parallelism == Layout(param_dtype="bfloat16") and plain.parallelism.name == "DDP"
    assert not plain.parallelism.builds_on_meta(is_main=False)
    # a Config made anew reads its own record, never a stale one
    again = dataclasses.replace(cfg, compile_mode="default")
    assert again.parallelism.compile_mode == "default" and cfg.parallelism.compile_mode != "default"


def test_a_chosen_layout_is_the_run_s_and_its_flags_are_recorded():
    """--layout auto's pick (a Layout) given to resolve_config: the run's record is it, the flags (what args.toml
    writes) say it, and --layout is not recorded (a rerun of the record runs that layout)."""
    chosen = Layout(fsdp=True, tp=1, replicate=1, checkpointing="selective")
    cfg = resolve("--layout", "auto", chosen=chosen)
    layout = cfg.parallelism
    assert (layout.fsdp, layout.tp, layout.pp, layout.replicate, layout.checkpointing) == (True, 1, 1, 1, "selective")
    assert cfg.fsdp and cfg.activation_checkpointing == "selective" and cfg.layout is None
    assert cfg.amp_dtype == "bfloat16"  # FSDP's default, as the flags given by hand would give


def test_the_rules_are_problems_the_run_refuses_and_the_planner_reads():
    """A pipeline beside --grad-acc: dlojz.py's one line; the same record asked by the planner (Layout.problems)
    returns that line instead of raising; a layout the flags allow has none."""
    with pytest.raises(UserError, match=r"^--pp 2 with --grad-acc 2: the schedule already accumulates"):
        resolve("--fsdp", "--pp", "2", "--grad-acc", "2", "-b", "8")
    values = parsed("--grad-acc", "2", "-b", "8")
    pipeline = Layout(fsdp=True, pp=2)
    assert pipeline.problems(values)[0].startswith("--pp 2 with --grad-acc 2: the schedule already accumulates")
    assert Layout(fsdp=True).problems(values) == []
    assert Layout(tp=2).problems(values)[0].startswith("--tp 2 runs with --fsdp over the data dimension")
    assert (
        Layout(fsdp=True, float8="tensorwise", tp=2).problems(values)[-1].startswith("--float8 tensorwise with --tp 2")
    )
    # each rule once, in the order the checks read them
    mixed = parsed("--pp", "2", "--mixup-alpha", "0.2", "--findlr")
    assert [line.split(":")[0] for line in layout_problems(mixed)] == [
        "--pp 2 runs with --fsdp over the data dimension (a data dimension of 1 rank is the pipeline alone)",
        "--pp 2 with --mixup-alpha",
        "--pp 2 with --findlr",
    ]


def test_the_layout_record_imports_no_torch():
    code = "import sys, dlojz_lib.settings.layout; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=clean_env(), check=True, timeout=60)


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--fsdp-replicate", "2"], "drop --fsdp-replicate"),
        (["--tp", "2"], "drop --tp"),
        (["--pp", "2"], "drop --pp"),
        (["--fsdp", "--tp", "2"], "drop --fsdp and --tp"),
        (["--fsdp-offload"], "--fsdp-offload says how a layout runs that --layout auto may not choose"),
        (["--sequence-parallel"], "--sequence-parallel says how a layout runs"),
        (["--check-replicas", "10"], "--check-replicas says how a layout runs"),
        (["--pp-schedule", "interleaved"], "--pp-schedule says how a layout runs"),
    ],
)
def test_a_layout_flag_beside_layout_auto_says_how_it_goes_with_it(flags, named):
    """Each layout flag beside --layout auto is one line saying what --layout auto chooses and takes (never "add
    --fsdp", which --layout auto then refuses); --pp-microbatches, which it takes, is no refusal."""
    from dlojz_lib.settings.flag_checks import checked_values
    from dlojz_lib.settings.layout import check_layout

    with pytest.raises(UserError) as refused:
        check_layout(checked_values(["--device", "cpu", "--layout", "auto", *flags]))
    said = str(refused.value)
    assert named in said and "--layout auto chooses --fsdp, --fsdp-replicate, --tp and --pp" in said, said
    assert "add --fsdp" not in said and "or --layout auto and give the layout yourself" in said, said
    check_layout(checked_values(["--device", "cpu", "--layout", "auto", "--pp-microbatches", "4"]))
