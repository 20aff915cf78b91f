#!/usr/bin/env bash
# Write the traces tests/stores/test_spec_traces.py replays against every store: the first
# runs of one seeded simulation of the fenced protocol (ITF, with each step's action: --mbt).
# check.sh writes them again and compares.
set -euo pipefail
cd "$(dirname "$0")"
quint=node_modules/.bin/quint  # what npm ci installed (npx would look it up each time)
rm -rf traces
mkdir traces
"$quint" run delivery.qnt --backend=typescript --main=delivery_fenced --invariant=safety \
  --max-samples=12 --n-traces=12 --max-steps=50 --seed=2 --mbt \
  --out-itf='traces/trace_{seq}.itf.json' >/dev/null
