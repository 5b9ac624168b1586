# Sourced by the gpu_*.sh scripts: a time budget for a lent machine's one call.
# BUDGET (seconds this invocation may take) must be set; START is when it began.
START=$SECONDS

left() { echo $((BUDGET - (SECONDS - START))); }
say() { echo "=== [$((SECONDS - START)) s] $*"; }

# run with what is left of the budget (minus a margin); say so when cut
guarded() {
    local t=$(($(left) - 8))
    if ((t < 20)); then say "SKIPPED (no time left): $*"; return 124; fi
    say "\$ $*"
    timeout "$t" "$@"
    local rc=$?
    ((rc == 124)) && say "CUT by the time budget: $*"
    return $rc
}

guarded_quiet() {  # guarded, without echoing the command
    local t=$(($(left) - 8))
    if ((t < 20)); then say "SKIPPED (no time left)"; return 124; fi
    timeout "$t" "$@"
}
