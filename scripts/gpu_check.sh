#!/usr/bin/env bash
# The GPU check (issue 9, issue 22): tests/gpu, attention numerics, greedy tokens, CUDA graphs vs
# eager, then single-stream decode and throughput, into OUT_DIR/results.json (and gpu_check.log).
#
#   scripts/gpu_check.sh OUT_DIR [scripts/gpu_check.py options, e.g. --budget-s 400, --device cpu --quick]
#
# The wheels scripts/gpu_wheels.sh put in .gpu-wheels/ (GPU_WHEELS names another folder; split
# wheels are joined first) are installed, offline and without dependencies, into a temporary
# target directory put on PYTHONPATH: each one whose distribution the Python here (python3, or
# $PYTHON) lacks or has in an older version. On the GPU machine's image that is pydantic (engine/
# and scheduler/ import it) and, when carried, flash-attn 4 and its CUTLASS DSL.
#
# Nothing outlives the check: the Python runs in the background while this shell waits, so that
# SIGTERM/SIGINT reach the trap at once; the trap passes SIGTERM on (the check then stops its running
# part and writes its results), and SIGKILLs what is left, the part's process group included, whose
# id the check keeps in a file for this.
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
: >"$log"
tmp=$(mktemp -d)
export GPU_CHECK_CHILD_FILE=$tmp/child
pid=

finish() {
    trap - TERM INT EXIT
    if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
        kill -TERM "$pid" 2>/dev/null
        for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        kill -KILL "$pid" 2>/dev/null
    fi
    group=$(cat "$GPU_CHECK_CHILD_FILE" 2>/dev/null)
    [ -n "$group" ] && kill -KILL -- "-$group" 2>/dev/null
    rm -rf "$tmp"
}
trap 'finish; exit 143' TERM
trap 'finish; exit 130' INT
trap finish EXIT

say() { echo "$*" | tee -a "$log"; }

# The carried wheels, split ones joined: one per line into $tmp/wheels.
collect_wheels() {
    local wheels=$1 sums whole
    mkdir -p "$tmp/joined"
    find "$wheels" -name '*.whl' >"$tmp/wheels"
    while IFS= read -r sums; do
        whole=$tmp/joined/$(basename "$sums" .sha256)
        find "$wheels" -name "$(basename "$whole").part-*" | sort | xargs -r cat >"$whole"
        if (cd "$tmp/joined" && sha256sum --quiet -c "$sums" >/dev/null 2>&1); then
            echo "$whole" >>"$tmp/wheels"
        else
            say "$(basename "$whole"): parts missing or damaged (carry .gpu-wheels/b too); not installed"
        fi
    done < <(find "$wheels" -name '*.whl.sha256')
}

# Of the wheels listed in $1, those that fit the Python here and whose distribution it lacks or has
# older (on stderr, those that do not fit: pip would refuse the whole install for one).
missing_wheels() {
    "$python" - "$1" <<'EOF'
import importlib.metadata as metadata
import sys
from pathlib import Path

try:
    from packaging.tags import sys_tags
    from packaging.utils import parse_wheel_filename
    from packaging.version import Version
except ImportError:  # then every wheel is taken to fit, and any other version counts as older
    parse_wheel_filename = None
supported = set(sys_tags()) if parse_wheel_filename else set()
for line in Path(sys.argv[1]).read_text().split():
    name, version = Path(line).name.split("-")[:2]
    if parse_wheel_filename:
        _, parsed, _, tags = parse_wheel_filename(Path(line).name)
        if not tags & supported:
            print(f"{Path(line).name}: not for this Python, not installed", file=sys.stderr)
            continue
    try:
        installed = metadata.version(name)
    except metadata.PackageNotFoundError:
        print(line)
        continue
    if installed != version and (parse_wheel_filename is None or Version(installed) < parsed):
        print(line)
EOF
}

wheels=${GPU_WHEELS:-$root/.gpu-wheels}
if [ -d "$wheels" ]; then
    collect_wheels "$wheels"
    mapfile -t install < <(missing_wheels "$tmp/wheels" 2> >(tee -a "$log" >&2))
    if [ ${#install[@]} -gt 0 ]; then
        site=$tmp/site
        say "installing ${#install[@]} carried wheels from $wheels into a temporary target:" \
            "$(for w in "${install[@]}"; do basename "$w"; done | tr '\n' ' ')"
        started=$SECONDS
        "$python" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
            --disable-pip-version-check --target "$site" "${install[@]}" 2>&1 | tee -a "$log"
        [ "${PIPESTATUS[0]}" = 0 ] || say "pip could not install them all (see above); the check goes on"
        # PYTHONPATH entries get no .pth processing (the CUTLASS DSL adds its packages' folder through
        # one): the folders that site.addsitedir would add, the target first.
        paths=$("$python" -c 'import site, sys; before = list(sys.path); site.addsitedir(sys.argv[1]); print(":".join(p for p in sys.path if p not in before))' "$site")
        export PYTHONPATH="${paths:-$site}${PYTHONPATH:+:$PYTHONPATH}"
        export GPU_CHECK_CARRIED="$(for w in "${install[@]}"; do basename "$w"; done | tr '\n' ' ')"
        say "installed in $((SECONDS - started)) s"
    fi
fi
if ! "$python" -c 'import pydantic' 2>/dev/null; then
    say "pydantic is missing and no carried wheel provides it (run scripts/gpu_wheels.sh where pip" \
        "reaches PyPI, and carry .gpu-wheels): every part will fail to import the engine"
fi

cd "$root" || exit 2
"$python" -u scripts/gpu_check.py "$out" --append-log "$@" &
pid=$!
wait "$pid"
status=$?
pid=
exit $status
