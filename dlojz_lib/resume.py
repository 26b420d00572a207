"""Checkpoints in a run: `claim_output_dir` (the output folder is one run's: its lock, and a folder holding another
run's checkpoints refused without --resume or --start-over), `make_saver` (one file by rank 0, written by a
background thread, or with --fsdp a folder of every rank's shards), the end of an epoch's checkpoint,
--checkpoint-every's mid-epoch ones, `check_checkpoints_written` at the run's end, and `restore` (--resume: the
weights, the optimizer (dropped if of another kind), the schedule, rebuilt when the length, batch size, grad-acc,
number of ranks or scheduler changed, the GradScaler, the position in the epoch in images, and the random
generators). `TrainState` is where training is: exactly what a checkpoint saves and a resume restores.
"""

import dataclasses
import fcntl
import math
import os
import shutil
import socket
import time
from pathlib import Path

import torch.distributed as dist

import dlojz_lib.checkpoint as ckpt
import dlojz_lib.optim.optimizers as optim
from dlojz_lib.checks import UserError, fail
from dlojz_lib.log import ARGS_FILE
from dlojz_lib.optim.schedules import fast_forward
from dlojz_lib.settings.flags import VALIDATION_METRICS


@dataclasses.dataclass
class TrainState:
    """Where training is: exactly what a checkpoint saves and a resume restores."""

    epoch: int = 0  # the current epoch (0-based)
    batch: int = 0  # micro-batches done in it
    global_step: int = 0  # optimizer steps done since the start of training
    wandb_id: str | None = None  # the W&B run that a resume continues
    elapsed_s: float = 0.0  # wall-clock seconds of training and validation before this run started
    best_metric: str | None = None  # the --best-metric that best_value is a value of
    best_value: float | None = None  # its best validation so far, that of the checkpoint `best` names
    best_epoch: int = 0


def claim_output_dir(logging, modes, ranks, log, resources):
    """Make the output folder this run's, on rank 0; every rank learns the answer. Refused, in one line: while
    another run holds its lock; where a run's own record (args.toml, latest, best) is a folder or a file of someone else's; or when it
    holds a run's checkpoints and neither --resume (continue it) nor --start-over (its files moved aside into
    `previous-<time>/`) is given. The temporary files of a write that died are removed. The lock is held until
    `resources` (the run's ExitStack) closes. `logging` and `modes`: the run's settings of those groups. A training
    run owns the folder; --eval-only takes the lock alone (it writes its results beside a run's); --test and
    --loader-only take none."""
    owns = not (modes.test or modes.eval_only or modes.loader_only)
    problem = None
    if ranks.is_main:
        try:
            if owns or modes.eval_only:
                problem = _claim(Path(logging.output_dir), logging, log, resources, owns)
        except OSError as err:
            problem = f"--output-dir {logging.output_dir}: {err.strerror or err}; give a folder this run can write in"
    if ranks.enabled:
        answer = [problem]
        dist.broadcast_object_list(answer, src=0)
        problem = answer[0]
    if problem:
        fail(problem)  # (a lock taken is released as the run's ExitStack closes)


def foreign_record(folder):
    """The first of a run's own record files in `folder` (args.toml, latest, best) that is not one (a folder, or a
    file whose content is not what dlojz writes there: the user's own file of that name), said as a phrase; None."""
    for name, what in ((ARGS_FILE, "a run's settings"), (ckpt.LATEST, "a checkpoint's name"), (ckpt.BEST, "a checkpoint's name")):  # fmt: skip
        path = folder / name
        if not os.path.lexists(path):
            continue
        if not path.is_file():
            return f"{path} is not a file"
        try:
            with open(path, "rb") as file:
                head = file.read(256)
        except OSError as err:
            return f"{path} cannot be read ({err.strerror or err})"
        ours = (
            head.startswith(b"# dlojz.py")
            if name == ARGS_FILE
            else ckpt.NAME_RE.match(head.decode(errors="replace").strip())
        )
        if not ours:
            return f"{path} is not dlojz's (it would hold {what})"
    return None


