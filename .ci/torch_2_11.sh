#!/usr/bin/env bash
# dlojz on the GPU machines' torch (2.11, the oldest torch that torchao 0.18 loads its kernels with), on this CPU:
# a venv with torch 2.11.0 / torchvision 0.26.0 and the rest of requirements.txt, then `python dlojz.py --test`
# and the `not slow` tier. Not part of .ci/run (its venv is a second torch); by hand, after a change that calls a
# torch API newer than 2.11:
#
#     bash .ci/torch_2_11.sh            # the venv once (~2 min from the registry), then ~2 min of tests
#
# The venv lives outside the clone, keyed by this file and requirements.txt (~/.cache/dlojz/venv-torch2.11-<hash>).
set -euo pipefail
cd "$(dirname "$0")/.."
key=$(cat "$0" requirements.txt requirements-test.txt | sha256sum | cut -c1-16)
VENV="${DLOJZ_VENV_2_11:-$HOME/.cache/dlojz/venv-torch2.11-$key}"
rest=$(mktemp)  # requirements.txt but its torch and torchvision pins
trap 'rm -f "$rest"' EXIT
grep -v -E '^(torch|torchvision)==' requirements.txt > "$rest"
source .ci/make_venv.sh
make_venv "$VENV" torch==2.11.0 torchvision==0.26.0 -r "$rest" -r requirements-test.txt
export PATH="$VENV/bin:$PATH"
python -c "import torch, torchvision, torchao; print('torch', torch.__version__, 'torchvision', torchvision.__version__, 'torchao', torchao.__version__)"
start=$(date +%s)
python dlojz.py --test --arch resnet18 --image-size 32 -b 8 --test-nsteps 4 --epochs 1 --output-dir "$(mktemp -d)"
python -m pytest tests -q -ra -n 2 --dist loadfile -m "not slow" -p no:cacheprovider
echo "torch 2.11 check: green in $(( $(date +%s) - start )) s of dlojz.py --test and the not-slow tier"
