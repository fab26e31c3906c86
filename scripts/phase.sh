#!/usr/bin/env bash
# Times the phases of a set-up or test run, so a slow machine can be told from a broken one.
#
#   scripts/phase.sh NAME CMD...   run CMD as phase NAME: print when it starts and how many
#                                  seconds it took (or that it failed), and record a line
#                                  "NAME START SECONDS STATUS" in $AGENTSERVING_PHASES
#   scripts/phase.sh --summary     every recorded phase with its seconds, and the wall-clock
#                                  time from the first phase's start to now (phases that ran
#                                  side by side add up to more than that)
#
# Without AGENTSERVING_PHASES (the Makefile sets one file per `make` run) nothing is recorded
# and only the lines are printed. The exit status is CMD's.
set -uo pipefail
FILE="${AGENTSERVING_PHASES:-}"

if [[ "${1:-}" == "--summary" ]]; then
  [[ -n "$FILE" && -s "$FILE" ]] || exit 0
  awk -v now="$(date +%s)" '
    { name[NR] = $1; secs[NR] = $3; status[NR] = $4
      if (first == "" || $2 < first) first = $2 }
    END {
      print "==> phases (seconds; side-by-side phases overlap):"
      for (i = 1; i <= NR; i++)
        printf "    %-16s %6d s  %s\n", name[i], secs[i], status[i]
      printf "    %-16s %6d s  (%d min %d s)\n", "wall clock", now - first,
             (now - first) / 60, (now - first) % 60
    }' "$FILE"
  exit 0
fi

name=${1:?usage: $0 NAME CMD... | --summary}
shift
start=$(date +%s)
echo "==> $name"
"$@"
rc=$?
secs=$(($(date +%s) - start))
if ((rc == 0)); then
  status=ok; echo "<== $name: ${secs} s"
else
  status="failed($rc)"; echo "<== $name: failed (exit $rc) after ${secs} s"
fi
if [[ -n "$FILE" ]]; then
  mkdir -p "$(dirname "$FILE")"
  echo "$name $start $secs $status" >> "$FILE"
fi
exit "$rc"
