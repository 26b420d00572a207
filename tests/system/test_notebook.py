"""notebooks/dlojz_lab.ipynb executed headless (nbclient) against the tests' one-node Slurm cluster, in its CPU
profile on the tiny data set: it submits a sweep through the lab's functions, follows the queue to the end, shows
a run's chronometer report and timeline, and compares the runs; the test reads what its cells produced."""

import base64
import json

import pytest
from conftest import ROOT
from slurm_cluster import slurm_cluster  # noqa: F401  (the session fixture)

nbformat = pytest.importorskip("nbformat", reason="pip install -r requirements-test.txt (.ci/run does)")
nbclient = pytest.importorskip("nbclient", reason="pip install -r requirements-test.txt (.ci/run does)")

NOTEBOOK = ROOT / "notebooks" / "dlojz_lab.ipynb"


def outputs(cell, kind):
    """A cell's printed text (kind "text") or its PNG images (kind "png", as bytes)."""
    found = []
    for out in cell.get("outputs", []):
        if kind == "text" and out.get("output_type") == "stream":
            found.append(out["text"])
        elif kind == "png" and "image/png" in out.get("data", {}):
            found.append(base64.b64decode(out["data"]["image/png"]))
    return "".join(found) if kind == "text" else found


def test_the_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    assert code and all(not cell.outputs and cell.execution_count is None for cell in code)
    assert sum("parameters" in cell.metadata.get("tags", []) for cell in code) == 1


def test_the_lab_notebook_runs_a_sweep_on_slurm_and_compares_it(slurm_cluster, tiny_data, tmp_path, monkeypatch):  # noqa: F811
    from test_slurm import job_env

    for name, value in job_env(slurm_cluster).items():  # the kernel, and the jobs it submits, inherit them
        monkeypatch.setenv(name, value)
    for name in ("DLOJZ_DATA", "ALL_CCFRSCRATCH", "DSDIR"):
        monkeypatch.delenv(name, raising=False)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    parameters = next(cell for cell in nb.cells if "parameters" in cell.metadata.get("tags", []))
    assert 'PROFILE = "gpu"' in parameters.source
    parameters.source = parameters.source.replace('PROFILE = "gpu"', 'PROFILE = "cpu"') + (
        f'\nRUNS_DIR = {str(tmp_path / "runs")!r}\nSWEEP = "nb"\nDLOJZ_FLAGS += ["--data-root", {str(tiny_data)!r}]\n'
    )
    follow = next(cell for cell in nb.cells if "lab.follow(SWEEP, every=5)" in cell.source)
    follow.source = follow.source.replace("every=5", "every=1")  # a user's 5 s between looks; the test's 1 s
    client = nbclient.NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}}
    )
    client.execute()
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    text = [outputs(cell, "text") for cell in code]
    submit = next(t for t in text if "submitted job array" in t)
    assert "sweep nb: 4 runs" in submit, submit
    sweep = tmp_path / "runs" / "nb"
    runs = [run["name"] for run in json.loads((sweep / "sweep.json").read_text())["runs"]]
    follow = next(t for t in text if ": running" in t or ": pending" in t or ": done" in t)
    assert all(f"{run}: done" in follow for run in runs), follow
    report_cell = next(cell for cell in code if "=>>> Step time" in outputs(cell, "text"))
    assert "=>>> Data loading:" in outputs(report_cell, "text")
    assert len(outputs(report_cell, "png")) == 1  # the first run's timeline
    compare_cell = code[-1]
    table = outputs(compare_cell, "text").splitlines()
    for run in runs:  # each run a row, with its own img/s
        metrics = json.loads((sweep / run / "metrics.json").read_text())
        settings = run.replace("batch-size=", "").replace("channels-last=", "").split("_")
        row = next(line for line in table if line.split()[1:3] == settings)
        assert row.split()[3] == "done" and f"{metrics['chrono']['throughput_img_s']:.0f}" in row.split()[4:6], row
    images = outputs(compare_cell, "png")
    # throughput/memory and phases; no accuracy plot: --test runs validate once
    assert len(images) == 2 and all(png[:4] == b"\x89PNG" and len(png) > 5_000 for png in images)
