"""The model as it trains on several ranks: `build` makes it for the run's layout (BlurPool, SyncBN, channels-last,
EMA, DDP or FSDP, tensor and pipeline parallelism, torch.compile), `families` holds one row per model family the
layouts know (its blocks, stem and head, whether tensor parallelism splits it), `fsdp` shards the model and
checkpoints the shards, `tensor` splits its transformer blocks over a tensor-parallel group, `pipeline` cuts it into
stages. It imports nothing: import the module you need."""
