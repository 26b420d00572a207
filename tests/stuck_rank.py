"""dlojz.py as a rank that stays alive but never enters the log point's all-reduce from its second log point on
(it loops in Python instead): the rank the watchdog must name as stuck (tests/system/test_watchdog.py)."""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dlojz  # noqa: E402

log_points = 0
agree_on_stop = dlojz.agree_on_stop


def skipping(*args):
    global log_points
    log_points += 1
    while log_points >= 2:  # alive (its watchdog thread beats), outside the collective the other rank waits in
        time.sleep(0.5)
    return agree_on_stop(*args)


dlojz.agree_on_stop = skipping
sys.exit(dlojz.cli(sys.argv[1:]))
