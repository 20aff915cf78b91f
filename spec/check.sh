#!/usr/bin/env bash
# The delivery spec in CI, bounded (seconds): the safety invariants hold on the protocol as
# written; the planted bug (a finish that checks neither the token nor the deadline) breaks
# acceptedIsCurrent; and the witnesses are reached (an accepted job, an accepted callback, a
# takeover), so the invariants are not true by vacuity. The TypeScript backend: Quint's Rust
# evaluator is downloaded from GitHub on first use, which CI cannot do.
set -euo pipefail
cd "$(dirname "$0")"
run() {  # run MODULE INVARIANT: quint run, bounded and seeded
  npx quint run delivery.qnt --backend=typescript --main="$1" --invariant="$2" \
    --max-samples="${QUINT_SAMPLES:-1500}" --max-steps=30 --seed="${QUINT_SEED:-7}" >/tmp/quint-$1-$2.log 2>&1
}
run delivery_fenced safety || { cat "/tmp/quint-delivery_fenced-safety.log"; exit 1; }
echo "quint: safety holds (delivery_fenced)"
if run delivery_unfenced acceptedIsCurrent; then
  echo "quint: the planted bug was not found (delivery_unfenced, acceptedIsCurrent)" >&2; exit 1
fi
echo "quint: the planted bug breaks acceptedIsCurrent (delivery_unfenced)"
for witness in jobNeverAccepted callbackNeverAccepted noTakeover callbackSentOnce; do
  if run delivery_fenced "$witness"; then
    echo "quint: witness $witness was never reached" >&2; exit 1
  fi
done
echo "quint: witnesses reached (an accepted job, an accepted callback, a takeover, a callback sent twice)"
# The traces the store tier replays (tests/stores/test_spec_traces.py) are this spec's:
# written again here, they must have the same states as the committed ones.
fresh=$(mktemp -d)
trap 'rm -rf "$fresh"' EXIT
for seed in 3 5 8 13 42; do
  npx quint run delivery.qnt --backend=typescript --main=delivery_fenced --invariant=safety \
    --max-samples=1 --max-steps=40 --seed="$seed" --mbt \
    --out-itf="$fresh/seed_${seed}.itf.json" >/dev/null
  node -e 'const fs = require("fs"); const [a, b] = process.argv.slice(1).map(
      (p) => JSON.stringify(JSON.parse(fs.readFileSync(p)).states));
    if (a !== b) { console.error("spec/traces/" + process.argv[2].split("/").pop()
      + " is not what spec/traces.sh writes now: run it"); process.exit(1); }' \
    "$fresh/seed_${seed}.itf.json" "traces/seed_${seed}.itf.json"
done
echo "quint: the replayed traces are this spec's"
