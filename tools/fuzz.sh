#!/usr/bin/env bash
# Runs every fuzz target coverage-guided and fails unless each one really explored.
#
#   tools/fuzz.sh [--seconds N] [--bin-dir DIR] [TARGET ...]
#   tools/fuzz.sh --canary [--seconds N] [TARGET ...]
#
# Builds the targets with `cargo +nightly fuzz build -s none` (libFuzzer's coverage
# instrumentation, debug assertions and overflow checks on) unless --bin-dir names a
# folder of already built target binaries. Each target starts from its committed,
# minimized corpus (fuzz/corpus/T) and its hand-written seeds (fuzz/seeds/T); what it
# finds goes to target/fuzz-corpus/T, emptied first (a corpus kept from an earlier run
# must not stand in for the committed one), so the repository stays clean. It fails when:
# - a target loads no coverage counters (the line `Loaded 1 modules (N inline 8-bit
#   counters)` missing or N = 0): the binary is not instrumented;
# - libFuzzer warns `no interesting inputs were found` (it sees no coverage feedback);
# - the committed corpus, once loaded, covers fewer edges than its floor (COV_FLOOR:
#   90% of what the last campaign's corpus reached): the target no longer reaches the
#   code it was written for, or the corpus is not the campaign's;
# - a target runs fewer than its floor of executions (FLOOR below, per second: about a
#   tenth of its speed in CI, so a target gone 10x slower fails);
# - a target panics, times out or runs out of memory (the input is kept in
#   target/fuzz-artifacts/T, the log in target/fuzz-logs/T.log);
# - a committed corpus is missing, or exceeds its size cap (CORPUS_CAP_KIB,
#   CORPUS_CAP_FILES).
# It prints one line per target: counters, executions, new units, coverage, features.
#
# --canary builds the targets with `--cfg fuzz_canary` (in fuzz/target-canary), which
# plants in each one a bug its oracle exists to catch (a message lost when the input
# comes in pieces, an event lost in a round trip), and fails unless every target
# finds it from its committed corpus within --seconds (default 60). A deleted or
# weakened oracle, or a corpus that no longer reaches it, fails here.
#
# After a campaign, refresh a committed corpus with `cargo fuzz cmin` or
# `T -merge=1 fuzz/corpus/T CAMPAIGN_DIR` (see fuzz/README.md).
set -euo pipefail
cd "$(dirname "$0")/.."

seconds=""
bin_dir=""
canary=0
targets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --canary) canary=1; shift ;;
    --bin-dir) bin_dir="$2"; shift 2 ;;
    -h|--help) sed -n '2,35p' "$0"; exit 0 ;;
    *) targets+=("$1"); shift ;;
  esac
done
all_targets=(zmtp_decode pub_session engine_batch dynamo_wire dynamo_request tunnel_control)
[ ${#targets[@]} -gt 0 ] || targets=("${all_targets[@]}")
# Only known names: a target's work directory is emptied (`rm -rf`).
for t in "${targets[@]}"; do
  case " ${all_targets[*]} " in
    *" $t "*) ;;
    *) echo "unknown fuzz target $t (known: ${all_targets[*]})"; exit 2 ;;
  esac
done
if [ "$canary" = 1 ] && [ -n "$bin_dir" ]; then
  echo "--canary builds its own binaries: --bin-dir does not apply"
  exit 2
fi

# Executions per second each target must reach on one core: about a tenth of what CI
# measured (a 2-core machine; stop 58's run: zmtp_decode 6,056/s, pub_session 21,598,
# engine_batch 5,317, dynamo_wire 50,572, dynamo_request 162,233, tunnel_control
# 87,696). The floor catches a target gone 10x slower or stuck, not a slow machine.
declare -A FLOOR=([zmtp_decode]=600 [pub_session]=2000 [engine_batch]=500 [dynamo_wire]=5000 [dynamo_request]=16000 [tunnel_control]=8000)
# Edges (libFuzzer's `cov:`) the committed corpus covers when loaded, 90% of the
# campaign's figure (fuzz/README.md). Raise them when a campaign adds coverage.
declare -A COV_FLOOR=([zmtp_decode]=777 [pub_session]=639 [engine_batch]=1964 [dynamo_wire]=2082 [dynamo_request]=5378 [tunnel_control]=723)
CORPUS_CAP_KIB=1024
CORPUS_CAP_FILES=2000

for t in "${targets[@]}"; do
  if [ -z "$(ls -A "fuzz/corpus/$t" 2>/dev/null)" ]; then
    echo "fuzz/corpus/$t is missing or empty: commit the campaign's minimized corpus"
    exit 1
  fi
  if [ -d "fuzz/corpus/$t" ]; then
    kib=$(du -sk --apparent-size "fuzz/corpus/$t" | cut -f1)
    files=$(find "fuzz/corpus/$t" -type f | wc -l)
    if [ "$kib" -gt "$CORPUS_CAP_KIB" ] || [ "$files" -gt "$CORPUS_CAP_FILES" ]; then
      echo "fuzz/corpus/$t: $files files, $kib KiB: over the cap ($CORPUS_CAP_FILES files, $CORPUS_CAP_KIB KiB); minimize it"
      exit 1
    fi
  fi
