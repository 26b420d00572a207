"""The samplers: which images each rank gets, in which order, each epoch, as (epoch, index) pairs so that the random
augmentation of a sample depends only on (seed, epoch, index): identical whatever the number of workers and after a
resume.

- `EpochSampler`: training's (DistributedSampler's order, resumable mid-epoch, a last batch of one left out).
- `RepeatedAugmentationSampler`: --ra-reps, each epoch 1/N of the images N times (DeiT's, torchvision's).
- `BalancedEpochSampler`: --balanced-sampler, every class drawn equally often.
- `ShardSampler`: validation's, each image on exactly one rank, no padding (exact validation).
"""

import torch


class EpochSampler(torch.utils.data.DistributedSampler):
    """DistributedSampler that yields (epoch, index) and can start mid-epoch (`skip` samples already seen).

    The last, incomplete batch is kept (every image trains every epoch, the step count is the ceiling), except when
    it would hold a single image: BatchNorm cannot normalise a batch of one in training, and one extra file in a
    data set would crash the epoch. That image then waits for the next epoch, where the shuffle puts it elsewhere;
    every rank has the same share, so all of them leave it out together. `batch_size`: the per-rank (micro-)batch."""

    def __init__(self, dataset, num_replicas, rank, shuffle=True, seed=0, drop_last=False, batch_size=None):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.skip = 0
        alone = batch_size and batch_size > 1 and self.num_samples > 1 and self.num_samples % batch_size == 1
        self.trained = self.num_samples - 1 if alone and not drop_last else self.num_samples

    def __iter__(self):
        indices = self.rank_indices()[: self.trained][self.skip :]
        return iter([(self.epoch, i) for i in indices])

    def rank_indices(self):
        """This rank's share of the epoch's order: DistributedSampler's shuffle of every image once."""
        return list(super().__iter__())

    def __len__(self):
        return self.trained - self.skip


class RepeatedAugmentationSampler(EpochSampler):
    """--ra-reps N: repeated augmentation (torchvision's RASampler, the "v2" recipes'): the epoch's shuffled order
    with each image N times in a row, dealt out to the ranks in turn, so that its N copies go to N different ranks
    (with N ranks or more) in the same step, each under its own augmentation (the sample key carries the copy).
    Each rank gets as many samples as EpochSampler gives it (the same steps per epoch): an epoch sees about 1/N of
    the distinct images, N times each. Resumes and ranks as EpochSampler (the order comes from seed and epoch)."""

    def __init__(self, dataset, num_replicas, rank, reps, seed=0, drop_last=False, batch_size=None):
        super().__init__(
            dataset, num_replicas, rank, shuffle=True, seed=seed, drop_last=drop_last, batch_size=batch_size
        )
        self.reps = reps

    def epoch_draws(self):
        """Every rank's (index, copy) draws of this epoch, before they are dealt out."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator).tolist()
        return [(i, copy) for i in order for copy in range(self.reps)]

    def __iter__(self):
        draws = self.epoch_draws()[self.rank :: self.num_replicas][: self.trained][self.skip :]
        return iter([(self.epoch, i, copy) for i, copy in draws])


class BalancedEpochSampler(EpochSampler):
    """--balanced-sampler: an epoch of as many draws as the data set has images (the same steps per epoch), every
    class drawn equally often (the remainder to classes chosen at random), each class's images repeated as evenly
    as its quota allows (random orders of the class, one after the other), the whole then shuffled. The epoch's
    order comes from (seed, epoch) alone, the same on every rank, which takes every W-th draw as DistributedSampler
    does: exact across ranks, and a resumed run skips what it has done as with EpochSampler."""

    def __init__(self, dataset, num_replicas, rank, seed=0, drop_last=False, batch_size=None):
        super().__init__(
            dataset, num_replicas, rank, shuffle=True, seed=seed, drop_last=drop_last, batch_size=batch_size
        )
        targets = torch.as_tensor(dataset.targets)
        self.class_ids = targets.unique().tolist()  # the classes with training images
        self.by_class = [torch.nonzero(targets == c).flatten() for c in self.class_ids]  # their images

    def epoch_draws(self):
        """Every rank's draws of this epoch (`total_size` image indices), before they are dealt out."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        n_classes = len(self.by_class)
        quota = torch.full((n_classes,), self.total_size // n_classes)
        quota[torch.randperm(n_classes, generator=generator)[: self.total_size % n_classes]] += 1
        drawn = []
        for images, wanted in zip(self.by_class, quota.tolist()):
            rounds = -(-wanted // len(images))
            order = torch.cat([torch.randperm(len(images), generator=generator) for _ in range(rounds)])
            drawn.append(images[order[:wanted]])
        drawn = torch.cat(drawn)
        return drawn[torch.randperm(len(drawn), generator=generator)].tolist()

    def rank_indices(self):
        return self.epoch_draws()[self.rank : self.total_size : self.num_replicas]


class ShardSampler(torch.utils.data.Sampler):
    """Validation: rank r gets images r, r+W, r+2W... Every image counted once, none twice (no padding)."""

    def __init__(self, dataset, num_replicas, rank):
        self.indices = range(rank, len(dataset), num_replicas)

    def __iter__(self):
        return iter([(0, i) for i in self.indices])

    def __len__(self):
        return len(self.indices)
