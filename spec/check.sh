#!/usr/bin/env bash
# The delivery spec in CI, bounded (seconds): the safety invariants hold on the protocol as
# written; each planted bug breaks the invariant that guards its rule; and the witnesses are
# reached (an accepted job and callback, a takeover, a callback sent twice, a carried finish
# accepted, a stale one refused while its claim is granted, a worker dead with a finish
# queued, a delivery parked, a waiter handed on and claimed), so the invariants are not true
# by vacuity. Then the same for the completion in the app's own transaction (app_tx.qnt): its
# promise holds, its planted bugs are caught, its witnesses reached. The TypeScript backend: Quint's Rust evaluator is downloaded from GitHub on
# first use, which CI cannot do.
set -euo pipefail
cd "$(dirname "$0")"
quint=node_modules/.bin/quint  # what npm ci installed (npx would look it up each time)
run() {  # run MODULE INVARIANT [ARGS...]: quint run, bounded and seeded
  local main=$1 invariant=$2 spec=delivery.qnt; shift 2
  [[ $main == app_tx* ]] && spec=app_tx.qnt
  "$quint" run "$spec" --backend=typescript --main="$main" --invariant="$invariant" \
    --max-samples="${QUINT_SAMPLES:-1500}" --max-steps=30 --seed="${QUINT_SEED:-7}" "$@" \
    >"/tmp/quint-$main-$invariant.log" 2>&1
}
witnesses=(jobAccepted callbackAccepted takeover callbackSentTwice carryAccepted
           staleCarryRefusedClaimGranted diedWithCarry parked handedOnThenClaimed)
# Three lanes (CI runs this alone on two cores, before the tests): the longest run, the
# delivery spec's safety one; the app transaction's spec (app_tx.qnt: its safety run, its
# witnesses, its planted bugs); and the delivery spec's planted bugs and traces.
log=/tmp/quint-delivery_fenced-safety.log
run delivery_fenced safety --witnesses "${witnesses[@]}" &
safety=$!
app_witnesses=(effectCommitted effectOfATakeover finishRefusedInTx lockInRefused
               followUpPublished followUpSwept)
app_lane() {  # a smaller spec: 600 runs reach each witness (the sweeper's publish, 8 times)
  local app_log=/tmp/quint-app_tx_fenced-safety.log
  QUINT_SAMPLES=${QUINT_APP_SAMPLES:-600} run app_tx_fenced safety \
    --witnesses "${app_witnesses[@]}" || { cat "$app_log"; return 1; }
  for witness in "${app_witnesses[@]}"; do
    if ! grep -Eq "^$witness was witnessed in [1-9][0-9]* trace" "$app_log"; then
      echo "quint: witness $witness was never reached (app_tx)"
      grep -A8 '^Witnesses:' "$app_log"; return 1
    fi
  done
  echo "quint: safety holds (app_tx_fenced), witnesses reached (${app_witnesses[*]})"
  for planted in app_tx_effect_first:oneEffectOfTheAccepted \
                 app_tx_unfenced:oneEffectOfTheAccepted app_tx_late:acceptedInTime \
                 app_tx_publish_first:noMessageWithoutRow; do
    IFS=: read -r main invariant <<<"$planted"
    if run "$main" "$invariant" || ! grep -q "Invariant violated" \
        "/tmp/quint-$main-$invariant.log"; then
      echo "quint: the planted bug was not found ($main, $invariant)"
      cat "/tmp/quint-$main-$invariant.log"; return 1
    fi
    echo "quint: the planted bug $main breaks $invariant"
  done
}
app_out=$(mktemp)
trap 'rm -f "$app_out"' EXIT
app_lane >"$app_out" 2>&1 &
app=$!
# Each planted bug (a module of its own, one rule broken), the invariant that must catch it,
# and the seed: delivery_forgets_handed loses a key only when its publisher dies in the one
# step between the hand-on and the publish, which the default seed's 1,500 runs do not reach
# (seed 2 does, within its first 300).
for planted in delivery_unfenced:acceptedIsCurrent delivery_carry_unfenced:acceptedIsCurrent \
               delivery_uncounted:groupWithinLimit delivery_unparked:noKeyLost \
               delivery_forgets_handed:noKeyLost:2; do
  IFS=: read -r main invariant seed <<<"$planted"
  if QUINT_SEED=${seed:-${QUINT_SEED:-7}} run "$main" "$invariant" \
      || ! grep -q "Invariant violated" "/tmp/quint-$main-$invariant.log"; then
    echo "quint: the planted bug was not found ($main, $invariant)" >&2
    cat "/tmp/quint-$main-$invariant.log" >&2; exit 1
  fi
  echo "quint: the planted bug $main breaks $invariant"
done
# The traces the store tier replays (tests/stores/test_spec_traces.py) are this spec's:
# written again here, they must have the same states as the committed ones.
fresh=$(mktemp -d)
trap 'rm -rf "$fresh" "$app_out"' EXIT
"$quint" run delivery.qnt --backend=typescript --main=delivery_fenced --invariant=safety \
  --max-samples=12 --n-traces=12 --max-steps=50 --seed=2 --mbt \
  --out-itf="$fresh/trace_{seq}.itf.json" >/dev/null
node -e 'const fs = require("fs"); const [fresh, committed] = process.argv.slice(1);
  const names = (d) => fs.readdirSync(d).filter((n) => n.endsWith(".itf.json")).sort();
  const states = (p) => JSON.stringify(JSON.parse(fs.readFileSync(p)).states);
  if (JSON.stringify(names(fresh)) !== JSON.stringify(names(committed))
      || names(fresh).some((n) => states(fresh + "/" + n) !== states(committed + "/" + n))) {
    console.error("spec/traces is not what spec/traces.sh writes now: run it"); process.exit(1); }' \
  "$fresh" traces
echo "quint: the replayed traces are this spec's"
wait "$safety" || { cat "$log"; exit 1; }
echo "quint: safety holds (delivery_fenced)"
for witness in "${witnesses[@]}"; do
  if ! grep -Eq "^$witness was witnessed in [1-9][0-9]* trace" "$log"; then
    echo "quint: witness $witness was never reached" >&2; grep -A12 '^Witnesses:' "$log" >&2
    exit 1
  fi
done
echo "quint: witnesses reached (${witnesses[*]})"
wait "$app" || { cat "$app_out" >&2; exit 1; }
cat "$app_out"
