#!/usr/bin/env bash
# Runs every fuzz target (or the ones named) for a bounded time, one after another, and
# prints per target: seconds run, executions, executions per second, crashes. Exits
# non-zero when any target crashed (or did not run). Needs cargo-fuzz
# (`cargo install cargo-fuzz`); never part of the main build or of CI.
#
#   fuzz/run.sh [SECONDS_PER_TARGET=60] [TARGET...]
#
# The targets live with the crate whose parsers they drive, each crate's in its own cargo
# fuzz workspace (host/crates/CRATE/fuzz: runtime holds manifest and json_to_wit, gateway
# front_line, jwt and serve_config); this script finds a target's folder by asking each
# one's `cargo fuzz list`. Both build into one target folder (fuzz/target, or
# CARGO_TARGET_DIR), so what they share is compiled once.
#
# The build is coverage-guided without a sanitizer (`--sanitizer none`): the code under
# test is safe Rust, and what the targets look for are panics, failed assertions, aborts,
# out-of-memory and timeouts. That build needs no nightly compiler (the toolchain of
# rust-toolchain.toml is used). For AddressSanitizer: FUZZ_SANITIZER=address
# FUZZ_TOOLCHAIN=nightly fuzz/run.sh ... (much slower to build and to run).
#
# Each target starts from its crate's corpus/TARGET (the committed seed-* files plus
# whatever earlier runs added) with the dictionary of fuzz/dict that fits it. A crash
# stops that target; its input is in its crate's fuzz/artifacts/TARGET/ (minimize there:
# `cargo fuzz tmin -O --sanitizer none TARGET artifacts/TARGET/crash-...`) and becomes a
# regression test in that crate.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/.." && pwd)"
seconds="${1:-60}"
shift || true
toolchain=()
if [ -n "${FUZZ_TOOLCHAIN:-}" ]; then
    toolchain=("+$FUZZ_TOOLCHAIN")
fi
flags=(-O --sanitizer "${FUZZ_SANITIZER:-none}")
# The guests (built by host/crates/runtime/build.rs) go to this checkout's target/guests.
export AIRLOCK_WORKSPACE_ROOT="${AIRLOCK_WORKSPACE_ROOT:-$root}"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$here/target}"
folders=("$root"/host/crates/*/fuzz)

# Which folder holds each target, and every target in folder order.
declare -A folder_of=()
all=()
for f in "${folders[@]}"; do
    while read -r t; do
        folder_of[$t]="$f"
        all+=("$t")
    done < <(cd "$f" && cargo "${toolchain[@]}" fuzz list)
done
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    targets=("${all[@]}")
fi
for t in "${targets[@]}"; do
    if [ -z "${folder_of[$t]:-}" ]; then
        echo "no fuzz target $t; there are: ${all[*]}" >&2
        exit 2
    fi
done

dict_for() {
    case "$1" in
        front_line | json_to_wit) echo "$here/dict/json.dict" ;;
        jwt) echo "$here/dict/jwt.dict" ;;
        manifest | serve_config) echo "$here/dict/toml.dict" ;;
    esac
}

# Built once, then each binary is run directly (a source change during the run does not
# rebuild under it). FUZZ_NO_BUILD=1 runs what is built.
if [ -z "${FUZZ_NO_BUILD:-}" ]; then
    for t in "${targets[@]}"; do
        (cd "${folder_of[$t]}" && cargo "${toolchain[@]}" fuzz build "${flags[@]}" "$t")
    done
fi
triple="$(rustc "${toolchain[@]}" -vV | sed -n 's/^host: //p')"

rows=()
failed=0
for t in "${targets[@]}"; do
    f="${folder_of[$t]}"
    log="$f/artifacts/$t.log"
    mkdir -p "$f/corpus/$t" "$f/artifacts/$t"
    before="$(find "$f/artifacts/$t" -type f | wc -l)"
    extra=()
    dict="$(dict_for "$t")"
    if [ -n "$dict" ]; then
        extra+=("-dict=$dict")
    fi
    start="$(date +%s)"
    set +e
    "$CARGO_TARGET_DIR/$triple/release/$t" -artifact_prefix="$f/artifacts/$t/" \
        -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
        "${extra[@]}" "$f/corpus/$t" >"$log" 2>&1
    status=$?
    set -e
    took=$(($(date +%s) - start))
    execs="$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)"
    rate="$(grep -o 'stat::average_exec_per_sec: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)"
    crashes=$(($(find "$f/artifacts/$t" -type f | wc -l) - before))
    if [ "$status" -ne 0 ] && [ "$crashes" -eq 0 ]; then
        # Stopped without writing an input (a build error, a crash at start-up).
        crashes="?"
    fi
    if [ "$crashes" != 0 ]; then
        failed=1
        echo "== $t: exit $status; its log is ${log#"$root"/}" >&2
        grep -E 'panicked|SUMMARY|ERROR|Test unit written' "$log" | head -5 >&2 || true
    fi
    rows+=("$(printf '%-14s %8s %12s %9s %8s' "$t" "$took" "${execs:-?}" "${rate:-?}" "$crashes")")
done

printf '%-14s %8s %12s %9s %8s\n' target seconds execs execs/s crashes
printf '%s\n' "${rows[@]}"
exit "$failed"
