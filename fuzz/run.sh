#!/usr/bin/env bash
# Runs every fuzz target for a bounded time and prints, per target, the executions done
# and the crashes found. Needs the nightly toolchain and cargo-fuzz
# (`cargo install cargo-fuzz`); it is never part of the main build or of CI.
#
#   fuzz/run.sh [SECONDS_PER_TARGET=60] [TARGET...]
#
# Crashes are written to fuzz/artifacts/TARGET/; each one found becomes a regression test
# in the crate that owns the parser.
set -euo pipefail
cd "$(dirname "$0")"
seconds="${1:-60}"
shift || true
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(cargo +nightly fuzz list)
fi
# The guests (built by host/build.rs) go to this checkout's target/guests.
export AIRLOCK_WORKSPACE_ROOT="${AIRLOCK_WORKSPACE_ROOT:-$(cd .. && pwd)}"
cargo +nightly fuzz build -O "${targets[@]/#/}" >/dev/null 2>&1 || cargo +nightly fuzz build -O
printf '%-16s %12s %8s\n' target execs crashes
for t in "${targets[@]}"; do
    log="$(mktemp)"
    mkdir -p "corpus/$t" "artifacts/$t"
    set +e
    cargo +nightly fuzz run -O "$t" "corpus/$t" -- -max_total_time="$seconds" \
        -artifact_prefix="artifacts/$t/" -print_final_stats=1 >"$log" 2>&1
    set -e
    execs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)"
    crashes="$(find "artifacts/$t" -type f | wc -l)"
    printf '%-16s %12s %8s\n' "$t" "${execs:-?}" "$crashes"
    rm -f "$log"
done