done

if [ "$canary" = 1 ]; then
  seconds=${seconds:-60}
  RUSTFLAGS="${RUSTFLAGS:-} --cfg fuzz_canary" \
    bash -c 'cd fuzz && cargo +nightly fuzz build -s none --target-dir target-canary' ||
    { echo "building the canary fuzz targets failed"; exit 1; }
  bin_dir=fuzz/target-canary/x86_64-unknown-linux-gnu/release
  mkdir -p target/fuzz-logs
  failed=0
  for t in "${targets[@]}"; do
    work="target/fuzz-canary/$t"
    log="target/fuzz-logs/$t.canary.log"
    rm -rf "$work" && mkdir -p "$work"
    start=$(date +%s)
    rc=0
    "fuzz/target-canary/x86_64-unknown-linux-gnu/release/$t" "$work" "fuzz/corpus/$t" "fuzz/seeds/$t" \
      -max_total_time="$seconds" -rss_limit_mb=2048 -timeout=20 \
      -artifact_prefix="$work/" >"$log" 2>&1 || rc=$?
    took=$(( $(date +%s) - start ))
    if [ "$rc" != 0 ] && grep -q 'panicked at' "$log"; then
      printf '%-15s canary found in %3ss: %s\n' "$t" "$took" \
        "$(grep -m1 -A1 'panicked at' "$log" | tail -n 1 | cut -c1-100)"
    else
      echo "$t: the planted bug was not found in ${seconds} s (exit $rc): its oracle is gone or its corpus no longer reaches it (see $log)"
      failed=1
    fi
  done
  [ "$failed" = 0 ] || { echo "fuzz canaries failed"; exit 1; }
  exit 0
fi
seconds=${seconds:-20}

if [ -z "$bin_dir" ]; then
  # Without a name, cargo fuzz builds every target in one cargo run.
  (cd fuzz && cargo +nightly fuzz build -s none) || { echo "building the fuzz targets failed"; exit 1; }
  bin_dir=fuzz/target/x86_64-unknown-linux-gnu/release
fi

mkdir -p target/fuzz-logs
failed=0
printf '%-15s %9s %11s %8s %6s %10s %7s %s\n' target counters executions "exec/s" "new" "corpus cov" "cov" "ft"
for t in "${targets[@]}"; do
  bin="$bin_dir/$t"
  [ -x "$bin" ] || { echo "$t: no binary at $bin"; failed=1; continue; }
  work="target/fuzz-corpus/$t"
  artifacts="target/fuzz-artifacts/$t/"
  log="target/fuzz-logs/$t.log"
  rm -rf "$work"
  mkdir -p "$work" "$artifacts"
  rc=0
  "$bin" "$work" "fuzz/corpus/$t" "fuzz/seeds/$t" -max_total_time="$seconds" \
    -rss_limit_mb=2048 -timeout=20 -print_final_stats=1 -artifact_prefix="$artifacts" \
    >"$log" 2>&1 || rc=$?
  counters=$(sed -n 's/.*Loaded [0-9]* modules *(\([0-9]*\) inline 8-bit counters).*/\1/p' "$log" | head -n 1)
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  new=$(sed -n 's/^stat::new_units_added: *//p' "$log")
  last=$(grep -E '^#[0-9]+[[:space:]]+(DONE|INITED|NEW|REDUCE|pulse)' "$log" | tail -n 1 || true)
  cov=$(sed -n 's/.* cov: \([0-9]*\) .*/\1/p' <<<"$last")
  inited=$(sed -n 's/^#[0-9]*[[:space:]]*INITED cov: \([0-9]*\) .*/\1/p' "$log" | head -n 1)
  ft=$(sed -n 's/.* ft: \([0-9]*\) .*/\1/p' <<<"$last")
  printf '%-15s %9s %11s %8s %6s %10s %7s %s\n' "$t" "${counters:-none}" "${execs:-?}" "${rate:-?}" \
    "${new:-?}" "${inited:-?}" "${cov:-?}" "${ft:-?}"
  why=()
  [ "$rc" = 0 ] || why+=("libFuzzer exited $rc (a crash, leak, timeout or OOM: see $log and $artifacts)")
  [ "${counters:-0}" -gt 0 ] || why+=("no coverage counters loaded: the binary is not instrumented")
  if grep -q 'no interesting inputs were found' "$log"; then
    why+=("libFuzzer found no interesting inputs: it has no coverage feedback")
  fi
  [ "${inited:-0}" -ge "${COV_FLOOR[$t]:-1}" ] ||
    why+=("the corpus loads ${inited:-no} covered edges, under the floor of ${COV_FLOOR[$t]:-1}")
  floor=$(( ${FLOOR[$t]:-300} * seconds ))
  [ "${execs:-0}" -ge "$floor" ] || why+=("${execs:-0} executions, under the floor of $floor")
  if [ ${#why[@]} -gt 0 ]; then
    failed=1
    for w in "${why[@]}"; do echo "  $t: $w"; done
    grep -E 'WARNING|ERROR|panicked|SUMMARY' "$log" | head -n 20 | sed 's/^/    /' || true
  fi
done
if [ "$failed" != 0 ]; then
  echo "fuzzing failed"
  exit 1
fi
