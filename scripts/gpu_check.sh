#!/usr/bin/env bash
# The GPU check (issue 9): numerics, greedy tokens, throughput and single-stream decode, as JSON.
#
#   scripts/gpu_check.sh OUT_DIR [scripts/gpu_check.py options, e.g. --budget-s 280, --device cpu --quick]
#
# When the Python here (python3, or $PYTHON) lacks pydantic (the GPU machine's image), the wheels
# that scripts/gpu_wheels.sh put in .gpu-wheels/ are installed, offline, into a temporary target
# directory put on PYTHONPATH. Then scripts/gpu_check.py writes its JSON files and gpu_check.log
# into OUT_DIR (see its docstring). GPU_WHEELS names another wheel folder.
set -uo pipefail

if [ $# -lt 1 ]; then
    echo "usage: $0 OUT_DIR [gpu_check.py options]" >&2
    exit 2
fi
out=$1
shift
root=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: the check runs from the repository root
log="$out/gpu_check.log"

if ! "$python" -c 'import pydantic' 2>/dev/null; then
    wheels=${GPU_WHEELS:-$root/.gpu-wheels}
    if ls "$wheels"/*.whl >/dev/null 2>&1; then
        site=$(mktemp -d)/site
        echo "pydantic is missing: installing the carried wheels from $wheels into $site" | tee -a "$log"
        "$python" -m pip install --quiet --no-index --find-links "$wheels" --no-compile --no-cache-dir \
            --disable-pip-version-check --target "$site" pydantic 2>&1 | tee -a "$log"
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "pydantic is missing and $wheels holds no wheels (run scripts/gpu_wheels.sh where pip" \
             "reaches PyPI, and carry .gpu-wheels): every part will fail to import the engine" | tee -a "$log"
    fi
fi

cd "$root" || exit 2
"$python" -u scripts/gpu_check.py "$out" "$@"
status=$?
[ -n "${site:-}" ] && rm -rf "$(dirname "$site")"
exit $status
