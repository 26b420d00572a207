"""Overhead of the dlojz chronometer per training step (target: < 2 % of a step).

Two measurements, CPU only (on a GPU each boundary also waits for the device, which is the point: the work would
have to finish anyway before the next step's host code can depend on it):
  1. toggle cost: a loop of empty steps (load, forward, backward toggles) enabled vs disabled, per step in µs,
     and as a share of a 10 ms step;
  2. A/B: steps of a 10 ms busy-wait with and without the chronometer, interleaved to share the machine's noise.

Run from the repository root: ``python bench/bench_chrono.py [--steps 300] [--step-ms 10]``.
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dlojz_lib.checks import OneLineArgumentParser  # noqa: E402
from dlojz_lib.observers.chrono import Chronometer  # noqa: E402
from dlojz_lib.settings.flags import COUNT, POSITIVE  # noqa: E402


def toggled_step(chrono, work):
    chrono.dataload()
    chrono.dataload()
    chrono.forward()
    work()
    chrono.forward()
    chrono.backward()
    chrono.backward()


def busy_wait(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def toggle_cost_us(enabled, n):
    chrono = Chronometer(enabled, device="cpu", nvml=None)
    chrono.start()
    t0 = time.perf_counter()
    for _ in range(n):
        toggled_step(chrono, lambda: None)
    return (time.perf_counter() - t0) / n * 1e6


def main():
    parser = OneLineArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=COUNT, default=300, help="steps per A/B arm (default 300)")
    parser.add_argument("--step-ms", type=POSITIVE, default=10.0, help="simulated step in ms (default 10)")
    parser.add_argument("--toggle-loops", type=COUNT, default=100_000, help="empty steps for the toggle cost")
    args = parser.parse_args()
    step_s = args.step_ms / 1e3

    enabled_us = toggle_cost_us(True, args.toggle_loops)
    disabled_us = toggle_cost_us(False, args.toggle_loops)
    print(
        f"toggle cost per step (6 toggles): enabled {enabled_us:.2f} µs = {enabled_us / (step_s * 1e6):.3%} "
        f"of a {args.step_ms:g} ms step; disabled {disabled_us:.2f} µs"
    )

    # A/B, interleaved in blocks of 10 steps so both arms see the same machine load.
    chrono = Chronometer(True, device="cpu", nvml=None)
    chrono.start()
    with_chrono, without = [], []
    for _ in range(args.steps // 10):
        t0 = time.perf_counter()
        for _ in range(10):
            toggled_step(chrono, lambda: busy_wait(step_s))
        with_chrono.append((time.perf_counter() - t0) / 10)
        t0 = time.perf_counter()
        for _ in range(10):
            busy_wait(step_s)
        without.append((time.perf_counter() - t0) / 10)
    a, b = statistics.median(with_chrono), statistics.median(without)
    print(
        f"A/B {args.steps} steps of {args.step_ms:g} ms: median with chronometer {a * 1e3:.4f} ms, "
        f"without {b * 1e3:.4f} ms: overhead {(a - b) / b:+.3%} (noise included)"
    )
    print(f"chronometer's own median step: {chrono.summary({})['step_median_s'] * 1e3:.4f} ms")


if __name__ == "__main__":
    main()
