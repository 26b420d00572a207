#!/usr/bin/env bash
# GPU acceptance run: one command on one GPU node proves dlojz's CUDA paths and measures it against the anchors.
#     bash bench/gpu_acceptance.sh [PYTHON]        # default: python3; about 10 minutes on one H100
# 1. checks the GPU and the imports (installs nothing: says which wheels to bring);
# 2. runs the GPU tests (python -m pytest tests -m gpu);
# 3. runs ResNet-50 at 224 px, batch 256, AMP, channels-last: --synthetic --test (the GPU alone), then --test on
#    the embedded data set (decoding and augmentation in the DataLoader workers);
# 4. prints img/s, MFU and J/image beside NVIDIA DeepLearningExamples' and MLPerf's figures.
# Output folder: $OUT_DIR (default runs/gpu_acceptance_<time>). Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${1:-python3}"
OUT_DIR="${OUT_DIR:-runs/gpu_acceptance_$(date +%Y%m%d-%H%M%S)}"

if ! "$PYTHON" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    "$PYTHON" -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)' 2>&1 | tail -1
    command -v nvidia-smi >/dev/null && nvidia-smi -L 2>&1 | head -4
    echo "no CUDA GPU found: gpu_acceptance.sh needs a GPU node (and a torch built with CUDA)"
    exit 1
fi
missing=0
for module in torch torchvision numpy idr_torch timm PIL; do
    if ! "$PYTHON" -c "import $module" 2>/dev/null; then
        missing=1
        case $module in
            idr_torch) echo "missing: idr_torch (pure Python). On a machine with network: pip download --no-deps idr_torch==2.5.0;" \
                            "here: pip install --no-index --no-deps --target DIR idr_torch-2.5.0-*.whl; export PYTHONPATH=DIR" ;;
            *) echo "missing: $module (pip install $module, or load the site's module)" ;;
        esac
    fi
done
[ "$missing" = 0 ] || { echo "gpu_acceptance.sh: bring the packages above, then run it again"; exit 2; }
for module in wandb simplejpeg pynvml pytest; do
    "$PYTHON" -c "import $module" 2>/dev/null || echo "optional, absent: $module" \
        "$([ $module = pynvml ] && echo '(no energy figures: nvidia-ml-py)')$([ $module = pytest ] && echo '(the GPU tests are skipped)')"
done
mkdir -p "$OUT_DIR"
status=0

echo "=== GPU tests"
if "$PYTHON" -c "import pytest" 2>/dev/null; then
    "$PYTHON" -m pytest tests -m gpu -q -ra -p no:cacheprovider || status=1
fi

workers=$(( $(nproc) - 1 ))
common=(--test --no-wandb --arch resnet50 -b 256 --image-size 224 --val-resize-size 256 --val-crop-size 224
        --amp --channels-last --test-nsteps 100 --num-workers "$workers")
echo "=== ResNet-50, synthetic data (the GPU alone)"
"$PYTHON" dlojz.py --synthetic "${common[@]}" --output-dir "$OUT_DIR/synthetic" \
    --metrics-json "$OUT_DIR/synthetic.json" || status=1
echo "=== ResNet-50, embedded data set (JPEG decoding and augmentation in $workers workers)"
"$PYTHON" dlojz.py "${common[@]}" --output-dir "$OUT_DIR/data" --metrics-json "$OUT_DIR/data.json" || status=1

"$PYTHON" - "$OUT_DIR" <<'EOF'
import json, sys
from pathlib import Path
import torch
out = Path(sys.argv[1])
print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, ResNet-50 224 px, batch 256, AMP, channels-last")
print(f"{'run':<12}{'img/s':>10}{'MFU':>8}{'J/image':>10}{'step ms':>10}")
for name in ("synthetic", "data"):
    path = out / f"{name}.json"
    if not path.exists():
        print(f"{name:<12}{'failed':>10}")
        continue
    chrono = json.loads(path.read_text()).get("chrono", {})
    mfu, joules = chrono.get("mfu"), chrono.get("energy_per_image_j")
    print(f"{name:<12}{chrono.get('throughput_img_s', float('nan')):>10.0f}"
          f"{(f'{100 * mfu:.1f} %' if mfu else 'n/a'):>8}{(f'{joules:.3f}' if joules else 'n/a'):>10}"
          f"{1000 * chrono.get('step_median_s', float('nan')):>10.1f}")
print("anchors: NVIDIA DeepLearningExamples ResNet-50 AMP (DALI): 2,470 img/s per A100-80GB; "
      "MLPerf-class: ~7,000 img/s per H100")
EOF
[ "$status" = 0 ] && echo "gpu_acceptance.sh: all steps passed" || echo "gpu_acceptance.sh: a step failed (see above)"
exit "$status"
