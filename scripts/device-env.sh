# Sourced by the device scripts: repository root as cwd, $OUT created, src on PYTHONPATH, and the
# DLMC masks from .carry/dlmc-rn50 (a copy of ../shared/data/dlmc-rn50 carried to the device) when present.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
if [ -d .carry/dlmc-rn50 ]; then export SPARSECNN_DLMC=$PWD/.carry/dlmc-rn50; fi
# The device image ships torch & co. without bytecode and sets PYTHONDONTWRITEBYTECODE, so every
# process (and every spawned worker) compiled ~5 s of Python sources; a pip install writes the
# bytecode once. Write it under /tmp instead: the first process pays, later ones do not.
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-/tmp/pycache}
