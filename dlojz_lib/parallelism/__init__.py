"""The model laid out on several ranks, once `dlojz_lib.model.build` has built it whole: `layout` lays it out for
the run (`lay_out`: DDP or FSDP, tensor and pipeline parallelism, torch.compile), `fsdp` shards the model and
checkpoints the shards, `tensor` splits its transformer blocks over a tensor-parallel group, `pipeline` cuts it into
stages, `bubble` times the stages' wait for each other (the bubble) against its formula, `plan` computes each
layout's bytes per GPU and bytes sent on a meta-device model (the day-4 table, the planner), `block_figures`
what a transformer block of the tensor plan keeps and sends there, `sends` the bytes and collectives a layout sends
a step, `probe` the planner's FLOP/s, bandwidths and latencies measured where the job runs. Each reads the model's
family from the build (`dlojz_lib.model.families`). It imports nothing: import the module you need."""
