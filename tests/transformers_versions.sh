#!/usr/bin/env bash
# Re-run the transformers integration tests against given transformers versions.
#
#   tests/transformers_versions.sh 5.25.0 5.0.0 4.57.6
#
# For each version: a venv under ${TFV_DIR:-/tmp/tfv}/<version> that reuses the installed
# torch (--system-site-packages), `pip install transformers==<version>` into it, then
# tests/test_hf.py and tests/test_rfa_adapter.py with that venv's python. Prints one
# "PASS <version>" / "FAIL <version>: <first error>" line per version; the full pytest
# output is in ${TFV_DIR}/<version>.log. Exit status: the number of failed versions.
# Not collected by pytest (see docs/examples.md, "Supported transformers versions").
set -u

if [ "$#" -eq 0 ]; then
    echo "usage: $0 VERSION [VERSION ...]" >&2
    exit 2
fi

repo=$(cd "$(dirname "$0")/.." && pwd)
tfv_dir=${TFV_DIR:-/tmp/tfv}
python=${PYTHON:-python3}
mkdir -p "$tfv_dir"
failed=0

for ver in "$@"; do
    venv="$tfv_dir/$ver"
    log="$tfv_dir/$ver.log"
    : >"$log"
    if [ ! -x "$venv/bin/python" ]; then
        "$python" -m venv --system-site-packages "$venv" >>"$log" 2>&1
    fi
    note=""
    if ! "$venv/bin/pip" install -q "transformers==$ver" >>"$log" 2>&1; then
        # e.g. 5.25.0 pins kernels>=0.19.1, which an index may lack: the version itself
        # still runs without it (kernels is only imported for hub kernels)
        if "$venv/bin/pip" install -q --no-deps "transformers==$ver" >>"$log" 2>&1; then
            note=" [installed --no-deps: $(grep -m 1 'No matching distribution' "$log")]"
        else
            echo "FAIL $ver: pip install failed (see $log)"
            failed=$((failed + 1))
            continue
        fi
    fi
    got=$(cd "$repo" && "$venv/bin/python" -c "import transformers; print(transformers.__version__)" 2>>"$log")
    if [ "$got" != "$ver" ]; then
        echo "FAIL $ver: venv imports transformers '$got' (see $log)"
        failed=$((failed + 1))
        continue
    fi
    if (cd "$repo" && "$venv/bin/python" -m pytest -q -x -p no:cacheprovider \
            tests/test_hf.py tests/test_rfa_adapter.py) >>"$log" 2>&1; then
        echo "PASS $ver: $(tail -n 1 "$log")$note"
    else
        # the first exception line, past the test harness' wrapper (tests/_dist.py PoolError)
        first=$(grep -E '^E +[A-Za-z_.]*(Error|Exception|Warning)\b' "$log" | grep -v PoolError | head -n 1)
        [ -n "$first" ] || first=$(grep -m 1 -E '^E |Error' "$log" || tail -n 1 "$log")
        first=$(echo "$first" | sed -E 's/^E +//')
        echo "FAIL $ver: $first (see $log)$note"
        failed=$((failed + 1))
    fi
done
exit "$failed"
