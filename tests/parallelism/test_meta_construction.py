"""Models built on the meta device under --fsdp (parallelism/fsdp.py: to_meta, fill_from_first_rank), on 2 gloo
processes: the first rank builds the model whole, the other its shapes only; each rank's stage and shard start from
the weights one process builds with the same seed, parameter for parameter and buffer for buffer, under --fsdp,
--tp 2 and --pp 2 (cut by parameters and by time), and the random generators go on as one process's."""

import os

import pytest
import torch

FLAGS = ["--device", "cpu", "--image-size", "32", "-b", "4"]
CASES = {
    "fsdp": ["--arch", "timm:test_resnet", "--fsdp"],  # BatchNorm's statistics and counts: buffers
    "tp": ["--arch", "timm:test_vit", "--fsdp", "--tp", "2"],  # q, k and v: thirds of timm's fused qkv
    "pp": ["--arch", "timm:test_vit", "--fsdp", "--pp", "2"],
    "pp-time": ["--arch", "timm:test_vit", "--fsdp", "--pp", "2", "--pp-split", "time"],
    # the starting weights read by the first rank alone, the others' parts filled from them
    "initial": ["--arch", "timm:test_vit", "--fsdp", "--pp", "2", "--initial-checkpoint", "start.pt"],
}


def full(tensor):
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def one_process(cfg):
    """The tensors and the generator's state of the model one process builds with `cfg`'s seed."""
    from dlojz_lib.model.zoo import create_model
    from dlojz_lib.parallelism.fsdp import named_tensors

    torch.manual_seed(cfg.seed)
    model = create_model(cfg.arch, 3, cfg.zero_init_residual, cfg.image_size, cfg.drop_path)
    return dict(named_tensors(model)), torch.get_rng_state()


def build_on_rank(rank, world, store_path, results, folder):
    """Each case's build_model on this rank, against one process's model: (rank, case, the device create_model
    built on, the paths of the tensors this rank holds, those whose values differ, whether the random generator
    is where one process's is)."""
    import torch.distributed as dist

    from dlojz_lib.dist import Distribution, model_parallel_mesh
    from dlojz_lib.model import build
    from dlojz_lib.parallelism.fsdp import named_tensors
    from dlojz_lib.parallelism.layout import lay_out
    from dlojz_lib.parallelism.tensor import fused_state_dict
    from dlojz_lib.settings.config import resolve_config
    from dlojz_lib.settings.flags import get_args_parser

    torch.set_num_threads(1)
    os.chdir(folder)  # the default --output-dir is made and checked writable
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world)
    built_on = []
    create_model = build.create_model

    def noted(*args):
        model = create_model(*args)
        built_on.append(next(model.parameters()).device.type)
        return model

    build.create_model = noted
    if rank == 0:  # another seed's weights, to start from
        torch.manual_seed(1)
        torch.save(create_model("timm:test_vit", 3, None, 32).state_dict(), "start.pt")
    dist.barrier()
    try:
        for case, flags in CASES.items():
            cfg = resolve_config(get_args_parser().parse_args([*FLAGS, *flags]))
            expected, generator = one_process(cfg)
            if cfg.initial_checkpoint is not None:
                expected = torch.load(cfg.initial_checkpoint)
            ranks = Distribution(world, rank, rank, torch.device("cpu"))
            if cfg.tp > 1 or cfg.pp > 1:
                model_parallel_mesh(ranks, cfg.pp, cfg.tp)
            torch.manual_seed(cfg.seed)
            model = lay_out(build.build_model(cfg, 3, ranks, lambda line: None), cfg, ranks, lambda line: None)
            held = fused_state_dict({path: full(t).detach() for path, t in named_tensors(model.module)})
            differ = [path for path, t in held.items() if path not in expected or not torch.equal(t, expected[path])]
            same_draws = torch.equal(torch.get_rng_state(), generator)
            results.put((rank, case, built_on.pop(), sorted(held), differ, same_draws, sorted(expected)))
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """{case: {rank: (built on, paths held, paths whose values differ, same generator, one process's paths)}}."""
    from conftest import spawn_ranks

    folder = tmp_path_factory.mktemp("meta-build")
    found = {}
    for rank, case, *rest in spawn_ranks(build_on_rank, 2, folder, folder, timeout=200):
        found.setdefault(case, {})[rank] = rest
    return found


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES)
def test_each_rank_starts_from_the_weights_of_one_process_built_whole_on_the_first_only(built, case):
    ranks = built[case]
    assert ranks[0][0] == "cpu" and ranks[1][0] == "meta", "only the first rank builds the model whole"
    held = set()
    for rank, (_, paths, differ, same_draws, expected) in ranks.items():
        assert not differ, f"rank {rank} starts from other values than one process's: {differ}"
        assert same_draws, f"rank {rank}'s random generator is not where one process's is"
        held.update(paths)
    assert held == set(expected), "the ranks together hold the whole model"
