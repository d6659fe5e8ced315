#!/usr/bin/env bash
# GPU validation in one call (run on the device machine from the repository root):
#   0. the native conformance suite (tools/conformance.py: the generated matrix of cases, properties,
#      guard regions, FLA beside ours; results in $OUT/conformance/), and the delta family's sequential
#      passes over their whole grid against float64 (tools/pass_sweep.py; $OUT/passes/);
#   1. the whole test suite natively (no interpreter), at GPU sizes;
#   2. every book chapter and every solved workbook through nbval (collected with the tests);
#   3. the benchmarks (tools/bench.py), and the NCCL context-parallel check when 2+ GPUs exist;
# then a short report in $OUT/report.md (also printed last).
# The device has no network and no Jupyter stack: carry .devwheels (../shared/tools/device-wheels.sh).
#   usage: bash tools/gpu_validate.sh [pytest args...]      (OUT defaults to _build/gpu; JOBS pytest workers, 14)
#   STAGES="conformance passes tests bench cp" (default: all five) runs a subset, e.g. to fit a 10-minute call;
#   CONF_ARGS passes options to tools/conformance.py (default "--size native --workers $JOBS"; add
#   --record to write book/data/error_budget.json, --only VARIANT, --reference auto, --no-fla to leave
#   FLA out: its autotuned kernels compile for minutes per shape, and without them 805 cases took 386 s
#   on an H200 with 15 workers; --resume DIR to go on where a cut run stopped); CONF_TIMEOUT bounds
#   it in seconds (default 540; it stops handing out cases 30 s before and writes its summary);
#   BENCH_ARGS passes options to tools/bench.py (e.g. "--suite anchors"); BENCH_TIMEOUT bounds it
#   in seconds (the bench saves its results row by row, so a cut-off run still reports); TESTS_TIMEOUT
#   bounds the test stage the same way (keep both below the device call's limit so the report is written).
#   The test stage does not fit one 10-minute call (natively tests/ takes about three with 15 workers,
#   the notebooks one): TESTS_RESUME="LOG …", the pytest.log of earlier calls, runs only the tests those
#   did not pass or skip, so calls in turn cover the suite; a cut stage is interrupted (SIGINT), so
#   pytest still prints what failed.
set -uo pipefail
OUT=${OUT:-_build/gpu}
STAGES=${STAGES:-conformance passes tests bench cp}
has() { case " $STAGES " in *" $1 "*) return 0 ;; esac; return 1; }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 MPLBACKEND=Agg NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
if [ -d .devwheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .devwheels/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-} PATH=/tmp/site/bin:$PATH
else
  export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi
python3 - <<'PY' | tee "$OUT/versions.txt"
import torch, triton, linattn
print(linattn.device.describe())
print("python", __import__("sys").version.split()[0], "· GPUs:", torch.cuda.device_count())
PY
t0=$(date +%s)
tests_rc=skipped bench_rc=skipped conf_rc=skipped passes_rc=skipped
if has conformance; then
  ct=${CONF_TIMEOUT:-540}
  # --max-seconds ends the run cleanly (summary written) before the outer timeout would cut it
  timeout "$ct" python3 tools/conformance.py --out "$OUT/conformance" --max-seconds $((ct > 60 ? ct - 30 : ct)) \
    ${CONF_ARGS:---size native --workers ${JOBS:-14}} 2>&1 | tee "$OUT/conformance.log" | grep -vE "^\[.* pass " | tail -60
  conf_rc=${PIPESTATUS[0]}
fi
if has passes; then
  timeout "${PASSES_TIMEOUT:-540}" python3 tools/pass_sweep.py --out "$OUT/passes" --workers "${JOBS:-14}" 2>&1 \
    | tee "$OUT/passes.log" | tail -30
  passes_rc=${PIPESTATUS[0]}
