"""dlojz's library, under the commands at the project's root (dlojz.py, dlojz_chrono.py, dlojz_hpo.py, dlojz_lab.py,
dlojz_pack.py, dlojz_fsdp.py). Nothing is imported here: `import dlojz_lib.flags` stays torch-free.

- the command line to a checked Config, no torch: checks (one-line errors, guarded readers), flags, recipe, config,
  launch;
- the run: dist (ranks, signals, lost peers), model, parallel (DDP, FSDP, compile), fsdp, optim, checkpoint, resume,
  log, hooks, chrono_report;
- data/: where images come from and how they reach the device; pack/: the shard writer's parts; hpo/ and lab/: the
  search's and the lab's files and reports.
"""