def _claim(folder, logging, log, resources, owns=True):
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ckpt.RUN_LOCK
    path.touch()
    # Read-only: a file held open for writing would keep the folder's file system from being remounted read-only.
    lock = open(path)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = lock.read().strip() or "a process"
        lock.close()
        return (
            f"--output-dir {folder}: another run is writing there ({holder}); give another --output-dir, or wait for it"
        )
    except OSError:  # a file system without locks (NFS without lockd, Lustre without -o flock): unlocked, as before
        pass
    path.write_text(f"pid {os.getpid()} on {socket.gethostname()}\n")  # who holds it, for the run refused
    resources.callback(lock.close)  # another run may write here once this one ends
    if not owns:
        return None
    if (foreign := foreign_record(folder)) is not None:  # before anything is moved or removed
        return f"--output-dir {folder}: {foreign}, and this run would replace it: move it, or give another --output-dir"
    for stale in folder.glob(".*.tmp"):  # a checkpoint write that died (only this run writes here now)
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    newest = ckpt.newest_checkpoint(folder)
    if newest is None or logging.resume:
        return None
    if not logging.start_over:
        return (
            f"--output-dir {folder} holds a run (its checkpoint {newest.name}): continue it with --resume auto, "
            "start it over with --start-over (its files are kept aside), or give another --output-dir"
        )
    aside = folder / time.strftime("previous-%Y%m%d-%H%M%S")
    aside.mkdir()
    for entry in folder.iterdir():
        if entry.name != ckpt.RUN_LOCK and not entry.name.startswith("previous-"):
            entry.rename(aside / entry.name)
    log(f"--start-over: the run that was in {folder} is now in {aside}")
    return None


class PeriodicCheckpoints:
    """--checkpoint-every: a mid-epoch checkpoint once that many minutes have passed since the last checkpoint, for
    a node that dies without a signal. Rank 0's clock says when one is `due`; the ranks agree on the step through
    the all-reduce of a log point (no collective of its own); every rank then calls `save`."""

    def __init__(self, minutes, saver, started, n_train_batches, log, clock=time.perf_counter):
        self.every_s, self.saver, self.started, self.n_train_batches = minutes * 60, saver, started, n_train_batches
        self.log, self.clock = log, clock
        self.last = clock()

    def due(self) -> bool:
        return self.saver.is_main and self.clock() - self.last >= self.every_s

    def restart(self):
        """A checkpoint was written (at an epoch's end): the interval counts from now."""
        self.last = self.clock()

    def save(self, state):
        state.elapsed_s = self.clock() - self.started
        path = self.saver.save(dataclasses.asdict(state))
        self.restart()
        why = f"--checkpoint-every {self.every_s / 60:g} min: epoch {state.epoch + 1}, step {state.batch}/{self.n_train_batches}"
        log_checkpoint(self.log, self.saver, path, why)


def log_checkpoint(log, saver, path, why=""):
    """The console line of a checkpoint saved at `path`; none for None (another rank's, or a write that failed: its
    warning said so)."""
    if path is not None:
        log(f"checkpoint {'being written' if saver.background else 'written'}: {path}" + (f" ({why})" if why else ""))


def periodic_checkpoints(cfg, saver, started, n_train_batches, lr_finder, log):
    """--checkpoint-every's PeriodicCheckpoints; None when off, under --test and during the LR range test."""
    if cfg.checkpoint_every <= 0 or cfg.test or lr_finder is not None:
        return None
    return PeriodicCheckpoints(cfg.checkpoint_every, saver, started, n_train_batches, log)


def save_epoch_checkpoint(saver, state, periodic, log, best=False):
    """The end of an epoch's checkpoint: rank 0 copies the state and a thread writes it (with --fsdp every rank
    writes its shards); --checkpoint-every's interval counts from it. `best`: `best` names it once written."""
    why = ["by a background thread"] if saver.background else []
    if best:
        why.append(f"the best {state.best_metric} so far, {state.best_value:.4f}: `best` names it")
    log_checkpoint(log, saver, saver.save(dataclasses.asdict(state), best), "; ".join(why))
    if periodic is not None:
        periodic.restart()


