#!/usr/bin/env bash
# Runs benches/zmtp_recv.rs with libzmq's own SUB (benches/libzmq_sub.c, built here
# against Debian's libzmq3-dev) side by side with ours, the zeromq crate and a plain
# read-and-discard reference, all receiving the same pre-encoded stream.
#
#   benches/libzmq_compare.sh            # full run
#   benches/libzmq_compare.sh --quick    # criterion's quick mode
set -euo pipefail
cd "$(dirname "$0")/.."
if ! pkg-config --exists libzmq 2>/dev/null; then
  echo "libzmq3-dev is missing: apt-get install -y libzmq3-dev pkg-config" >&2
  exit 1
fi
out=target/bench-bin
mkdir -p "$out"
cc -O2 -o "$out/libzmq_sub" benches/libzmq_sub.c $(pkg-config --cflags --libs libzmq)
EVENTPLANE_LIBZMQ_SUB="$PWD/$out/libzmq_sub" cargo bench --bench zmtp_recv -- "$@"
