"""What watches a run from beside its loop: `chrono` (the chronometer: per-phase timings true on a GPU, energy),
`chrono_report` (its figures, report lines, advice and timeline), `hooks` (the loop's observers: the chronometer,
torch.profiler, the LR finder) and `watchdog` (hung and straggling ranks, heartbeats through the store). It imports
nothing: import the module you need."""
