# slurm/dlojz_restart.sh - a lost node or a hung rank costs minutes, not the job. Sourced by the training scripts
# (slurm/dlojz_cpu.slurm, dlojz_1node.slurm, dlojz_multinode.slurm, dlojz_fsdp.slurm), which start dlojz with
#     dlojz_srun python -u dlojz.py --resume auto --keep-global-batch ...
# instead of srun. dlojz_srun runs the training step with srun on the job's nodes; when the step ends with exit
# status 4 (a rank lost: a node down, a process killed) or 7 (a rank hung: dlojz's watchdog), or when a node stopped
# answering, it runs the step again inside the same allocation, on the nodes that pass a check, at most
# DLOJZ_MAX_RESTARTS times (3 by default). It checks every node at once with slurm/dlojz_node_check.sh, which
# waits there for the old step's processes to leave its GPUs and runs one CUDA operation on each GPU, each node
# within DLOJZ_NODE_CHECK_S seconds (120); a node that fails or does not answer is left out, its reason in the log.
# (Slurm may list a lost node's step for minutes: the check waits on the nodes, where the processes are.) The
# run goes on from its last checkpoint (--resume auto) with its global batch (--keep-global-batch raises --grad-acc
# on fewer ranks). `#SBATCH --no-kill` keeps the allocation when Slurm declares a node down. Each restart is one
# line in the job's log: when, the exit status, the nodes left out, the checkpoint it goes on from. When no node is
# left, or the batch host itself is lost (this script runs there), the job ends and Slurm's requeue takes over.

# The value of --output-dir in the arguments, if given: where the restart's checkpoint is named.
dlojz_output_dir() {
    while [ "$#" -gt 0 ]; do
        if [ "$1" = "--output-dir" ] && [ "$#" -gt 1 ]; then
            echo "$2"
            return
        fi
        shift
    done
}

# srun "$@" for one training step; its exit status. srun itself may wait for the tasks of a node that no longer
# answers until Slurm declares the node down (SlurmdTimeout: minutes): once a task has ended the step with exit
# status 4 or 7 (srun says so on its stderr), srun is given DLOJZ_STEP_GRACE_S seconds (10) to end, then stopped,
# and the task's status is the step's.
dlojz_step() {
    local said pid ended_at="" status=""
    said=$(mktemp)
    srun --no-kill=off --kill-on-bad-exit=1 "$@" 2> >(tee -a "$said" >&2) &
    pid=$!
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        if [ -z "$ended_at" ] && grep -qE "task [0-9]+: Exited with exit code (4|7)$" "$said"; then
            ended_at=$SECONDS
        fi
        if [ -n "$ended_at" ] && [ $(( SECONDS - ended_at )) -ge "${DLOJZ_STEP_GRACE_S:-10}" ]; then
            status=$(grep -oE "Exited with exit code (4|7)$" "$said" | head -n 1 | grep -oE "[0-9]+$")
            kill -9 "$pid" 2>/dev/null
            break
        fi
    done
    wait "$pid"
    local srun_status=$?
    rm -f "$said"
    return "${status:-$srun_status}"
}

# The node check that dlojz_srun runs on each node, found beside this file.
DLOJZ_NODE_CHECK="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/dlojz_node_check.sh"

# The restart loop's settings are whole numbers: one line naming the variable and exit status 2 otherwise (a
# non-number would compare as an error in every round, and restart forever).
dlojz_check_settings() {
    local name value unit
    for name in DLOJZ_MAX_RESTARTS DLOJZ_NODE_CHECK_S DLOJZ_STEP_GRACE_S DLOJZ_GPU_FREE_S DLOJZ_GPU_PROBE_S; do
        value="${!name-}"
        unit=seconds
        [ "$name" = DLOJZ_MAX_RESTARTS ] && unit=restarts
        if [ -n "${!name+set}" ] && ! [[ "$value" =~ ^[0-9]+$ ]]; then
            echo "dlojz_srun: error: $name='$value' is not a whole number of $unit; give one (e.g. $name=3), or unset it for the default" >&2
            return 2
        fi
    done
}

dlojz_srun() {
    dlojz_check_settings || return 2
    local max="${DLOJZ_MAX_RESTARTS:-3}" restarts=0 status node nodes up left_out latest
    local -a list
    nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | paste -sd, -)
    local tasks_per_node=$(( ${SLURM_NTASKS:-1} / ${SLURM_JOB_NUM_NODES:-1} ))
    local output_dir
    output_dir=$(dlojz_output_dir "$@")
    while true; do
        IFS=, read -ra list <<< "$nodes"
        status=0
        # --overlap: a step that srun stopped waiting for may hold the nodes' resources until Slurm ends it
        dlojz_step --overlap --nodes="${#list[@]}" --ntasks=$(( ${#list[@]} * tasks_per_node )) \
            --nodelist="$nodes" "$@" || status=$?
        [ "$status" -eq 0 ] && return 0
        # every node checked at once (a GPU's check may wait for the old step's processes): pid per node
        local -A checks=()
        for node in "${list[@]}"; do
            timeout "${DLOJZ_NODE_CHECK_S:-120}" srun --overlap --nodes=1 --ntasks=1 --nodelist="$node" \
                bash "$DLOJZ_NODE_CHECK" >/dev/null &
            checks[$node]=$!
        done
        up="" left_out=""
        for node in "${list[@]}"; do
            if wait "${checks[$node]}"; then
                up="${up:+$up,}$node"
            else
                left_out="${left_out:+$left_out,}$node"
            fi
        done
        if [ "$status" -ne 4 ] && [ "$status" -ne 7 ] && [ -z "$left_out" ]; then
            return "$status"  # the run's own end (bad input, a crash, a stop): nothing a restart would mend
        fi
        if [ -z "$up" ]; then
            echo "dlojz_srun: exit status $status and no node of the job answers: the job ends (Slurm's requeue, if any, takes over)" >&2
            return "$status"
        fi
        if [ "$restarts" -ge "$max" ]; then
            echo "dlojz_srun: exit status $status after $max restarts (DLOJZ_MAX_RESTARTS): the job ends" >&2
            return "$status"
        fi
        restarts=$(( restarts + 1 ))
        latest="its last checkpoint"
        if [ -n "$output_dir" ] && [ -f "$output_dir/latest" ]; then
            latest="$output_dir/$(cat "$output_dir/latest")"
        fi
        echo "dlojz_srun: restart $restarts/$max at $(date '+%F %T'): exit status $status; nodes left out: ${left_out:-none}; on $up from $latest" >&2
        nodes="$up"
    done
}
