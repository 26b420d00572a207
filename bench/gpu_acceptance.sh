#!/usr/bin/env bash
# GPU acceptance run: one command on one GPU node proves dlojz's CUDA paths and measures ResNet-50 on the node.
#
#     bash bench/gpu_acceptance.sh [PYTHON]      # default PYTHON: python3; about 10 minutes on one H100
#
# Installs nothing: it runs the Python it is given (a venv's, or the site's module). Steps:
# 1. checks: a CUDA GPU visible to torch (else exit 1, last line "no CUDA GPU ..."), the imports dlojz needs
#    (else exit 2, naming the wheels to bring);
# 2. the GPU tests: $PYTHON -m pytest tests/test_gpu.py;
# 3. ResNet-50, 224 px, batch 256, AMP, channels-last, 100 steps of --test (chronometer on): with --synthetic (the
#    GPU alone), then through the real input pipeline (JPEG decoding and augmentation in nproc-1 DataLoader
#    workers, prefetcher, normalisation on the GPU);
# 4. dlojz's training step against a bare loop on a synthetic batch (bench/bench_train.py): its overhead;
# 5. a table of img/s, MFU and J/image beside NVIDIA DeepLearningExamples' and MLPerf's figures, and the ratio;
# 6. the course's ablation, one optimisation per row, and a cores-per-GPU table (bench/ablation.py; ABLATION=0 skips).
# The real-pipeline runs need 100 batches of 256 images an epoch: dlojz's embedded data set has 1,200 (5 batches,
# images of 96x80 px), so the same generator (dlojz_lib.data.embedded.make_embedded_dataset) writes, once, 25,600 +
# 500 JPEGs of ImageNet's size and weight (500x375 px, quality 90, grain 0.6: ~110 KB each, ~2.8 GB; an epoch is 33
# times DALI's prefetch) into $XDG_CACHE_HOME/dlojz (default ~/.cache/dlojz), reused by later runs;
# DATA_ROOT=/path/to/imagenet uses that folder instead (train/ and val/). STEPS (default 300) training steps a run,
# each run's unsynchronised img/s (--test's last half timed as a whole, the window paused across a validation: the
# real-data runs cross epochs of 100 steps and time as many steps as the synthetic one) beside the chronometer's.
# Output: $OUT_DIR (default runs/gpu_acceptance_<epoch seconds>): metrics JSONs, chronometer traces, timelines.
# Exit status: 0 when every step passed; 1 without a GPU or when a step failed; 2 when a package is missing.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PYTHON="${1:-python3}"
OUT_DIR="${OUT_DIR:-runs/gpu_acceptance_$(date +%s)}"

# ------------------------------------------------------------------ 1. checks
# One interpreter for the check and, without a GPU, what it found (each import of torch costs seconds): exit 0 with
# a GPU; 3 with torch but no GPU, after the torch line and dlojz's own driver check (it names both versions).
found_gpu=$("$PYTHON" -c '
import sys, torch
if torch.cuda.is_available():
    sys.exit(0)
print(f"torch {torch.__version__}, built for CUDA {torch.version.cuda}, GPUs visible to it: {torch.cuda.device_count()}")
try:
    import dlojz_lib.settings.config as c; print((c.driver_too_old() or "").lstrip(": "))
except Exception:
    pass
sys.exit(3)' 2>/dev/null)
status=$?
if [ "$status" != 0 ]; then
    echo "gpu_acceptance.sh: $PYTHON ($(command -v "$PYTHON" || echo 'not found'))"
    if [ "$status" = 3 ]; then
        printf '%s\n' "$found_gpu" | grep . || true
    else
        echo "torch does not import with $PYTHON: give the Python of the venv or module that has it"
    fi
    echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-<unset>}"
    if command -v nvidia-smi >/dev/null 2>&1; then
        nvidia-smi -L 2>&1 | head -8
    else
        echo "nvidia-smi: not found (no NVIDIA driver on this machine)"
    fi
    echo "no CUDA GPU found: gpu_acceptance.sh needs a GPU node (run it inside a GPU allocation, e.g. srun --gres=gpu:1)"
    exit 1
fi

