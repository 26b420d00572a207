"""`dlojz_lab.py plan --probe FILE` (dlojz_lib/parallelism/probe.py): the roofline's figures measured where the plan
runs, saved in FILE and reused while the model, image size, -b, dtype and ranks match; and each collective's latency
(`--latency-us`, `--network-latency-us`, or probed) in the roofline's step, one latency a collective the row counts."""

import json
import subprocess

import pytest
from conftest import ROOT, clean_env, script_python

import dlojz_lab  # noqa: E402

PLANNED = ["plan", "--arch", "timm:test_vit", "--image-size", "32", "--num-classes", "3", "-b", "4"]


def header(out):
    return next(line for line in out.splitlines() if line.startswith("timm:test_vit: "))


def test_the_probe_measures_the_model_s_flops_saves_them_and_reuses_them(tmp_path, capsys, monkeypatch):
    """One process: --probe FILE times the model's step and the header gives the FLOP/s it reached (not the H100's
    989 TFLOP/s); FILE holds them with the key they were measured for; the next plan reads FILE without measuring
    (measure_job not called); a plan of another -b measures again and says why."""
    from dlojz_lib.parallelism import probe

    path = tmp_path / "figures" / "probe.json"
    assert dlojz_lab.main([*PLANNED, "--probe", str(path)]) == 0
    out = capsys.readouterr().out
    record = json.loads(path.read_text())
    assert record["key"] == dict(arch="timm:test_vit", image_size=32, batch_size=4, amp_bytes=2, ranks=1)
    assert set(record["figures"]) == {"tflops"} and 0 < record["figures"]["tflops"] < 10  # (a CPU's: GFLOP/s)
    assert f"{record['figures']['tflops']:.4g} TFLOP/s" in header(out) and "probed" in header(out), out
    assert f"--probe {path}: measured in " in out

    def measured_again(settings):
        raise AssertionError("measured again")

    monkeypatch.setattr(probe, "measure_job", measured_again)
    assert dlojz_lab.main([*PLANNED, "--probe", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"--probe {path}: the figures measured {record['measured']} on " in out
    assert f"{record['figures']['tflops']:.4g} TFLOP/s" in header(out)
    monkeypatch.setattr(probe, "measure_job", lambda settings: ({"tflops": 123.0}, 0, 1))
    assert dlojz_lab.main([*PLANNED[:-1], "8", "--probe", str(path)]) == 0
    out = capsys.readouterr().out
    assert "measuring again" in out and "123 TFLOP/s" in header(out), out
    assert json.loads(path.read_text())["key"]["batch_size"] == 8
    assert [p.name for p in path.parent.iterdir()] == ["probe.json"]  # (no temporary file left)


def test_a_probe_file_that_is_not_one_is_refused_in_one_line(tmp_path, capsys):
    """A FILE that is not a probe's (damaged, another tool's) is refused in one line naming it, exit 2, and kept."""
    path = tmp_path / "probe.json"
    for text in ("{not json", json.dumps({"format": 1, "figures": {"speed": 1}}), "[]"):
        path.write_text(text)
        assert dlojz_lab.main([*PLANNED, "--probe", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"dlojz_lab.py: error: --probe {path}: not a probe file ("), err
        assert len(err.splitlines()) == 1 and path.read_text() == text


def test_each_collective_pays_its_latency_in_the_roofline_s_step():
    """With nothing hidden (overlap 0), every row's step grows by its collectives a step (group by group, as the
    runs call them: tests/parallelism/test_planner.py) times the latency of the link they go over, / (1 - bubble)."""
    from dlojz_lib.parallelism.plan import GPUS, Allocation, LayoutTable, plan, spans_nodes

    settings = LayoutTable("timm:test_vit", 32, 3, 4, pp_microbatches=4)
    figures = dict(GPUS["h100"], gpus_per_node=2, overlap=0.0)
    free = {row["layout"]: row for row in plan(settings, Allocation(2, **dict(figures, latency_us=0.0,
                                                                           network_latency_us=0.0)))[0]}  # fmt: skip
    allocation = Allocation(2, **dict(figures, latency_us=7.0, network_latency_us=30.0))
    rows = plan(settings, allocation)[0]
    assert {"DDP", "FSDP", "HSDP 2 x FSDP 2", "TP 2 x FSDP 2", "PP 2 x FSDP 2"} <= {row["layout"] for row in rows}
    for row in rows:
        latency = sum(
            calls * (30.0 if spans_nodes(group, row["tp"], row["pp"], allocation) else 7.0) * 1e-6
            for group, calls in row["collectives_by_group"].items()
        )
        assert latency > 0, row["layout"]
        added = latency / (1 - row.get("bubble", 0.0))
        assert row["step_s"] - free[row["layout"]]["step_s"] == pytest.approx(added, rel=1e-9), row["layout"]


def test_the_latency_flags_reach_the_roofline(capsys):
    """--latency-us and --network-latency-us: the header says them and a plan's steps grow with them."""

    def steps(*flags):
        assert dlojz_lab.main([*PLANNED, "--nodes", "2", "--gpus-per-node", "2", *flags]) == 0
        out = capsys.readouterr().out
        rows = [line.split() for line in out.splitlines() if line.startswith(("DDP", "FSDP", "HSDP", "TP", "PP"))]
        return header(out), {" ".join(row[:-8]): float(row[-2]) for row in rows}

    _, nominal = steps("--latency-us", "0", "--network-latency-us", "0")
    said, inside = steps("--latency-us", "500", "--network-latency-us", "0")
    assert "a collective 500 µs inside a node, 0 µs across" in said, said
    said, across = steps("--latency-us", "0", "--network-latency-us", "500")
    assert "a collective 0 µs inside a node, 500 µs across" in said, said
    for name in ("TP 2 x FSDP 2", "HSDP 2 x FSDP 2"):  # (a tensor group, HSDP's shards: inside a node)
        assert inside[name] > nominal[name], (name, inside, nominal)
    for name in ("DDP", "FSDP", "HSDP 2 x FSDP 2"):  # (their data groups: across the nodes)
        assert across[name] > nominal[name], (name, across, nominal)
    assert inside["DDP"] == nominal["DDP"]


@pytest.mark.multirank
def test_a_probe_under_torchrun_measures_the_links_and_one_rank_says_the_plan(tmp_path):
    """torchrun, 2 CPU ranks: FILE holds the slowest rank's FLOP/s and its node's bandwidth, latency and overlap
    (all-reduces between the ranks); the plan is printed once, with those figures."""
    path = tmp_path / "probe.json"
    proc = subprocess.run(  # (the ranks: forks of the tests' preloaded server, as torchrun starts them)
        [*script_python(), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(ROOT / "dlojz_lab.py"), *PLANNED, "--gpus-per-node", "2", "--probe", str(path)],
        capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(path.read_text())
    figures = record["figures"]
    assert set(figures) == {"tflops", "nvlink_gbs", "latency_us", "overlap"} and record["key"]["ranks"] == 2
    assert figures["nvlink_gbs"] > 0 and figures["latency_us"] > 0 and 0 <= figures["overlap"] <= 1
    said = [line for line in proc.stdout.splitlines() if line.startswith("timm:test_vit: ")]
    assert len(said) == 1 and f"NVLink {figures['nvlink_gbs']:.4g} GB/s" in said[0], proc.stdout
    assert f"a collective {figures['latency_us']:.3g} µs inside a node" in said[0], said
    assert proc.stdout.count("pick: ") == 1
