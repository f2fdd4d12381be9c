#!/usr/bin/env bash
# A-B-A: the same three benchmarks on two checkouts, one after another -- before, after, before
# again -- so the machine's drift shows as the spread of the two "before" runs.
#   bash benchmarks/aba.sh <before-tree> <after-tree> <out-dir>
# Each tree is a clean worktree (git worktree add /tmp/pre <commit>); its own gradwire and
# benchmarks run (PYTHONPATH). Writes <out-dir>/{bench,hooks,grace}_{before1,after,before2}.txt.
set -eu
before=$(cd "$1" && pwd) after=$(cd "$2" && pwd)
mkdir -p "$3" && out=$(cd "$3" && pwd)
run() {
  local tag=$1 tree=$2
  cd "$tree"
  echo "== $tag $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)"
  PYTHONPATH=$tree python -m gradwire.cli bench --only throughput --json "$out/bench_$tag.json" > "$out/bench_$tag.txt" 2>&1
  PYTHONPATH=$tree python benchmarks/hooks_vs_torch.py --steps 10 --rounds 3 --json "$out/hooks_$tag.json" \
    > "$out/hooks_$tag.txt" 2>&1
  PYTHONPATH=$tree python benchmarks/vs_grace.py --reps 5 --min > "$out/grace_$tag.txt" 2>&1
}
run before1 "$before"
run after "$after"
run before2 "$before"
echo "== done $(date -u +%H:%M:%S)"
