#!/usr/bin/env bash
# Installs what the S3 tests need, only what is missing (idempotent, no prompts):
#   - s3s-fs 0.14.1, a real S3-compatible server that verifies SigV4 headers,
#     presigned URLs and chunk signatures (newer versions need a newer rustc);
#   - a Python venv in .venv with what tests/python/requirements.txt pins
#     (boto3, awscli, moto's S3 server) and the fencegate Python client
#     (clients/python).
# The tests run it themselves when something is missing; CI runs it first.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .venv
exec 9>.venv/.setup.lock
flock 9

# The venv first, in the background: pip mostly waits on the network while
# s3s-fs (if missing) compiles.
(
[ -x .venv/bin/python ] || python3 -m venv .venv
if ! cmp -s tests/python/requirements.txt .venv/requirements.installed; then
  .venv/bin/pip install --disable-pip-version-check -q -r tests/python/requirements.txt
  cp tests/python/requirements.txt .venv/requirements.installed
fi
# The client package, reinstalled when its sources changed.
stamp=$(cat clients/python/pyproject.toml clients/python/fencegate/*.py | sha256sum | cut -d' ' -f1)
if [ "$(cat .venv/fencegate-client.installed 2>/dev/null)" != "$stamp" ]; then
  .venv/bin/pip install --disable-pip-version-check -q ./clients/python
  echo "$stamp" > .venv/fencegate-client.installed
fi
) &
venv_setup=$!

cargo_bin="${CARGO_HOME:-$HOME/.cargo}/bin"
if ! { command -v s3s-fs || ls "$cargo_bin/s3s-fs"; } >/dev/null 2>&1 \
   || ! { s3s-fs --version 2>/dev/null || "$cargo_bin/s3s-fs" --version; } | grep -q "0\.14\.1"; then
  echo "installing s3s-fs 0.14.1 (about 8 minutes on 2 cores)"
  # Its own target dir: never the gateway's (nor a test's CARGO_TARGET_DIR).
  s3s_build="${TMPDIR:-/tmp}/s3s-fs-build.$$"
  env -u CARGO_TARGET_DIR cargo install s3s-fs --version 0.14.1 --features binary --locked \
    --target-dir "$s3s_build"
  rm -rf "$s3s_build"    # ~1 GB of build artefacts nothing reads again
fi

if ! wait "$venv_setup"; then
  echo "setting up the Python venv (.venv) failed" >&2
  exit 1
fi
