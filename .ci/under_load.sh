#!/usr/bin/env bash
# The tests whose subject is timed (the pipeline lab's bubble, the data wait, a rank's end after another's) and the
# fused step compared across kernels, run twice in a row with two busy processes spinning beside them on the 2 cores:
# a test asserts behaviour, so a loaded machine (a login node, another job) must not turn it red.
# Run by .ci/run after the suite; by hand: bash .ci/under_load.sh (in the venv).
set -euo pipefail
cd "$(dirname "$0")/.."
spinners=()
for _ in 1 2; do
    python3 -c "while True: pass" &
    spinners+=($!)
done
trap 'kill "${spinners[@]}" 2>/dev/null || true' EXIT
tests=(
    "tests/parallelism/test_pipeline.py::test_the_pipeline_lab_prints_the_bubble_beside_its_formula"
    "tests/test_run_log.py::test_progress_line_carries_the_learning_rate_and_the_data_wait"
    "tests/test_run_log.py::test_the_data_wait_is_the_chronometer_s_load_phase"
    "tests/optim/test_optim.py::test_fused_step_skips_overflowed_steps_as_the_unfused_one"
    "tests/system/test_resume.py::test_a_killed_rank_ends_the_other_with_one_line_and_the_run_resumes_from_its_last_checkpoint"
)
for pass in 1 2; do
    echo "under load, pass $pass of 2: ${#tests[@]} tests beside 2 busy processes"
    python -m pytest -q -p no:cacheprovider "${tests[@]}"
done
