#!/usr/bin/env bash
# Install the stack from the pieces of `./wb bundle` beside this script, with
# no package index: bash install.sh DEST
#
# DEST becomes a virtual environment on top of the host's own packages
# (--system-site-packages: its torch and CUDA libraries), holding every wheel
# of the bundle (pip install --no-index --no-deps --find-links). Then the
# modules the bundle names are imported: a gap in the host's packages shows
# there, by name. DEST must not exist; on any failure it is removed again.
# PYTHON picks the interpreter (default python3); it needs pip 22.3 or later.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python=${PYTHON:-python3}
if [[ $# -ne 1 ]]; then
  echo "usage: bash $0 DEST (a virtual environment to create)" >&2
  exit 2
fi
dest=$1
if [[ -e $dest ]]; then
  echo "install.sh: $dest exists; name a new folder, or remove it first" >&2
  exit 2
fi
if ! (cd "$here" && sha256sum --quiet -c SHA256SUMS); then
  echo "install.sh: a piece is missing or damaged (SHA256SUMS above): copy every" \
    "kvlc-bundle.tar.xz.NNN of the bundle next to this script" >&2
  exit 1
fi
work=$(mktemp -d)
cleanup() {
  rc=$?
  rm -rf "$work"
  if [[ $rc -ne 0 ]]; then
    rm -rf "$dest"
    echo "install.sh: failed; $dest removed" >&2
  fi
}
trap cleanup EXIT
cat "$here"/kvlc-bundle.tar.xz.[0-9][0-9][0-9] | xz -dc | tar -x -C "$work"
wheels=$work/wheels
"$python" - "$wheels/bundle.json" <<'EOF'
import json
import sys

manifest = json.load(open(sys.argv[1]))
have = "%d.%d" % sys.version_info[:2]
if manifest["imports"] and manifest["python"] != have:
    sys.exit(
        f"install.sh: the bundle's compiled wheels are for Python "
        f"{manifest['python']}, {sys.executable} is {have}: set PYTHON to a "
        f"Python {manifest['python']}, or build the bundle with "
        f"./wb bundle --python-version {have}"
    )
EOF
"$python" -m venv --system-site-packages --without-pip "$dest"
mapfile -t names < <("$python" -c \
  'import json, sys; print("\n".join(json.load(open(sys.argv[1]))["wheels"]))' \
  "$wheels/bundle.json")
# --ignore-installed: the bundle's wheels land in DEST even where the host
# holds the same version, so DEST is what the bundle says.
"$python" -m pip --python "$dest/bin/python" install -q --no-index --no-deps \
  --ignore-installed --no-cache-dir --find-links "$wheels" "${names[@]/#/$wheels/}"
"$dest/bin/python" - "$wheels/bundle.json" <<'EOF'
import importlib
import json
import sys

manifest = json.load(open(sys.argv[1]))
for name in manifest["imports"]:
    try:
        module = importlib.import_module(name)
    except Exception as e:
        sys.exit(f"install.sh: import {name} failed: {e!r}")
    print(f"import {name}: {getattr(module, '__version__', 'ok')}")
print(f"installed {len(manifest['wheels'])} wheels ({manifest['part']})")
EOF
echo "done: run with $dest/bin/python (or $dest/bin/vllm)"
