"""Consolidate a sharded (--fsdp) checkpoint into one ordinary dlojz checkpoint (.pt), for inference, DDP
fine-tuning or `--resume` without --fsdp; or shard an ordinary one, for `--resume` with --fsdp (any --tp, --pp). The
sharding itself and the sharded checkpoints are dlojz_lib/parallelism/fsdp.py's.

    python dlojz_fsdp.py consolidate runs/JOB/ckpt_e0010_s000050040.dcp model.pt
    python dlojz_fsdp.py shard runs/JOB/ckpt_e0010_s000050040.pt runs/NEW   # then --fsdp --resume auto --output-dir runs/NEW
"""

import os
import shutil
import sys
import warnings
from pathlib import Path

from dlojz_lib.checks import OneLineArgumentParser, command

# What a run's folder (args.toml, its pointers, its metrics) or a lab sweep's (sweep.json, each run's status.json)
# holds: shard writes only into a folder of none of them
RUN_AND_SWEEP_FILES = ("args.toml", "latest", "best", "metrics.json", "sweep.json", "status.json")

# torch and what imports it come inside the functions: the command's one door (`command`) is open first, so a
# Ctrl-C in the seconds torch takes to import is one line, not a traceback


def ordinary_model_and_optimizer(saved):
    """The model and optimizer a run without --fsdp builds for the checkpoint `saved` (fused where torch has it):
    their state dicts are an ordinary checkpoint's."""
    import dlojz_lib.optim.optimizers as optim
    from dlojz_lib.model.zoo import apply_blurpool, create_model

    args = saved["args"]
    module = create_model(
        args["arch"], saved["num_classes"], args["zero_init_residual"], args["image_size"], args.get("drop_path")
    )
    if args["blurpool"]:
        apply_blurpool(module, maxpool=args.get("blurpool_maxpool", True))
    head = optim.fine_tuning_head(module, saved["num_classes"], args)
    optimizer = optim.build_optimizer(
        args["optimizer"],
        optim.param_groups(
            module, args["wd"], args["no_wd_norm_bias"], args.get("layer_decay"), head, optim.kind_decay(args)
        ),
        lr=args["lr"],
        momentum=args["mom"],
        weight_decay=args["wd"],
        fused=True,
        nesterov=args.get("nesterov", False),
    )
    return module, optimizer


def consolidate(source, target):
    """Write `target`: the ordinary checkpoint (dlojz_lib.checkpoint's .pt) that a run without --fsdp would have
    written at the same point, from the sharded checkpoint folder `source`. One process reads every shard."""
    import torch
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    import dlojz_lib.checkpoint as ckpt
    from dlojz_lib.parallelism.fsdp import set_optimizer_state

    source = Path(source)
    if source.is_dir() and not ckpt.is_sharded_folder(source):  # a run's folder: name its sharded checkpoints
        found = [path for path in ckpt.list_checkpoints(source) if path.suffix == ".dcp"]
        raise ckpt.CheckpointError(
            f"{source} is a run's folder, not a sharded checkpoint: "
            + (f"give one of its .dcp folders, e.g. {found[-1]} (its newest)" if found else "it holds no .dcp folder")
        )
    saved = ckpt.load(source)  # the metadata, once the folder is checked complete
    if not saved.get("sharded_path"):
        raise ckpt.CheckpointError(f"checkpoint {source} is not sharded: nothing to consolidate")
    args = saved["args"]
    module, optimizer = ordinary_model_and_optimizer(saved)
    # Everything the checkpoint holds, the schedule's entries in the optimizer's param_groups too (loading into
    # placeholders would keep only the keys a fresh optimizer has).
    whole = Path(target).with_name(f".{Path(target).name}.whole.tmp")
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp_to_torch_save(source, whole)
        state = torch.load(whole, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, CheckpointException) as err:  # (the last: a BaseException)
        said = ckpt.out_of_room(err, target, folder_bytes(source))
        if said is None:
            raise
        state = None
    finally:
        whole.unlink(missing_ok=True)
    if state is None:
        raise said  # (outside the handler: the failed write's frames, and its open file, are let go first)
    if args.get("tp", 1) > 1:  # --tp held timm's fused qkv as q, k and v: an ordinary model's again
        from dlojz_lib.parallelism.tensor import fused_flat_optimizer_state, fused_optimizer_state, fused_state_dict

        flat = "param_groups" not in state["optimizer"]  # saved parameter by parameter (--pp)
        fuse = fused_flat_optimizer_state if flat else fused_optimizer_state
        state.update(model=fused_state_dict(state["model"]), optimizer=fuse(state["optimizer"]))
    module.load_state_dict(state["model"])
    set_optimizer_state(module, optimizer, state["optimizer"])
    full = {key: value for key, value in saved.items() if key != "sharded_path"}
    full.update(model=module.state_dict(), optimizer=optimizer.state_dict(), ema=None, consolidated_from=str(source))
    ckpt.write_whole(full, target)
    return target


def folder_bytes(folder):
    """The bytes of the files in `folder` (a sharded checkpoint): about what it takes written again as one file."""
    return sum(path.stat().st_size for path in Path(folder).rglob("*") if path.is_file())