fi
t0=$(date +%s)
# -vv (-q comes from pyproject): one line per test as it ends, so a run cut by TESTS_TIMEOUT still names what failed and counts
# what passed (a run cut at 420 s on 2026-11-21 left only progress dots and one anonymous F).
# Without arguments: tests/ spread test by test (--dist load: one Triton file is too long for one worker),
# then the notebooks file by file (their cells must run in order in one kernel).
pytest_part() {
  local left=$(( ${TESTS_TIMEOUT:-3600} - ($(date +%s) - t0) ))
  [ "$left" -gt 10 ] || return 124
  if [ -n "${TESTS_RESUME:-}" ]; then        # the tests of "$@" that the earlier logs did not finish
    local ids; mapfile -t ids < <(python3 - "$@" <<'PY'
import os, re, subprocess, sys
done = set()
for log in os.environ["TESTS_RESUME"].split():
    for line in open(log, errors="replace"):
        m = re.match(r"\[gw\d+\] \[ *\d+%\] (PASSED|SKIPPED) (\S.*?)\s*$", line)
        if m:
            done.add(m.group(2))
args = sys.argv[3:]                     # after --dist MODE
out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-p", "no:cacheprovider", *args],
                     capture_output=True, text=True).stdout
left = [i for i in (l.strip() for l in out.splitlines()) if "::" in i and i not in done]
# a notebook's cells run in order in one kernel: a notebook not finished runs whole
print("\n".join(dict.fromkeys(i.split("::")[0] if i.startswith(("book/", "exercises/")) else i for i in left)))
PY
)
    echo "resuming: ${#ids[@]} tests or notebooks not finished by ${TESTS_RESUME}" | tee -a "$OUT/pytest.log"
    [ "${#ids[@]}" -gt 0 ] || return 0
    set -- "$1" "$2" "${ids[@]}"             # every call passes --dist MODE first
  fi
  timeout -s INT -k 30 "$left" python3 -m pytest -n "${JOBS:-14}" -p no:cacheprovider -vv -rfE --durations=10 "$@" 2>&1 \
    | tee -a "$OUT/pytest.log" | grep -E " (FAILED|ERROR) |passed|failed" | tail -40
  return "${PIPESTATUS[0]}"
}
if has tests; then
  : > "$OUT/pytest.log"
  if [ $# -gt 0 ]; then
    pytest_part --dist loadfile "$@"; tests_rc=$?
  else
    pytest_part --dist load tests; tests_rc=$?
    # the longest notebooks first: --dist loadfile hands files out in the order collected
    nb_first="book/14_training.py book/13_backward_triton.py exercises/14_layers.py exercises/13_backward_triton.py
              book/11_kda_triton.py book/10_gla_triton.py book/16_packing.py book/15_inference.py"
    pytest_part --dist loadfile $nb_first $(ls book/[0-9]*.py exercises/[0-9]*.py | grep -vxF -f <(printf '%s\n' $nb_first)); rc2=$?
    [ "$tests_rc" = 0 ] && tests_rc=$rc2
  fi
fi
t1=$(date +%s)
if has bench; then
timeout "${BENCH_TIMEOUT:-3600}" python3 tools/bench.py --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log" | tail -60
bench_rc=${PIPESTATUS[0]}
fi
t2=$(date +%s)
cp_rc=skipped
if has cp && [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ] && [ -f tools/cp_nccl.py ]; then
  python3 tools/cp_nccl.py --backend nccl 2>&1 | tee "$OUT/cp_nccl.log" | tail -20
  cp_rc=${PIPESTATUS[0]}
fi
{
  echo "# GPU validation report — $(date -u +%Y-%m-%dT%H:%MZ)"
  echo; echo '```'; cat "$OUT/versions.txt"; echo '```'
  echo; echo "## Conformance suite, natively: exit $conf_rc"
  if [ -f "$OUT/conformance/summary.md" ]; then cat "$OUT/conformance/summary.md"
  elif [ -f "$OUT/conformance.log" ]; then echo '```'; tail -20 "$OUT/conformance.log"; echo '```'; fi
  echo; echo "## Sequential passes of the delta family, natively: exit $passes_rc"
  [ -f "$OUT/passes/summary.md" ] && cat "$OUT/passes/summary.md"
  echo; echo "## Tests + notebooks (nbval), natively: exit $tests_rc, $((t1 - t0)) s"
  [ -f "$OUT/pytest.log" ] && { echo '```'; grep -E " (FAILED|ERROR) " "$OUT/pytest.log" | sort -u | head -40
                                 echo "passed so far: $(grep -c ' PASSED ' "$OUT/pytest.log")"
                                 [ "$tests_rc" = 124 ] && echo "cut by TESTS_TIMEOUT=${TESTS_TIMEOUT:-}"
                                 grep -E "^=+ .*(passed|failed).* =+$" "$OUT/pytest.log"; echo '```'; }
  echo; echo "## Benchmarks: exit $bench_rc, $((t2 - t1)) s"
  [ -f "$OUT/bench.md" ] && cat "$OUT/bench.md"
  echo; echo "## Context parallel over NCCL: $cp_rc"
  [ -f "$OUT/cp_nccl.log" ] && { echo '```'; tail -12 "$OUT/cp_nccl.log"; echo '```'; }
} > "$OUT/report.md"
cat "$OUT/report.md"
[ "$conf_rc" != 0 ] && [ "$conf_rc" != skipped ] && exit 1
[ "$passes_rc" != 0 ] && [ "$passes_rc" != skipped ] && exit 1
[ "$tests_rc" != 0 ] && [ "$tests_rc" != skipped ] && exit 1
[ "$bench_rc" != 0 ] && [ "$bench_rc" != skipped ] && exit 1
exit 0
