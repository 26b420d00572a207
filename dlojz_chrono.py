"""The course's chronometer, by its course name: ``from dlojz_chrono import Chronometer`` in a training script, and
``python dlojz_chrono.py plot TRACE.json -o timeline.png`` for a run's per-step timeline.

The chronometer itself is dlojz_lib/observers/chrono.py (how it times truthfully on a GPU, the unsynchronised window, energy),
its report and plot dlojz_lib/observers/chrono_report.py; docs/chronometer.md reads its figures.
"""

import sys

if __name__ == "__main__":  # the command: its one door open before torch is imported (a Ctrl-C there: one line)
    from dlojz_lib.observers.chrono_report import main

    sys.exit(main())

from dlojz_lib.observers.chrono import Chronometer, EnergyMeter  # noqa: E402, F401  (the course's import)