missing=0
advice() {  # the wheel to bring for a missing module
    case $1 in
        idr_torch) echo "missing: idr_torch (pure Python). On a machine with network: pip download --no-deps idr_torch==2.5.0;" \
                        "copy the wheel here, then: $PYTHON -m pip install --no-index --no-deps --target DIR idr_torch-2.5.0-py3-none-any.whl" \
                        "and export PYTHONPATH=DIR:\$PYTHONPATH" ;;
        timm) echo "missing: timm (pure Python; LAMB, LARS, Lion). On a machine with network: pip download --no-deps timm;" \
                   "here: $PYTHON -m pip install --no-index --no-deps --target DIR timm-*.whl and export PYTHONPATH=DIR:\$PYTHONPATH" ;;
        pytest) echo "missing: pytest (pure Python: pip download pytest pluggy iniconfig packaging, then pip install --no-index" \
                     "--target DIR *.whl and PYTHONPATH=DIR; pytest-timeout too if you can)" ;;
        torch|torchvision) echo "missing: $1: use a Python that has PyTorch (module load pytorch-gpu/..., or a venv with" \
                                "torch==2.14.1 torchvision==0.29.1, or a CUDA 12 build: see docs/running.md)" ;;
        PIL) echo "missing: Pillow (pip download --no-deps pillow for this Python's version and platform)" ;;
        *) echo "missing: $1 (pip download --no-deps $1 on a machine with network, then pip install --no-index)" ;;
    esac
}
for module in torch torchvision numpy PIL idr_torch timm pytest; do
    "$PYTHON" -c "import $module" >/dev/null 2>&1 || { advice "$module"; missing=1; }
done
if [ "$missing" != 0 ]; then
    echo "gpu_acceptance.sh: bring the packages above, then run it again"
    exit 2
fi
for module in wandb simplejpeg pynvml matplotlib pytest_timeout; do
    if ! "$PYTHON" -c "import $module" >/dev/null 2>&1; then
        case $module in
            pynvml) why="no power and energy figures (nvidia-ml-py)" ;;
            simplejpeg) why="PIL decodes the JPEGs where the region decoder cannot be built" ;;
            matplotlib) why="no timeline plots" ;;
            wandb) why="not used here (--no-wandb)" ;;
            pytest_timeout) why="no per-test time limit" ;;
        esac
        echo "optional, absent: $module: $why"
    fi
done
"$PYTHON" -c 'import torch; print(f"GPU: {torch.cuda.get_device_name()} (x{torch.cuda.device_count()}), torch {torch.__version__}, CUDA {torch.version.cuda}")'
mkdir -p "$OUT_DIR" || exit 1
failed=()
started=$SECONDS
step_time() { echo "--- $1: $(( SECONDS - $2 )) s"; }

# ------------------------------------------------------------------ 2. the GPU tests
# only tests/test_gpu.py: collecting the whole suite would import optuna and DALI, which a node's module may lack
echo "=== GPU tests: $PYTHON -m pytest tests/test_gpu.py"
t=$SECONDS
"$PYTHON" -m pytest tests/test_gpu.py -q -ra -p no:cacheprovider || failed+=("GPU tests")
step_time "GPU tests" "$t"

# ------------------------------------------------------------------ 3. ResNet-50 runs
workers=$(( $(nproc) - 1 ))
[ "$workers" -ge 1 ] || workers=1
STEPS="${STEPS:-300}"
common=(--test --no-wandb --arch resnet50 -b 256 --image-size 224 --amp --channels-last --test-nsteps "$STEPS"
        --test-unsync-steps "$((STEPS / 2))")

echo "=== ResNet-50, synthetic data (the GPU alone)"
t=$SECONDS
"$PYTHON" dlojz.py --synthetic "${common[@]}" --output-dir "$OUT_DIR/synthetic" \
    --metrics-json "$OUT_DIR/synthetic.json" || failed+=("synthetic run")
step_time "synthetic run" "$t"

t=$SECONDS
data_root="${DATA_ROOT:-}"
if [ -z "$data_root" ]; then
    data_root="${XDG_CACHE_HOME:-$HOME/.cache}/dlojz/acceptance-500x375-110k-v2"
    echo "=== data: 10 classes x (2,560 train + 50 val) JPEGs of 500x375 px, ~110 KB, in $data_root (once)"
    "$PYTHON" - "$data_root" <<'EOF' || failed+=("data set")
import multiprocessing, os, shutil, sys
from pathlib import Path
sys.path.insert(0, os.getcwd())
from dlojz_lib.data.embedded import make_embedded_dataset

