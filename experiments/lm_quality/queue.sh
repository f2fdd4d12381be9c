#!/bin/bash
# Runs the study's rows one after another (one process at a time), appending to results.jsonl.
cd "$(dirname "$0")/../.."
E="python experiments/lm_quality/emulate.py"
while read -r args; do
  [ -z "$args" ] && continue
  echo "$(date -u +%T) $args" >> experiments/lm_quality/queue.log
  $E $args >> experiments/lm_quality/queue.log 2>&1
done <<'LIST'
--method dense --world 2
--method dense --world 4
--method sharedm --world 2 --ratio 0.01 --warm 8
--method sharedm --world 4 --ratio 0.01 --warm 8
--method recipe --world 2 --ratio 0.01
--method recipe --world 4 --ratio 0.01
--method onebit --world 4 --ratio 0.01 --warm 8
--method sharedm --world 4 --ratio 0.01 --warm 8 --vbytes 2
--method sharedm --world 4 --ratio 0.01 --warm 20
--method onebit --world 2 --ratio 0.01 --warm 8
--method sharedm --world 4 --ratio 0.02 --warm 8 --vbytes 2
LIST
