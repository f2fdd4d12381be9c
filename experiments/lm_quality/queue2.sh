#!/bin/bash
# Second batch (started after the first batch's order was changed); one process at a time.
cd "$(dirname "$0")/../.."
while kill -0 16912 2>/dev/null; do sleep 2; done
E="python experiments/lm_quality/emulate.py"
while read -r args; do
  [ -z "$args" ] && continue
  echo "$(date -u +%T) $args" >> experiments/lm_quality/queue.log
  $E $args >> experiments/lm_quality/queue.log 2>&1
done <<'LIST'
--method sharedm --world 2 --ratio 1.0 --warm 8
--method sharedm --world 2 --ratio 0.01 --warm 8 --lr-mult 2
--method recipe --world 4 --ratio 0.01
--method onebit --world 2 --ratio 0.01 --warm 8
--method sharedm --world 2 --ratio 1.0 --warm 8 --vrefresh 10
--method sharedm --world 2 --ratio 0.01 --warm 8 --vbytes 2
--method onebit --world 4 --ratio 0.01 --warm 8
LIST
