"""The data: layouts and listing on disk (layout), data sets and samplers (datasets), DataLoaders (loaders),
decoding and augmentation (transforms, jpeg), the device side (prefetch), DALI (dali) and packed shards (shards)."""

# ImageNet-1k's sizes: the epoch and validation set of --synthetic (a constant here, where reading it imports no torch).
IMAGENET_TRAIN_IMAGES = 1_281_167
IMAGENET_VAL_IMAGES = 50_000
