# slurm/dlojz_env.sh - THE one place where dlojz jobs get their Python environment.
# Sourced by every slurm/dlojz_*.slurm script, from the project directory, before `srun`.
#
# Jean Zay (or any site with modules): uncomment these two lines and delete the venv block below.
#   module purge
#   module load pytorch-gpu/py3/2.5.0
#
# Otherwise a Python virtual environment is used, first match wins:
#   1. $DLOJZ_VENV, if you set it (e.g. `DLOJZ_VENV=$WORK/venvs/dlojz sbatch slurm/dlojz_1gpu.slurm`);
#   2. the environment already active when you ran sbatch (sbatch exports your PATH and
#      VIRTUAL_ENV / CONDA_PREFIX by default, so it just works);
#   3. the venv that `.ci/run` creates: ~/.cache/dlojz/venv-<hash of requirements.txt>.
if [ -n "${DLOJZ_VENV:-}" ]; then
    dlojz_venv="$DLOJZ_VENV"
elif [ -n "${VIRTUAL_ENV:-}${CONDA_PREFIX:-}" ]; then
    dlojz_venv=""   # already active
else
    dlojz_venv="$HOME/.cache/dlojz/venv-$(sha256sum requirements.txt | cut -c1-16)"
fi
if [ -n "$dlojz_venv" ]; then
    if [ ! -f "$dlojz_venv/bin/activate" ]; then
        echo "slurm/dlojz_env.sh: no Python venv at $dlojz_venv: set DLOJZ_VENV, activate one before sbatch, or edit slurm/dlojz_env.sh (module load)" >&2
        exit 1
    fi
    # shellcheck disable=SC1091
    source "$dlojz_venv/bin/activate"
fi

# Launch settings shared by all jobs (not site-specific).
# Since Slurm 22.05 srun no longer inherits sbatch's --cpus-per-task: pass it on explicitly,
# otherwise each task (and its DataLoader workers) would be squeezed onto one core.
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
    export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
fi
# One CPU thread pool per task, sized to the task's cores (no oversubscription between ranks).
export OMP_NUM_THREADS="${SLURM_CPUS_PER_TASK:-1}"
# Python output straight to the Slurm log (also `python -u` below).
export PYTHONUNBUFFERED=1
