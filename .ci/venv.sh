# Sourced by .ci/run: create (or reuse) the project's venv outside the clone, keyed by requirements.txt.
set -eu
req_hash=$(sha256sum requirements.txt | cut -c1-16)
VENV="${DLOJZ_VENV:-$HOME/.cache/dlojz/venv-$req_hash}"
if [ ! -x "$VENV/bin/python" ] || [ ! -f "$VENV/.complete" ]; then
    echo "creating venv $VENV (torch is large: a few minutes)"
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet -r requirements.txt
    touch "$VENV/.complete"
fi
# The tests' own packages (requirements-test.txt), into the same venv: once per version of that file.
test_hash=$(sha256sum requirements-test.txt | cut -c1-16)
if [ ! -f "$VENV/.complete-test-$test_hash" ]; then
    "$VENV/bin/pip" install --quiet -r requirements-test.txt
    touch "$VENV/.complete-test-$test_hash"
fi
export PATH="$VENV/bin:$PATH"
