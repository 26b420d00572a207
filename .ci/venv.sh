# Sourced by .ci/run: create (or reuse) the project's venv outside the clone, keyed by requirements.txt.
set -eu
req_hash=$(sha256sum requirements.txt | cut -c1-16)
VENV="${DLOJZ_VENV:-$HOME/.cache/dlojz/venv-$req_hash}"
source .ci/make_venv.sh
make_venv "$VENV" -r requirements.txt
# The tests' own packages (requirements-test.txt), into the same venv: once per version of that file.
test_hash=$(sha256sum requirements-test.txt | cut -c1-16)
if [ ! -f "$VENV/.complete-test-$test_hash" ]; then
    "$VENV/bin/pip" install --quiet -r requirements-test.txt
    touch "$VENV/.complete-test-$test_hash"
fi
export PATH="$VENV/bin:$PATH"
