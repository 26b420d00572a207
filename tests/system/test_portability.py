"""dlojz runs on the PyTorch a GPU node already has: the packages a run does not use are imported only when used.

A GPU image (or `module load pytorch-gpu/...`) has torch, torchvision and often timm, but maybe no wandb,
simplejpeg, matplotlib or nvidia-ml-py. Here they are made unimportable for a subprocess run."""

from conftest import SMALL, clean_env, read_json, run_dlojz, show

BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is not installed here (blocked by the test)")
sys.meta_path.insert(0, Blocker())
"""

OPTIONAL = ("wandb", "simplejpeg", "matplotlib", "pynvml", "timm")


def test_a_run_needs_none_of_the_optional_packages(tmp_path, tiny_data):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=set(OPTIONAL)))
    metrics = tmp_path / "metrics.json"
    proc = run_dlojz(
        *SMALL,
        "--arch",
        "resnet18",  # torchvision's: timm is one of the packages left out
        "--data-root",
        tiny_data,
        "--test",
        "--test-nsteps",
        "3",
        "--no-wandb",
        "--metrics-json",
        metrics,
        "--output-dir",
        tmp_path / "run",
        env=clean_env(PYTHONPATH=str(site)),
    )
    assert proc.returncode == 0, show(proc)
    assert read_json(metrics)["steps"] == 3
    assert "simplejpeg" not in proc.stdout.split("JPEG decoding:")[1].splitlines()[0]  # really not imported


def test_a_flag_that_needs_a_missing_package_names_it(tmp_path, tiny_data):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked={"timm"}))
    proc = run_dlojz(
        *SMALL,
        "--arch",
        "resnet18",  # torchvision's: timm is the package left out
        "--synthetic",
        "--test",
        "--test-nsteps",
        "1",
        "--optimizer",
        "lamb",
        "--output-dir",
        tmp_path / "run",
        env=clean_env(PYTHONPATH=str(site)),
    )
    assert proc.returncode == 2, show(proc)
    assert proc.stderr.strip().splitlines()[-1].startswith("dlojz: error: --optimizer lamb needs timm"), show(proc)
