# Sourced by .ci/venv.sh and .ci/torch_2_11.sh: `make_venv DIR PIP_ARGS...` creates the venv DIR (outside the clone)
# with `pip install PIP_ARGS...`, or reuses it when a complete one is there (a `.complete` marker: an install cut
# short is made again).
make_venv() {
    local venv=$1
    shift
    if [ ! -x "$venv/bin/python" ] || [ ! -f "$venv/.complete" ]; then
        echo "creating venv $venv (torch is large: a few minutes)"
        rm -rf "$venv"
        python3 -m venv "$venv"
        "$venv/bin/pip" install --quiet --upgrade pip
        "$venv/bin/pip" install --quiet "$@"
        touch "$venv/.complete"
    fi
}
