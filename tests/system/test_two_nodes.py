"""dlojz on two Slurm nodes: `sbatch -N 2 --ntasks-per-node 1` of slurm/dlojz_cpu.slurm on the two-node test
cluster of tests/slurm_cluster.py (two slurmd in network namespaces of their own on this machine): one gloo process
group across both "nodes", and a validation identical to one process's. Without Slurm, root or iproute2 it is
skipped with the reason (under CI=true: fails). About 40 s: the cluster's start and one short training job. The jobs'
Pythons are fresh interpreters, each in its node's namespace (a fork of the tests' preloaded server would run in this
machine's, with the other node's network).
"""

import json
import time

from slurm_cluster import slurm_two_nodes  # noqa: F401  (the session fixture)
from test_slurm import CPU_SCRIPT, ROOT, job_env, show


def test_two_nodes_train_in_one_process_group_and_validate_like_one_process(
    slurm_two_nodes, tmp_path, tiny_data, run_inline
):
    cluster = slurm_two_nodes
    metrics_path, out = tmp_path / "metrics.json", tmp_path / "run"
    env = dict(job_env(cluster, fresh_interpreters=True), GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
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


def test_a_lost_node_is_left_out_and_the_same_job_finishes_on_the_other_from_its_last_checkpoint(
    slurm_two_nodes, tmp_path, tiny_data
):
    """Node 2 is "lost" mid-run (its slurmd and every process in its namespace killed, as a node that loses power):
    the rank on node 1 ends with one line naming it (exit status 4); the job's script (dlojz_srun, with --no-kill)
    finds that node 2 no longer answers and runs the training again on node 1 alone, inside the same allocation: the
    same job ends COMPLETED, from the last (mid-epoch) checkpoint, with the global batch kept (--grad-acc 2 on one
    rank), within 2 minutes of the loss. Last in this file: node 2 is started again after it."""
    cluster = slurm_two_nodes
    out, metrics_path = tmp_path / "run", tmp_path / "metrics.json"
    env = dict(
        job_env(cluster, fresh_interpreters=True),
        GLOO_SOCKET_IFNAME="eth0",
        OMP_NUM_THREADS="1",
        DLOJZ_NODE_CHECK_S="10",
    )
    flags = ["--no-wandb", "--epochs", "4", "--data-root", tiny_data, "--num-workers", "0", "--output-dir", out]
    job = cluster.submit(
        ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--no-requeue", f"--output={tmp_path}/job.out"]
        + [CPU_SCRIPT, *flags, "--checkpoint-every", "1e-9", "--metrics-json", metrics_path],
        cwd=ROOT,
        env=env,
    )
    cluster.wait_for_output(tmp_path / "job.out", "min: epoch 2, step", timeout=120, job_id=job)
    lost = cluster.lose_node(1)
    lost_at = time.monotonic()
    try:
        result = cluster.wait(job, timeout=300)
        finished_in = time.monotonic() - lost_at
        print(f"the job finished {finished_in:.0f} s after node 2 was lost")  # (pytest -s: the figure for the docs)
    finally:
        cluster.restore_node(1)
    assert result.state == "COMPLETED", show(result)  # the same job: no requeue, no second submission
    log = result.output_text()
    errors = [line for line in log.splitlines() if line.startswith("dlojz: error:")]
    assert len(errors) == 1 and errors[0].startswith(f"dlojz: error: rank 1 ({lost}) stopped answering"), show(result)
    restarts = [line for line in log.splitlines() if line.startswith("dlojz_srun: restart")]
    assert len(restarts) == 1 and restarts[0].startswith("dlojz_srun: restart 1/3 at "), show(result)
    # from the last checkpoint written before the loss (mid-epoch 2, or later on a loaded machine), which it resumes
    assert f"exit status 4; nodes left out: {lost}; on {cluster.nodes[0]} from {out}/ckpt_e000" in restarts[0]
    resumed_from = restarts[0].rsplit(" from ", 1)[1]
    assert (
        "--keep-global-batch: 1 rank x 16 images x --grad-acc 2 keep the checkpoint's global batch of 32 images "
        "(2 ranks x 16 x 1)" in log
    ), show(result)
    assert f"resumed from {resumed_from}" in log and "Epoch [4/4]" in log, show(result)
    metrics = json.loads(metrics_path.read_text())
    assert metrics["world_size"] == 1 and metrics["global_batch_size"] == 32 and metrics["epochs"] == 4, metrics
    assert finished_in < 120, f"the job finished {finished_in:.0f} s after node 2 was lost"
