#!/bin/sh
# Install a C compiler and libjpeg-turbo's headers (Debian/Ubuntu packages) so that dlojz_lib/data/jpeg.c can be compiled
# and the region-decoding path is the one tested. Idempotent: does nothing when both are there. Without root or
# apt-get it says so and exits 0; dlojz then decodes whole images and tests/data/test_jpeg.py skips with the reason
# (except test_region_decoding_is_built_in_ci, which fails under CI=true on purpose), and .ci/run fails under CI=true.
set -eu
if command -v cc >/dev/null 2>&1 && [ -f /usr/include/jpeglib.h ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install_jpeg_build.sh: needs root and apt-get to install gcc and libjpeg-dev" >&2
    exit 0
fi
echo "installing gcc and libjpeg-dev"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends gcc libc6-dev libjpeg-dev >/dev/null
