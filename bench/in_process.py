"""dlojz's training loop run in-process on --synthetic batches, for the benchmarks and the tests: the arguments of
dlojz.train_one_epoch built from a command line as main() builds them, without data, W&B, checkpoints or signal
handlers. `bench_train.py` times dlojz's own loop with it against a bare PyTorch loop.

    loop = synthetic_loop(["--arch", "resnet18", "-b", "32"], n_batches=50)
    dlojz.train_one_epoch(**loop)
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # dlojz.py's folder: the library beside it

from dlojz_lib.data.loaders import SYNTHETIC_CLASSES, synthetic_loaders  # noqa: E402
from dlojz_lib.dist import StopPoll, StopSignal, setup_distributed  # noqa: E402
from dlojz_lib.log import Console, NoWandb, Progress  # noqa: E402
from dlojz_lib.model.build import build_model  # noqa: E402
from dlojz_lib.observers.chrono import Chronometer  # noqa: E402
from dlojz_lib.observers.hooks import LoopHooks  # noqa: E402
from dlojz_lib.optim.training import build_training  # noqa: E402
from dlojz_lib.parallelism.layout import lay_out  # noqa: E402
from dlojz_lib.resume import TrainState  # noqa: E402
from dlojz_lib.settings.config import resolve_config  # noqa: E402
from dlojz_lib.settings.flags import get_args_parser  # noqa: E402


def synthetic_loop(argv, n_batches):
    """The arguments of train_one_epoch for `argv` on --synthetic batches, `n_batches` per epoch and rank: the
    training loop run in-process by benchmarks and tests, without data, W&B, checkpoints or signal handlers."""
    return synthetic_run(argv, n_batches)[1]


def synthetic_run(argv, n_batches):
    """(the run's Config, synthetic_loop's arguments of train_one_epoch): for a caller that also reads the flags."""
    cfg = resolve_config(get_args_parser().parse_args([*argv, "--synthetic"]))
    ranks, cfg = setup_distributed(cfg)
    log = Console(ranks.is_main)
    built = build_model(cfg, SYNTHETIC_CLASSES, ranks, log)
    model = lay_out(built, cfg, ranks, log)
    loaders = synthetic_loaders(
        cfg,
        SYNTHETIC_CLASSES,
        ranks,
        n_batches * cfg.batch_size * ranks.world_size,
        cfg.val_batch_size * ranks.world_size,
    )
    training = build_training(cfg, model, loaders.n_train_batches, SYNTHETIC_CLASSES, ranks, log)
    progress = Progress(
        log,
        NoWandb(),
        ranks.device,
        cfg.epochs,
        loaders.n_train_batches,
        cfg.grad_acc,
        cfg.batch_size * ranks.world_size,
    )
    return cfg, dict(
        model=model,
        training=training,
        loaders=loaders,
        state=TrainState(),
        ranks=ranks,
        hooks=LoopHooks(Chronometer(enabled=cfg.test, device=ranks.device), None, training.lr_finder, ranks.enabled),
        progress=progress,
        stop=StopPoll(StopSignal(), ranks),
        test_steps=cfg.test_nsteps if cfg.test else None,
        output_dir=cfg.output_dir,
    )
