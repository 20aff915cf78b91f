#!/usr/bin/env bash
# Write the traces tests/stores/test_spec_traces.py replays against every store: a few
# seeded simulations of the fenced protocol (ITF, with each step's action: --mbt).
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p traces
for seed in 3 5 8 13 42; do
  npx quint run delivery.qnt --backend=typescript --main=delivery_fenced --invariant=safety \
    --max-samples=1 --max-steps=40 --seed="$seed" --mbt \
    --out-itf="traces/seed_${seed}.itf.json" >/dev/null
done
