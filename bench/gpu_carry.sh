#!/usr/bin/env bash
# What a lent GPU machine lacks for bench/gpu_session.py (its image has torch 2.11 + CUDA 13, timm, nvidia-ml-py,
# matplotlib; no DALI, torchao, idr_torch or simplejpeg, and no network), prepared here where pip reaches the
# registry, so that the machine's minutes go to measuring:
#
#     bash bench/gpu_carry.sh prepare      # here: the wheels for its Python 3.12, cut into pieces (~1 min)
#     bash bench/gpu_carry.sh install      # there: the pieces joined, the wheels installed into /tmp/dlojz-site
#
# prepare downloads (pip download --no-deps, manylinux x86-64, CPython 3.12) nvidia-dali-cuda130 2.4.0 and what it
# needs that the image lacks (nvidia-nvimgcodec-cu13 0.9, astunparse, gast, optree, nvtx, makefun, libcst; nvCOMP,
# nvJPEG2000 and nvTIFF stay behind: the session decodes JPEGs), torchao 0.18.0, idr_torch 2.5.0 and simplejpeg;
# packs them into one tar and cuts it into pieces of at most 56 MiB, one ignored folder each (.gpu_carry/part1 ...),
# so that a device call carries one piece beside the working tree (~6 MiB) within the 64 MiB a call takes. The
# device calls, back to back while the machine is warm (it keeps what an earlier call left), are in
# docs/benchmarks.md: one call per piece, the last one joining them (install) and running the session.
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY="${DLOJZ_CARRY:-.gpu_carry}"  # (the tests give their own folder)
SITE=/tmp/dlojz-site
PIECE=56M
WHEELS=(
    nvidia-dali-cuda130==2.4.0 "nvidia-nvimgcodec-cu13>=0.9.0,<0.10.0" astunparse==1.6.3 gast==0.7.0 optree nvtx
    makefun "libcst~=1.8" torchao==0.18.0 idr_torch==2.5.0 simplejpeg
)

case "${1:-}" in
    prepare)
        rm -rf "$CARRY" && mkdir -p "$CARRY/wheels"
        platforms=()
        for tag in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
            platforms+=(--platform "${tag}_x86_64")
        done
        python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            "${platforms[@]}" -d "$CARRY/wheels" "${WHEELS[@]}"
        tar -cf "$CARRY/wheels.tar" -C "$CARRY/wheels" .
        split -b "$PIECE" -d -a 2 "$CARRY/wheels.tar" "$CARRY/piece."
        n=0
        for piece in "$CARRY"/piece.*; do
            n=$((n + 1))
            mkdir -p "$CARRY/part$n" && mv "$piece" "$CARRY/part$n/"
        done
        (cd "$CARRY/wheels" && sha256sum ./*.whl) > "$CARRY/part$n/SHA256SUMS"
        rm -rf "$CARRY/wheels" "$CARRY/wheels.tar"
        echo "gpu_carry.sh: $(ls "$CARRY"/part*/piece.* | wc -l) pieces of at most $PIECE in $CARRY/part1..part$n:"
        du -sh "$CARRY"/part* ;;
    install)
        pieces=("$CARRY"/part*/piece.*)
        [ -e "${pieces[0]}" ] || { echo "gpu_carry.sh install: no $CARRY/part*/piece.* here: carry each part first"; exit 2; }
        rm -rf /tmp/dlojz-wheels && mkdir -p /tmp/dlojz-wheels
        sums=$(realpath "$(ls "$CARRY"/part*/SHA256SUMS | head -1)")
        { printf '%s\n' "${pieces[@]}" | sort -t. -k3 -n | xargs cat | tar -xf - -C /tmp/dlojz-wheels \
            && (cd /tmp/dlojz-wheels && sha256sum --quiet -c "$sums"); } >/dev/null 2>&1 \
            || { echo "gpu_carry.sh install: a piece is missing or cut short (checksums differ): carry them again"; exit 2; }
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            /tmp/dlojz-wheels/*.whl
        echo "gpu_carry.sh: installed into $SITE: export PYTHONPATH=$SITE:\$PYTHONPATH" ;;
    *)
        echo "usage: bash bench/gpu_carry.sh prepare|install (see its header)"
        exit 2 ;;
esac
