"""dlojz's library, under the commands at the project's root (dlojz.py, dlojz_chrono.py, dlojz_hpo.py, dlojz_lab.py,
dlojz_pack.py, dlojz_fsdp.py, dlojz_avg.py, dlojz_predict.py, dlojz_export.py; each through one door,
`checks.command`), by concept: the command line before torch (settings/), the run's pieces (the model, model/; its
layout, parallelism/; optim/, observers/), the data (data/), and the commands' libraries (pack/, hpo/, lab/). docs/architecture.md is the map: every module, its layer, and where an errand
goes. Nothing is imported here: `import dlojz_lib.settings.flags` stays torch-free.
"""
