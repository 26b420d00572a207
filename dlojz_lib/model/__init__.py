"""The model wing: a run's model by name and whole, before any layout cuts it. `zoo` creates a model by name
(torchvision, timm) and holds its facts (FLOPs, memory, peak FLOP/s), BlurPool and the EMA; `recompute` activation
checkpointing (whole stages or a family's blocks, full or selective);
`pretrained` gives the weights to start from (`--pretrained`, `--initial-checkpoint`, the new head); `families` holds
one row per model family the layouts know (its blocks, stem and head, its tensor-parallel plan; a new row by
`register_family`); `tensor_plans` the plans a row carries (timm's blocks, torchvision's ViT's); `float8` the
linears of a family's blocks `--float8` trains in float8 (torchao's); `build` makes the run's model from the flags (`build_model`: created, loaded, adapted,
checkpointed, its EMA, its family resolved once), which `dlojz_lib.parallelism` then lays out. It imports nothing:
import the module you need."""
