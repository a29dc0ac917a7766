#!/bin/sh
# The same training script on two machines (here: two processes on this one, over loopback).
#
# Machine A:  python examples/plain_loop.py --data-dir ~/.murmur-a --listen /ip4/0.0.0.0/tcp/4001 --addr-file a.addrs
# Machine B:  python examples/plain_loop.py --data-dir ~/.murmur-b --bootstrap /ip4/<A's IP>/tcp/4001/p2p/<A's peer id>
#
# A prints its address ("peer <id> at /ip4/…/p2p/<id>") and writes it to a.addrs; B joins through it,
# pulls A's model and trains with it; when B is done, A stops too. tests/test_examples.py runs this script
# (shorter: B_SECONDS).
set -eu
cd "$(dirname "$0")/.."
dir=$(mktemp -d)
python examples/plain_loop.py --data-dir "$dir/a" --addr-file "$dir/a.addrs" --seconds 600 &
first=$!
trap 'kill "$first" 2>/dev/null || true' EXIT  # A never outlives the script, even if B fails
for _ in $(seq 600); do [ -s "$dir/a.addrs" ] && break; sleep 0.1; done
python examples/plain_loop.py --data-dir "$dir/b" --bootstrap "$(head -1 "$dir/a.addrs")" --seconds "${B_SECONDS:-12}" --seed 1
kill -TERM "$first"  # B is done: A leaves too (it finishes its step and prints its summary)
wait "$first"