root = Path(sys.argv[1])
TRAIN, VAL = 2560, 50  # per class: 100 batches of 256, and 2 validation batches
if not (root / ".complete").exists():
    parts = max(1, min(len(os.sched_getaffinity(0)), 32))
    staging = root.with_name(f"{root.name}.tmp{os.getpid()}")

    def part(i):  # one slice of every class, its own seed
        return str(make_embedded_dataset(staging / f"part{i}", n_classes=10, train_per_class=-(-TRAIN // parts),
                                         val_per_class=-(-VAL // parts), size=(500, 375), seed=1000 + i,
                                         grain=0.6))
    with multiprocessing.get_context("fork").Pool(parts) as pool:
        done = pool.map(part, range(parts))
    count = 0
    for i, folder in enumerate(map(Path, done)):
        for image in sorted(folder.glob("*/*/*.JPEG")):
            target = staging / "data" / image.parent.relative_to(folder) / f"p{i:02d}_{image.name}"
            target.parent.mkdir(parents=True, exist_ok=True)
            image.rename(target)
            count += 1
    (staging / "data" / ".complete").write_text("gpu_acceptance.sh data set\n")
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(staging / "data", root)
    except OSError:  # another run finished first
        pass
    shutil.rmtree(staging, ignore_errors=True)
    print(f"written: {count} JPEGs")
train = sum(1 for _ in root.glob("train/*/*.JPEG"))
sizes = [p.stat().st_size for p in sorted(root.glob("train/*/*.JPEG"))[::97]]
print(f"{root}: {train} train images ({train // 256} batches of 256), {sum(sizes) / len(sizes) / 1024:.0f} KB each")
EOF
fi
echo "=== ResNet-50, real input pipeline ($data_root, $workers DataLoader workers)"
"$PYTHON" dlojz.py "${common[@]}" --data-root "$data_root" --val-resize-size 256 --val-crop-size 224 \
    --num-workers "$workers" --output-dir "$OUT_DIR/data" --metrics-json "$OUT_DIR/data.json" \
    || failed+=("real-pipeline run")
step_time "real-pipeline run (with the data set)" "$t"

# The input pipeline alone (--loader-only), CPU workers vs DALI on the GPU, each over 90 batches inside the first
# epoch (of 100 batches of 256) and over 300 that cross two epoch boundaries; then training fed by DALI, against
# --synthetic in the table (target: >= 0.97), and DALI's ablation rows: --dali-pad-channels, --dali-decode whole.
t=$SECONDS
loader=(--loader-only -b 256 --image-size 224 --amp --data-root "$data_root" --no-wandb --num-workers "$workers")
backends=(pytorch)
if "$PYTHON" -c "import nvidia.dali" 2>/dev/null; then
    backends+=(dali)
else
    echo "=== no DALI here (pip install nvidia-dali-cuda130): its rows are left out"
fi
for backend in "${backends[@]}"; do
    for span in 90 300; do
        echo "=== input pipeline alone: --data-backend $backend, $span batches"
        "$PYTHON" dlojz.py "${loader[@]}" --data-backend "$backend" --test-nsteps "$span" \
            --metrics-json "$OUT_DIR/loader_${backend}_$span.json" --output-dir "$OUT_DIR/loader_${backend}_$span" \
            || failed+=("loader-only $backend $span")
    done
done
if [[ " ${backends[*]} " == *" dali "* ]]; then
    "$PYTHON" dlojz.py "${common[@]}" --data-root "$data_root" --val-resize-size 256 --val-crop-size 224 \
        --num-workers "$workers" --data-backend dali --output-dir "$OUT_DIR/dali" --metrics-json "$OUT_DIR/dali.json" \
        || failed+=("DALI run")
    for variant in "--dali-pad-channels" "--dali-decode whole"; do
        name="dali_$(echo "${variant#--dali-}" | tr ' -' '__')"
        # shellcheck disable=SC2086  # (the variant's words are flags)
        "$PYTHON" dlojz.py "${common[@]}" --data-root "$data_root" --val-resize-size 256 --val-crop-size 224 \
            --num-workers "$workers" --data-backend dali $variant --output-dir "$OUT_DIR/$name" \
            --metrics-json "$OUT_DIR/$name.json" || failed+=("DALI run $variant")
    done
fi
step_time "input pipelines" "$t"

# dlojz's step against a bare loop (same model, batch, precision, memory format, synthetic batch): its overhead
t=$SECONDS
echo "=== dlojz --synthetic / bare loop (bench/bench_train.py)"
"$PYTHON" bench/bench_train.py --device cuda --arch resnet50 --batch-size 256 --image-size 224 --amp \
    --channels-last --steps 100 --json "$OUT_DIR/bench_train.json" || failed+=("dlojz / bare loop")
step_time "dlojz / bare loop" "$t"

# ------------------------------------------------------------------ 5. the table
"$PYTHON" - "$OUT_DIR" <<'EOF' || failed+=("table")
import json, sys
from pathlib import Path
import torch

out = Path(sys.argv[1])
try:
    import nvidia.dali
    dali = f", DALI {nvidia.dali.__version__}"
except ImportError:
    dali = ""
print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}{dali}: ResNet-50, 224 px, batch 256, AMP "
      f"float16, channels-last")
print(f"{'run':<22}{'img/s':>9}{'unsync img/s':>14}{'chrono img/s':>14}{'MFU':>8}{'J/image':>9}{'mean W':>8}"
      f"{'step ms':>9}{'load ms':>9}")


def cell(value, fmt):
    return "n/a" if value is None else format(value, fmt)


ROWS = (("synthetic", "synthetic"), ("data", "real pipeline"), ("dali", "DALI pipeline"),
        ("dali_pad_channels", "DALI, 4 channels"), ("dali_decode_whole", "DALI, whole decode"))
for name, label in ROWS:
    path = out / f"{name}.json"
    if name.startswith("dali") and not path.exists():
        continue
    if not path.exists():
        print(f"{label:<22}{'failed: no ' + path.name:>30}")
        continue
    m = json.loads(path.read_text())
    chrono = m.get("chrono", {})
    mfu = chrono.get("mfu")
    step, load = chrono.get("step_median_s"), chrono.get("load_median_s")
    print(f"{label:<22}{cell(m.get('images_per_second'), '.0f'):>9}"
          f"{cell(chrono.get('unsync_throughput_img_s'), '.0f'):>14}{cell(chrono.get('throughput_img_s'), '.0f'):>14}"
          f"{cell(None if mfu is None else 100 * mfu, '.1f') + (' %' if mfu is not None else ''):>8}"
          f"{cell(chrono.get('unsync_energy_per_image_j'), '.3f'):>9}{cell(chrono.get('unsync_mean_power_w'), '.0f'):>8}"
          f"{cell(None if step is None else 1e3 * step, '.1f'):>9}{cell(None if load is None else 1e3 * load, '.1f'):>9}"
          + ("  over the GPU's power limit" if any(f["window"] == "unsynchronised"
                                                  for f in chrono.get("over_power_limit", ())) else ""))
print("img/s: steady state, wall clock between synchronised log points; unsync img/s: the last half of the steps "
      "timed as a whole (no per-step wait); chrono img/s: batch / median(step + load); MFU: model FLOPs / dense peak; "
      "J/image and mean W: NVML over the unsync img/s's own window")
for backend, label in (("pytorch", "DataLoader ({} workers)"), ("dali", "DALI on the GPU ({} threads)")):
    for span, where in ((90, "inside an epoch"), (300, "across 2 epoch boundaries")):
        path = out / f"loader_{backend}_{span}.json"
        if path.exists():
            m = json.loads(path.read_text())
            threads = m.get("dali_threads") if backend == "dali" else m.get("num_workers")
            print(f"input pipeline alone, {label.format(threads)}, {span} batches {where}: "
                  f"{m['loader_images_per_second']:.0f} img/s (target for DALI: >= 7,000)")
runs = {name: json.loads((out / f"{name}.json").read_text()) for name in ("synthetic", "dali", "data")
        if (out / f"{name}.json").exists()}
for name, label in (("dali", "DALI"), ("data", "DataLoader")):
    if name in runs and "synthetic" in runs:
        figure = lambda run: run.get("chrono", {}).get("unsync_throughput_img_s") or run["images_per_second"]
        ratio = figure(runs[name]) / figure(runs["synthetic"])
        print(f"training through {label} / --synthetic, unsynchronised: {ratio:.3f} (target for DALI: >= 0.97)")
path = out / "bench_train.json"
if path.exists():
    labels = {"test": "--test (chronometer on)", "epoch": "a training epoch"}
    for name, row in json.loads(path.read_text()).items():
        print(f"dlojz --synthetic / bare loop, {labels.get(name, name)}: {row['dlojz']:.0f} / {row['bare']:.0f} "
              f"img/s = {row['ratio']:.3f} (target >= 0.97)")
print("anchors: NVIDIA DeepLearningExamples ResNet-50 AMP: 2,470 img/s per A100-80GB; "
      "MLPerf-class: ~7,000 img/s per H100")
EOF

# ------------------------------------------------------------------ 6. the course's ablation and cores per GPU
# One optimisation added per row (fp32 -> TF32 -> float16 -> channels-last -> compile -> CUDA graphs, then bfloat16
# eager and compiled apart), synthetic and real pipeline, each row's unsynchronised img/s beside the chronometer's,
# then training img/s with 2, 4, 8 and all cores for the pytorch backend and DALI.
# ABLATION=0 leaves it out (it is about as long as the steps above).
if [ "${ABLATION:-1}" != 0 ]; then
    t=$SECONDS
    echo "=== the ablation (bench/ablation.py)"
    "$PYTHON" bench/ablation.py --data-root "$data_root" --out "$OUT_DIR/ablation" || failed+=("ablation")
    step_time "ablation" "$t"
fi

echo "=== output: $OUT_DIR ($(( SECONDS - started )) s)"
if [ "${#failed[@]}" -ne 0 ]; then
    echo "gpu_acceptance.sh: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu_acceptance.sh: all steps passed"
