# slurm/dlojz_node_check.sh - whether this node can take a restarted training step: run on each node by dlojz_srun
# (slurm/dlojz_restart.sh) as `srun --nodelist=NODE bash slurm/dlojz_node_check.sh`; exit 0 when it can.
# A node that answers may still hold the old step: a process killed with -9 leaves its GPU only once the driver has
# freed its memory, and a GPU hung in a kernel answers `true` as readily as a sound one. So, on a node with GPUs
# (nvidia-smi there), this waits up to DLOJZ_GPU_FREE_S seconds (60) for no compute process to be left on its
# GPUs, then runs one CUDA operation on each GPU with the training's Python (DLOJZ_PYTHON, default python), given
# DLOJZ_GPU_PROBE_S seconds (30) in all. Any failure is one line naming the node and the GPU, and exit status 1: the
# node is left out of the restart. A node without nvidia-smi (a CPU job) answers at once.

node="${SLURMD_NODENAME:-$(hostname)}"
command -v nvidia-smi >/dev/null 2>&1 || exit 0
say() { echo "dlojz_node_check: $node: $*" >&2; }
if ! gpus=$(timeout 30 nvidia-smi --query-gpu=index --format=csv,noheader 2>&1); then
    say "nvidia-smi does not answer ($(echo "$gpus" | tail -n 1)): left out"
    exit 1
fi
deadline=$(( SECONDS + ${DLOJZ_GPU_FREE_S:-60} ))
while true; do
    held=$(timeout 30 nvidia-smi --query-compute-apps=pid,gpu_bus_id --format=csv,noheader 2>/dev/null | paste -sd ' ' -)
    [ -z "$held" ] && break
    if [ "$SECONDS" -ge "$deadline" ]; then
        say "processes still on its GPUs after ${DLOJZ_GPU_FREE_S:-60} s (pid, GPU: $held): left out"
        exit 1
    fi
    sleep 1
done
# One small operation per GPU, read back: a GPU hung in a kernel or lost never prints its "ok".
probe='import torch
for i in range(torch.cuda.device_count()):
    torch.ones(1, device=f"cuda:{i}").add_(1).item()
    print(f"gpu {i} ok", flush=True)'
said=$(timeout "${DLOJZ_GPU_PROBE_S:-30}" "${DLOJZ_PYTHON:-python}" -c "$probe" 2>&1)
status=$?
n_ok=$(grep -c "^gpu [0-9]* ok$" <<< "$said")
n_gpus=$(grep -c . <<< "$gpus")
if [ "$status" -ne 0 ] || [ "$n_ok" -lt "$n_gpus" ]; then
    why="exit status $status"
    [ "$status" -eq 124 ] && why="no answer in ${DLOJZ_GPU_PROBE_S:-30} s (hung or lost)"
    say "GPU $n_ok (of $n_gpus) does not run one operation ($why; $(tail -n 1 <<< "$said")): left out"
    exit 1
fi