def check_checkpoints_written(output_dir, saver, log):
    """At the end of a run: the checkpoints whose write failed, said in one line; the last one's failure (the final
    model nowhere) raises CheckpointNotWritten, which ends the run non-zero."""
    unwritten = saver.unwritten
    if not unwritten:
        return
    last = saver.last_unwritten()
    if last is not None:
        raise ckpt.CheckpointNotWritten(
            ckpt.not_written_message(output_dir, f"the run's last checkpoint ({unwritten[-1][0].name})", last)
        )
    names = ", ".join(path.name for path, _ in unwritten)
    log(f"WARNING: {len(unwritten)} checkpoint(s) not written during the run ({names}); the last one is on disk")


def make_saver(cfg, model, training, ranks, classes=None):
    """The checkpoint writer: one file by rank 0, or with --fsdp one folder of every rank's shards. The class names
    go with the weights: dlojz_predict.py names its predictions with them."""
    fixed = dict(
        args=dataclasses.asdict(cfg),
        total_steps=training.total_steps,
        world_size=ranks.world_size,
        data_size=ranks.data_size,  # the data-parallel width: the world over --tp x --pp
        num_classes=model.num_classes,
        classes=list(classes) if classes is not None else None,
    )
    if model.parallel == "fsdp":
        from dlojz_lib.parallelism.fsdp import ShardedCheckpointSaver

        return ShardedCheckpointSaver(
            cfg.output_dir,
            cfg.keep_checkpoints,
            ranks.device,
            fixed,
            ranks.is_main,
            model.module,
            training.optimizer,
            training.scheduler,
            training.scaler,
        )
    return ckpt.CheckpointSaver(
        cfg.output_dir,
        cfg.keep_checkpoints,
        ranks.device,
        fixed,
        ranks.is_main,
        background=True,  # training pauses only to copy the state into host memory
        model=model.module,
        optimizer=training.optimizer,
        scheduler=training.scheduler,
        ema=model.ema,
        scaler=training.scaler,
    )


def saved_data_size(saved):
    """The data-parallel width of the run that wrote `saved`: recorded, or (older checkpoints) its world over its
    --tp x --pp."""
    args = saved["args"]
    return saved.get("data_size") or saved.get("world_size", 1) // (args.get("tp", 1) * args.get("pp", 1))


def find_checkpoint(logging, eval_only, arch, num_classes, log, fsdp):
    """--resume's checkpoint (`logging`: --resume and --output-dir), read before the model is built: (its state, its
    path), or (None, None) (no --resume, or --resume auto finding none). A checkpoint of another model (--arch) or
    number of classes, or of the other kind than `fsdp` (--fsdp) resumes, is refused here in one line, not after a
    build and lay-out that can take minutes."""
    if not logging.resume:
        return None, None
    if logging.resume == "auto":
        saved, path = ckpt.load_latest(logging.output_dir)
        if saved is None:
            if eval_only:
                fail(f"--resume auto: no usable checkpoint in {logging.output_dir}")
            if damaged := ckpt.list_checkpoints(logging.output_dir):  # (a fresh run's would be written over them)
                fail(
                    f"--resume auto: every checkpoint in {logging.output_dir} fails its check "
                    f"({', '.join(path.name for path in damaged)}; the warnings above say why): move them aside to "
                    "start this run from scratch, or give --resume the path of a good copy"
                )
            log(f"--resume auto: no checkpoint in {logging.output_dir}, starting from scratch")
            return None, None
    else:
        try:
            saved, path = ckpt.load(logging.resume), logging.resume
        except ckpt.CheckpointError as err:
            fail(f"--resume: {err}")
    check_same_model(arch, num_classes, saved, path)
    check_checkpoint_kind(saved, path, fsdp, eval_only)
    return saved, path


