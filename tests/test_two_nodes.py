"""dlojz on two Slurm nodes: `sbatch -N 2 --ntasks-per-node 1` of slurm/dlojz_cpu.slurm on the two-node test
cluster of tests/slurm_cluster.py (two slurmd in network namespaces of their own on this machine): one gloo process
group across both "nodes", and a validation identical to one process's. Without Slurm, root or iproute2 it is
skipped with the reason (under CI=true: fails). About 40 s: the cluster's start and one short training job.
"""

import json

from slurm_cluster import slurm_two_nodes  # noqa: F401  (the session fixture)
from test_slurm import CPU_SCRIPT, ROOT, job_env, show


def test_two_nodes_train_in_one_process_group_and_validate_like_one_process(
    slurm_two_nodes, tmp_path, tiny_data, run_inline
):
    cluster = slurm_two_nodes
    metrics_path, out = tmp_path / "metrics.json", tmp_path / "run"
    env = dict(job_env(cluster), GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
    job = cluster.submit(
        [
            "--nodes=2",
            "--ntasks=2",
            "--ntasks-per-node=1",
            f"--output={tmp_path}/%x_%j.out",
            CPU_SCRIPT,
            "--no-wandb",
            "--epochs",
            "1",
            "--data-root",
            tiny_data,
            "--num-workers",
            "0",
            "--metrics-json",
            metrics_path,
            "--output-dir",
            out,
        ],
        cwd=ROOT,
        env=env,
    )
    result = cluster.wait(job, timeout=300)
    assert result.state == "COMPLETED", show(result)
    assert result.info.get("NumNodes") == "2", result.info
    metrics = json.loads(metrics_path.read_text())
    assert metrics["world_size"] == 2 and metrics["val_images"] == 15, metrics
    log = result.output_text()
    assert "on 2 nodes and 2 processes" in log, show(result)
    # The same weights validated by one process: the same figures.
    checkpoint = out / (out / "latest").read_text().strip()
    alone = run_inline(
        "--device", "cpu", "--arch", "resnet18", "--image-size", "32", "--val-resize-size", "36",
        "--val-crop-size", "32", "-b", "16", "--no-wandb", "--num-workers", "0", "--data-root", tiny_data,
        "--eval-only", "--resume", checkpoint, "--output-dir", tmp_path / "alone", "--metrics-json", tmp_path / "a.json",
    )  # fmt: skip
    assert alone.returncode == 0, alone.stderr
    one = json.loads((tmp_path / "a.json").read_text())
    assert one["val_images"] == metrics["val_images"]
    assert abs(one["val_loss"] - metrics["val_loss"]) < 1e-6 and one["val_accuracy"] == metrics["val_accuracy"]


def test_a_lost_node_ends_the_job_with_one_line_and_a_relaunch_finishes_from_the_last_checkpoint(
    slurm_two_nodes, tmp_path, tiny_data
):
    """Node 2 is "lost" mid-run (its slurmd and every process in its namespace killed, as a node that loses power):
    the rank on node 1 ends with one line naming it and exit status 4, and the job relaunched on node 1 alone goes
    on from the last (mid-epoch) checkpoint to the end. Last in this file: node 2 is started again after it."""
    cluster = slurm_two_nodes
    out = tmp_path / "run"
    env = dict(job_env(cluster), GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
    flags = ["--no-wandb", "--epochs", "20", "--data-root", tiny_data, "--num-workers", "0", "--output-dir", out]
    first = cluster.submit(
        ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--no-requeue", f"--output={tmp_path}/first.out"]
        + [CPU_SCRIPT, *flags]
        + ["--checkpoint-every", "1e-9"],
        cwd=ROOT,
        env=env,
    )
    cluster.wait_for_output(tmp_path / "first.out", "min: epoch 2, step", timeout=120, job_id=first)
    lost = cluster.lose_node(1)
    try:
        result = cluster.wait(first, timeout=120)  # the node declared DOWN after SlurmdTimeout (10 s here)
        assert result.state in ("NODE_FAIL", "FAILED"), show(result)
        log = result.output_text()
        errors = [line for line in log.splitlines() if line.startswith("dlojz: error:")]
        assert len(errors) == 1 and errors[0].startswith(f"dlojz: error: rank 1 ({lost}) stopped answering"), show(
            result
        )
        assert "task 0: Exited with exit code 4" in log, show(result)
        # Relaunched for 3 epochs in all (the schedule rebuilt for them): the rest of epoch 2, and epoch 3.
        relaunch = cluster.submit(
            ["--nodes=1", "--ntasks=1", f"--nodelist={cluster.nodes[0]}", f"--output={tmp_path}/again.out"]
            + [CPU_SCRIPT, *flags, "--epochs", "3"],
            cwd=ROOT,
            env=env,
        )
        again = cluster.wait(relaunch, timeout=300)
        assert again.state == "COMPLETED", show(again)
        text = again.output_text()
        assert f"resumed from {out}/ckpt_e" in text and "Epoch [3/3]" in text, show(again)
    finally:
        cluster.restore_node(1)
