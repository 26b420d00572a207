"""A run's settings, from the command line to the checked `Config`, before torch is imported: `flags` (the flag
table, the number types with bounds), `flag_checks` (the flags' combinations, one check per topic), `recipe` (recipe
files, `args.toml`), `launch` (the launcher's variables: Slurm, torchrun), `layout` (the run's layout as one typed
record, `Layout`, and the layout flags' defaults and rules) and `config` (the checked, frozen `Config`, the
profile's defaults filled; its set-up reads a few of the run's pieces inside functions, once the flags are checked).
It imports nothing: `import dlojz_lib.settings.flags` stays torch-free."""