def check_checkpoint_kind(saved, path, fsdp, eval_only):
    """One line unless the checkpoint at `path` is of the kind this run resumes: sharded ones (written with --fsdp)
    with --fsdp; ordinary ones without it, or with --fsdp to evaluate (--eval-only)."""
    sharded = saved.get("sharded_path")
    if sharded and not fsdp:
        fail(
            f"--resume {path}: a sharded checkpoint (written with --fsdp): add --fsdp, or make one ordinary "
            f"checkpoint of it: python dlojz_fsdp.py consolidate {path} OUT.pt"
        )
    if fsdp and not sharded and not eval_only:
        fail(
            f"--resume {path}: --fsdp resumes training from sharded checkpoints (.dcp folders); make one of this "
            f"ordinary checkpoint: python dlojz_fsdp.py shard {path} NEW_DIR, then --resume auto --output-dir NEW_DIR "
            f"(or resume it without --fsdp)"
        )


def restore(cfg, model, training, n_train_batches, ranks, log, found):
    """--resume: the weights (and EMA) of `found` (find_checkpoint's); unless --eval-only, also the optimizer,
    schedule, GradScaler, training position and random generators. Returns (TrainState, the checkpoint's path or
    None)."""
    saved, path = found
    if saved is None:
        return TrainState(), None
    restore_weights(cfg, model, training, saved, path, log)
    state = TrainState()
    if not cfg.eval_only:
        state = TrainState(
            saved["epoch"], saved["batch"], saved["global_step"], saved.get("wandb_id"), saved.get("elapsed_s", 0.0)
        )
        if saved.get("best_metric") == cfg.best_metric:  # another metric: the best counts again from this run
            state.best_metric, state.best_value, state.best_epoch = (
                cfg.best_metric,
                saved["best_value"],
                saved["best_epoch"],
            )
        elif saved.get("best_metric") not in (None, "none") and cfg.best_metric != "none":
            log(
                f"--best-metric {cfg.best_metric}: the checkpoint's best was by {saved['best_metric']} (epoch "
                f"{saved.get('best_epoch')}); from here `best` names the best {cfg.best_metric} of this run's "
                "validations only, earlier checkpoints not compared (evaluate them with --eval-only to choose)"
            )
        # A batch is `batch_size` images on each data replica: the tensor and pipeline ranks of a replica share
        # theirs, so the layouts are compared by their data-parallel widths, not their worlds.
        saved_args, replicas = saved["args"], ranks.data_size
        saved_replicas, saved_batch_size = saved_data_size(saved), saved_args["batch_size"]
        saved_grad_acc = saved_args.get("grad_acc", 1)
        images_per_batch = cfg.batch_size * replicas
        if (saved_replicas, saved_batch_size) != (replicas, cfg.batch_size) and state.batch:
            # The samplers deal out one order of the epoch's images: go on after as many as were trained on.
            done = state.batch * saved_batch_size * saved_replicas
            state.batch = done // images_per_batch
            log(
                f"resumed on {replicas} data replica{'s' if replicas > 1 else ''} x {cfg.batch_size} images a "
                f"checkpoint written on {saved_replicas} x {saved_batch_size}: the epoch goes on after its first "
                f"{done} images"
                + ("" if done % images_per_batch == 0 else f" ({done % images_per_batch} of them trained on again)")
            )
        if (saved_replicas, saved_batch_size, saved_grad_acc) != (replicas, cfg.batch_size, cfg.grad_acc):
            # Optimizer steps of another size: the step this setting has reached at the same image.
            steps_per_epoch = math.ceil(n_train_batches / cfg.grad_acc)
            state.global_step = state.epoch * steps_per_epoch + state.batch // cfg.grad_acc
        if training.scheduler is not None and saved.get("scheduler") is not None:
            restore_schedule(cfg.lr_scheduler, training, saved, state.global_step, log)
        if saved.get("scaler"):  # none when it was written with the scaler off (bfloat16, --no-amp, CPU)
            training.scaler.load_state_dict(saved["scaler"])
        ckpt.restore_rng(saved, ranks.device)
        if model.pipeline is not None:  # each stage's random draws go on from this step's
            model.pipeline.seek(state.global_step)
    at = state if not cfg.eval_only else TrainState(saved["epoch"], saved["batch"], saved["global_step"])
    log(f"resumed from {path} (epoch {at.epoch + 1}, step {at.batch}/{n_train_batches}, global step {at.global_step})")
    return state, path