def shard(source, target_dir):
    """Write into the folder `target_dir` the sharded checkpoint (a ckpt_e*_s*.dcp folder, `latest` naming it) that a
    run with --fsdp would have written at the point of the ordinary checkpoint `source`: its weights and optimizer
    state by parameter name, whole (a resume under any --fsdp layout reads them into its own shards, q, k and v
    split for --tp). One process writes it. Returns the folder written."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import dlojz_lib.checkpoint as ckpt
    from dlojz_lib.resume import foreign_record

    source, target_dir = Path(source), Path(target_dir)
    saved = ckpt.load(source)
    if saved.get("sharded_path"):
        raise ckpt.CheckpointError(f"checkpoint {source} is already sharded: --resume it with --fsdp")
    name = ckpt.checkpoint_name(saved["epoch"], saved["global_step"], sharded=True)
    if (target_dir / name).exists():
        raise ckpt.CheckpointError(f"{target_dir / name} exists: give another folder, or remove it")
    # The folder becomes the resumed run's --output-dir, its `latest` naming this checkpoint: a run's folder (the
    # source's own among them) would have its latest re-pointed, and its next --resume auto go astray.
    held = ckpt.newest_checkpoint(target_dir)
    if held is not None:
        whose = "the source's own folder" if target_dir.resolve() == source.resolve().parent else "a run's folder"
        raise ckpt.CheckpointError(
            f"target {target_dir} is {whose} (its checkpoint {held.name}), whose latest would name the sharded copy: "
            f"give a new folder (e.g. {target_dir.with_name(target_dir.name + '-sharded')})"
        )
    if (foreign := foreign_record(target_dir)) is not None:
        raise ckpt.CheckpointError(f"target {target_dir}: {foreign}, and shard would replace it: give a new folder")
    if ckpt.is_sharded_folder(target_dir):
        raise ckpt.CheckpointError(
            f"target {target_dir} is a sharded checkpoint's folder, not a run's: give a new folder, the --output-dir "
            "of the run that resumes it"
        )
    held = [name for name in RUN_AND_SWEEP_FILES if os.path.lexists(target_dir / name)]
    if held:  # (a run not checkpointed yet, a lab sweep or one of its runs)
        raise ckpt.CheckpointError(
            f"target {target_dir} holds a run's or a sweep's files ({', '.join(held)}), which shard would mix with "
            "the copy's: give a new folder"
        )
    module, optimizer = ordinary_model_and_optimizer(saved)
    module.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    model_state, optimizer_state = get_state_dict(module, optimizer)  # by parameter name, a run's sharded layout
    target_dir.mkdir(parents=True, exist_ok=True)
    staging = target_dir / f".{name}.tmp"
    meta = {key: value for key, value in saved.items() if key not in ("model", "optimizer", "ema")}
    try:
        with warnings.catch_warnings():  # "saving in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=staging, no_dist=True)
        return ckpt.publish_folder(meta, staging, target_dir, name, keep=0)
    except (OSError, RuntimeError, dcp.api.CheckpointException) as err:  # (the last: a BaseException)
        shutil.rmtree(staging, ignore_errors=True)  # nothing half-written left
        said = ckpt.out_of_room(err, target_dir / name, ckpt.tensor_bytes(saved))
        if said is None:
            raise
    raise said  # (outside the handler: the failed write's frames, and its open files, are let go first)


@command("dlojz_fsdp.py")
def main(argv=None):
    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    command = commands.add_parser("consolidate", help="one ordinary .pt checkpoint from a sharded (.dcp) one")
    command.add_argument("source", help="a sharded checkpoint folder (ckpt_e*_s*.dcp)")
    command.add_argument("target", help="the .pt file to write")
    command.add_argument("--force", action="store_true", help="replace target even if consolidate did not write it")
    command = commands.add_parser("shard", help="a sharded (.dcp) checkpoint from an ordinary .pt one")
    command.add_argument("source", help="an ordinary checkpoint (ckpt_e*_s*.pt)")
    command.add_argument("target", help="the folder to write it in: the --output-dir of the run that resumes it")
    args = parser.parse_args(argv)
    import dlojz_lib.checkpoint as ckpt
    from dlojz_lib.checks import check_output_folder, claim_output

    if args.command == "shard":
        check_output_folder(args.target, "target")
        written = shard(args.source, args.target)
    else:
        claim_output(
            args.target, "target", "a checkpoint dlojz_fsdp.py consolidate wrote",
            lambda path: ckpt.written_by_command(path, "consolidated_from"), [args.source], args.force,
            create_folder=False,
        )  # fmt: skip
        consolidate(args.source, args.target)
    if args.command == "shard":
        print(
            f"written: {written}: resume it with --fsdp --resume auto --output-dir {args.target} (or --resume {written})"
        )
        return 0
    print(
        f"written: {args.target} ({os.path.getsize(args.target) / 2**20:.1f} MiB): --resume it without --fsdp, or "
        f"torch.load(...)['model'] for the weights"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
