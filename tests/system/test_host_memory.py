"""Training on a CPU does not page-fault its activations in afresh at every step: glibc keeps freed memory."""

import subprocess
import sys

import pytest
from conftest import ROOT, clean_env

PROBE = """
import resource, statistics, sys, torch
if sys.argv[1] == "tuned":
    import dlojz_lib.dist
    assert dlojz_lib.dist.keep_freed_host_memory()
faults = []
for _ in range(12):  # an activation-sized tensor (64 MiB) made and freed, as each step does
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.ones(16 * 2**20)
    del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(statistics.median(faults[-6:]))
"""


def faults_per_allocation(mode):
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, mode], capture_output=True, text=True, timeout=120, cwd=ROOT, env=clean_env()
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return float(proc.stdout.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_memory_is_reused_without_page_faults():
    plain = faults_per_allocation("plain")
    assert plain > 10_000  # glibc's default: 16,384 pages mapped afresh for each 64 MiB tensor
    assert faults_per_allocation("tuned") < plain / 20