def restore_weights(cfg, model, training, saved, path, log):
    """The model's weights, the EMA's and (unless --eval-only) the optimizer's state, from a checkpoint file
    or, with --fsdp, from a sharded checkpoint or a file."""
    sharded = saved.get("sharded_path")
    fsdp = cfg.parallelism.fsdp
    check_same_model(cfg.arch, model.num_classes, saved, path)
    weights = saved.get("model")
    if cfg.eval_ema:
        weights = ckpt.ema_weights(saved, path)
        log(f"--eval-ema: validating the EMA weights of {path} (its model's are left out)")
    try:
        if sharded:
            from dlojz_lib.parallelism.fsdp import load_sharded

            load_sharded(sharded, model.module, None if cfg.eval_only else training.optimizer)
        elif fsdp:
            from dlojz_lib.parallelism.fsdp import load_full_weights
            from dlojz_lib.parallelism.tensor import split_state_dict

            held = model.module.state_dict().keys()
            if model.pipeline is not None:  # this rank's stage: its layers' weights (the model's names)
                missing = set(model.unsharded.state_dict()) - set(weights)
                if missing:
                    raise KeyError(f"missing {sorted(missing)[0]} and {len(missing) - 1} more")
            weights = split_state_dict(weights, held)  # --tp: timm's fused qkv as the parts the model holds
            if model.pipeline is not None:
                weights = {key: value for key, value in weights.items() if key in held}
            load_full_weights(model.module, weights)
        else:
            model.module.load_state_dict(weights)
    except (RuntimeError, ValueError, KeyError) as err:
        trained_at = (saved.get("args") or {}).get("image_size")
        size = (  # a position embedding's length follows it
            f"; the checkpoint trained at --image-size {trained_at}, this run at {cfg.image_size}: resume at its size"
            if trained_at not in (None, cfg.image_size)
            else ""
        )
        fail(
            f"--resume {path}: the weights do not fit --arch {cfg.arch} with {model.num_classes} classes "
            f"({str(err).strip().splitlines()[0][:120] if str(err).strip() else type(err).__name__}){size}"
        )
    if model.ema is not None and saved.get("ema") is not None:
        model.ema.load_state_dict(saved["ema"])
    saved_optimizer = (saved.get("args") or {}).get("optimizer", cfg.optimizer)
    if not cfg.eval_only and not sharded:
        if saved_optimizer == cfg.optimizer:
            restore_optimizer_state(training.optimizer, model, saved, log)
        else:  # another optimizer's state (momenta, second moments) means nothing to this one
            log(f"--optimizer {cfg.optimizer}: the checkpoint's {saved_optimizer} state is dropped; it starts afresh")


def group_sizes(param_groups) -> list[int]:
    """How many parameters each group has: what tells two groupings apart."""
    return [len(group["params"]) for group in param_groups]


def same_grouping(optimizer, saved_state) -> bool:
    """Whether the saved optimizer state has this optimizer's groups: as many, of as many parameters each."""
    return group_sizes(saved_state["param_groups"]) == group_sizes(optimizer.param_groups)


