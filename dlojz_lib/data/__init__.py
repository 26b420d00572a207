"""The data: listing and samplers (datasets), DataLoaders (loaders), decoding and augmentation (transforms, jpeg),
the device side (prefetch), DALI (dali) and packed shards (shards)."""