def restore_optimizer_state(optimizer, model, saved, log):
    """The checkpoint's optimizer state (momenta, moments), into this run's parameter groups. Where the groups are
    another run's (--layer-decay, --no-wd-norm-bias, --norm-wd and the like added or left out), each parameter's
    state is carried over to its new group: the saved groups are made again from the checkpoint's flags on this
    model, which gives the parameter behind each saved index. The groups' learning rates and weight decays are
    this run's; one line says so. A state that cannot be mapped starts afresh, one line saying so."""
    saved_state = saved["optimizer"]
    if same_grouping(optimizer, saved_state):
        optimizer.load_state_dict(saved_state)
        return
    args = saved.get("args") or {}
    module = model.module
    try:
        head = optim.fine_tuning_head(module, model.num_classes, args)
        old_groups = optim.param_groups(
            module, args["wd"], args.get("no_wd_norm_bias", False), args.get("layer_decay"), head,
            optim.kind_decay(args),
        )  # fmt: skip
    except (KeyError, UserError):
        old_groups = None
    if not old_groups or group_sizes(old_groups) != group_sizes(saved_state["param_groups"]):
        log(
            f"the checkpoint's optimizer state has {len(saved_state['param_groups'])} parameter groups, this run "
            f"{len(optimizer.param_groups)} that cannot be matched to them: the optimizer's state starts afresh"
        )
        return
    old_order = [param for group in old_groups for param in group["params"]]
    new_index = {id(param): i for i, param in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    state = {
        new_index[id(param)]: saved_state["state"][i] for i, param in enumerate(old_order) if i in saved_state["state"]
    }
    # this run's groups (their hyperparameters, their parameters' indices), the carried state under its new indices
    optimizer.load_state_dict(dict(optimizer.state_dict(), state=state))
    log(
        f"the checkpoint's optimizer state ({len(saved_state['param_groups'])} parameter groups) goes on in this "
        f"run's {len(optimizer.param_groups)} groups, each parameter's momenta kept; learning rates and weight "
        "decays are this run's"
    )


def check_same_model(arch, num_classes, saved, path):
    """A checkpoint of another model (--arch) or number of classes is refused in one line naming both, before its
    weights are tried."""
    saved_arch = (saved.get("args") or {}).get("arch")
    saved_classes = saved.get("num_classes")  # (older checkpoints have none: their weights' shapes decide)
    if (saved_arch is not None and saved_arch != arch) or (saved_classes is not None and saved_classes != num_classes):
        fail(
            f"--resume {path}: a checkpoint of --arch {saved_arch or '?'} with {saved_classes or '?'} classes; this "
            f"run is --arch {arch} with {num_classes} classes: give the checkpoint of this model, or its flags"
        )


def restore_schedule(lr_scheduler, training, saved, global_step, log):
    """The schedule as saved when nothing that shapes it changed; otherwise (more --epochs, another batch size,
    --grad-acc or number of ranks, another --lr-scheduler) the new schedule, from the step this setting has reached."""
    saved_args = saved["args"]
    saved_total = saved.get("total_steps")
    same = (
        saved_total == training.total_steps
        and global_step == saved["global_step"]
        and saved_args.get("lr_scheduler", lr_scheduler) == lr_scheduler
        and (saved.get("optimizer") is None or same_grouping(training.optimizer, saved["optimizer"]))  # its lrs
    )
    if same:
        training.scheduler.load_state_dict(saved["scheduler"])
        return
    if global_step > training.total_steps:  # past this run's end: main() says there is nothing to train
        return
    fast_forward(training.scheduler, global_step)
    log(
        f"the learning-rate schedule ({lr_scheduler}) is rebuilt for {training.total_steps} optimizer steps and "
        f"continues from step {global_step} (the checkpoint's had {saved_total or '?'}, at step {saved['global_step']})"
    )


def record_best(best_metric, ema_judges, epoch, validation, state, metrics) -> bool:
    """Whether this epoch's validation is the run's best by --best-metric (the first of equals stays the best; by the
    EMA's figures with --ema-judges); the best so far goes into `state` (checkpointed with it) and the metrics."""
    if best_metric == "none":
        return False
    judged = "ema_" if ema_judges else ""  # --ema-judges: the EMA's figures
    value = validation[judged + VALIDATION_METRICS[best_metric][0]]
    if not math.isfinite(validation[judged + "val_loss"]):  # a model whose outputs are nan is never the best
        return False
    best = state.best_value is None or value > state.best_value  # (a resume keeps it for the same metric only)
    if best:
        state.best_metric, state.best_value, state.best_epoch = best_metric, value, epoch + 1
    metrics.update(best_metric=state.best_metric, best_value=state.best_value, best_epoch=state.best_epoch)
    return best
