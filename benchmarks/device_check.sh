#!/usr/bin/env bash
# GPU check of the engine and the attention kernels, in the order of what a session most needs answered. First, issue
# 66's tables (benchmarks/device_check_decode.py; benchmarks/README.md "On a GPU: what the next run prints"): decode at
# Qwen3-0.6B shapes in bfloat16 at 1/8/64 rows x decode_steps 1/8 (ms/step, tok/s, host µs per dispatch, HBM share);
# at 1 row the parent commit's sampler (8a0ce4b: forward + sampler, two dispatches, device-decided branches) beside
# today's decode_sample with XLA's command buffers as shipped, off and +CONDITIONAL,+WHILE; conditional and while
# thunks per step (TF_CPP_VMODULE log lines); then the seed's workload on one GPU (Qwen2.5-32B shapes, random
# weights made on the device, prompt 8,192, gen 128, 1/2/4/8 requests, beside the seed's TP2 numbers). Those fit
# the 8-minute budget; what follows runs only while budget is left (BUDGET=900 for all of it), and a skip there
# does not fail the run. The earlier checks (first run on
# an H200, 2026-12-04: benchmarks/README.md "On a GPU"): the engine with each attention path (xla | pallas | triton):
# greedy tokens equal to XLA's, and decode tok/s; the engine at Qwen3-0.6B shapes in bfloat16 (random weights) at
# 1/8/32/64 requests under xla and pallas, each with its share of the measured read bandwidth (HBM) at 1, and pallas
# at 1 request (launch-bound) with command buffers (CUDA graphs) the other way (jax#27988: $CMDBUF_FLAGS); issue 68's
# mixture-of-experts decode (qwen3-moe beside qwen3-moe-dense, experts through XLA's ragged_dot); the kernel
# timings (our decode and prefill kernels beside XLA's attention, JAX's GQA kernel and cuDNN's
# `jax.nn.dot_product_attention`, same shapes); the Pallas kernel tests compiled for the GPU (not interpreted) and
# the Triton kernels' numerics through jax-triton. Run from the repo root on a machine whose python already has jax
# with CUDA (+ jax-triton and triton for the Triton path: `pip install -e ".[cuda12]"`); installs nothing (the
# environment step lists what pocketjax would import and cannot: the engine runs without llguidance and the server's
# packages). Everything lands in $OUT (default ./out).
# Budget: $BUDGET seconds (default 480: 8 minutes) for the whole run: each step has its own cap and never
# runs past what is left; a step the budget leaves no time for says so ("budget: skipped") and fails the run.
#   OUT=./out bash benchmarks/device_check.sh
# --dry-run (CI's second leg, on CPU, under the GPU host's Python/JAX): every step up to its first call that needs
# a GPU, at the smallest sizes: the environment report, the kernel tests collected (and the no-pytest runner's
# calls built) but not run, the kernel timings interpreted, the engine paths on XLA, the 0.6B step on the micro
# preset with the same flags, issue 66's parts on the micro presets (qwen2.5-micro with int8 linears, stacked, for
# the seed's workload); each part left out says so in a "dry run: skipped" line. A script error, a renamed
# flag or an import this JAX broke fails here, not in a GPU session's 15 minutes.
#   OUT=/tmp/dry PYTHON=.venv312/bin/python bash benchmarks/device_check.sh --dry-run
set -uo pipefail

DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  *) echo "usage: bash benchmarks/device_check.sh [--dry-run]" >&2; exit 2 ;;
esac
OUT=${OUT:-./out}
mkdir -p "$OUT"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python}
if [ "$DRY" -eq 1 ]; then
  export JAX_PLATFORMS=cpu                     # POCKETJAX_KERNEL_TEST_MODE stays unset: tests import interpreted
  COLLECT=(--collect-only)                     # the GPU tests are collected, never run
  skipped() { echo "dry run: skipped: $* (needs a GPU)" | tee -a "$OUT/summary.txt"; }
else
  export JAX_PLATFORMS=cuda                    # tests/conftest.py only sets cpu when this is unset
  export POCKETJAX_KERNEL_TEST_MODE=gpu        # tests/test_kernels.py: interpret=False on the GPU
  COLLECT=()
fi
has_pytest=0; "$PY" -c "import pytest" 2>/dev/null && has_pytest=1
# Pallas-Triton custom calls (target __gpu$xla.gpu.triton) and XLA's command buffers (CUDA graphs): decode at batch 1
# on Hopper is launch-bound, so one graph launch per step instead of one per kernel is the difference measured.
# jax#27988's workaround captures them where XLA leaves them out by default; a jaxlib whose XLA no longer knows that
# flag (0.10.2 here: "Unknown flag", and XLA aborts on any backend) captures compatible custom calls by default, and
# the other side of the comparison is then command buffers off.
CMDBUF_ON='--xla_gpu_enable_command_buffer=+CUSTOM_CALL'
CMDBUF_ON+=' --legacy_command_buffer_custom_call_targets=__gpu$xla.gpu.triton'
CMDBUF_OFF='--xla_gpu_enable_command_buffer='
BUDGET=${BUDGET:-$([ "$DRY" -eq 1 ] && echo 1800 || echo 480)}  # the dry run on busy CPUs is slower, and untimed
LATER=0  # 1 once issue 66's tables are done: the steps after them run only while budget is left
capped() {  # capped SECONDS CMD...: CMD under `timeout`, at most SECONDS and never past the budget
  local cap=$1 rest=$((BUDGET - SECONDS)); shift
  [ "$rest" -lt "$cap" ] && cap=$rest
  if [ "$cap" -lt 10 ]; then
    if [ "$LATER" -eq 1 ]; then  # after the tables the budget is sized for: said, not a failure
      echo "budget: skipped, past the budgeted tables (${SECONDS}s of ${BUDGET}s spent): ${*:1:3}" \
        | tee -a "$OUT/summary.txt"; return 0
    fi
    echo "budget: skipped (${SECONDS}s of ${BUDGET}s spent): ${*:1:3}" | tee -a "$OUT/summary.txt"; return 124
  fi
  timeout "$cap" "$@"
}

echo "== environment" | tee "$OUT/summary.txt"
capped 60 "$PY" - <<'EOF' 2>&1 | tee "$OUT/env.txt" | tee -a "$OUT/summary.txt"
import jax, jaxlib
from pallas_kernels import tuning
from pocketjax.model.layers import resolve_impl
d = jax.devices()[0]
print("jax", jax.__version__, "jaxlib", jaxlib.__version__)
print("device", d.platform, d.device_kind, "cc", getattr(d, "compute_capability", None),
      "SMs", getattr(d, "core_count", None))
print("target", tuning.target(d), "| auto ->", resolve_impl("auto", device=d),
      "| Pallas Triton:", tuning.triton_unsupported(d) or "supported")
print("decode blocks bf16 D=128:", tuning.block_sizes("decode", 128, "bfloat16", d))
print("prefill blocks bf16 D=128:", tuning.block_sizes("prefill", 128, "bfloat16", d))
print("jax-triton:", tuning.jax_triton_unsupported(d) or "importable", "| triton ->", resolve_impl("triton", device=d))
import importlib.util
optional = ("llguidance", "fastapi", "uvicorn", "prometheus_client", "flax", "optax", "huggingface_hub", "jinja2")
print("not importable (structured outputs / the server / nnx need them, not the engine):",
      ", ".join(m for m in optional if importlib.util.find_spec(m) is None) or "none")
EOF
env_rc=${PIPESTATUS[0]}

# ---- issue 66: host-free decode, the tables a short lease must still yield (benchmarks/device_check_decode.py)
DCD=benchmarks/device_check_decode.py
CMDBUF_CW='--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE'  # XLA's default set plus conditionals and loops
TABLE_ARGS=() SAMPLER_ARGS=() SEED_ARGS=() X=1  # X: the caps' factor (the dry run compiles on busy CPUs)
if [ "$DRY" -eq 1 ]; then
  X=5
  skipped "issue 66 at Qwen3-0.6B / Qwen2.5-32B shapes: the micro presets at 1/2 rows and requests instead"
  TABLE_ARGS=(--preset qwen3-micro --rows 1,2 --steps 1,2 --prompt-len 8 --gen-len 5 --probe-bytes 16777216)
  SAMPLER_ARGS=(--preset qwen3-micro --prompt-len 8 --timed-steps 4)
  SEED_ARGS=(--preset qwen2.5-micro --weights int8 --scan on --requests 1,2 --prompt-len 40 --gen-len 6
             --prefill-chunk 16 --decode-steps 2)
fi
echo "== decode at Qwen3-0.6B shapes, bfloat16: 1/8/64 rows x decode_steps 1/8 through the engine's pipelined" \
  "loop: ms/step, tok/s, host µs per dispatch, HBM share" | tee -a "$OUT/summary.txt"
capped $((130 * X)) "$PY" "$DCD" table --dtype bfloat16 "${TABLE_ARGS[@]}" --json "$OUT/decode_table.json" 2>&1 \
  | tee "$OUT/decode_table.log"
table_rc=${PIPESTATUS[0]}
sed -n '/^read bandwidth/,$p' "$OUT/decode_table.log" | grep -vE '^[IWE][0-9]{4} ' >> "$OUT/summary.txt"

echo "== at 1 row: 8a0ce4b's sampler (forward + sampler, two dispatches) vs decode_sample, greedy and top-p, with" \
  "command buffers as shipped, off ($CMDBUF_OFF) and $CMDBUF_CW" | tee -a "$OUT/summary.txt"
sampler_rc=0
for setting in shipped off conditional_while; do
  case $setting in
    shipped) flags=${XLA_FLAGS:-} ;;
    off) flags="${XLA_FLAGS:-} $CMDBUF_OFF" ;;
    conditional_while) flags="${XLA_FLAGS:-} $CMDBUF_CW" ;;
  esac
  more=(); [ "$DRY" -eq 1 ] && [ "$setting" != shipped ] && more=(--samplings greedy)  # the flags parse: enough
  XLA_FLAGS="$flags" capped $((50 * X)) "$PY" "$DCD" sampler --label "$setting" --dtype bfloat16 "${SAMPLER_ARGS[@]}" \
    "${more[@]}" --json "$OUT/sampler_$setting.json" 2>&1 | tee "$OUT/sampler_$setting.log"
  rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && sampler_rc=$rc
  sed -n "/^$setting:/,\$p" "$OUT/sampler_$setting.log" | grep -vE '^[IWE][0-9]{4} ' >> "$OUT/summary.txt"
done

echo "== conditional and while thunks per step (TF_CPP_VMODULE=conditional_thunk=3,while_thunk=3, log lines" \
  "between each timed loop's markers), command buffers as shipped" | tee -a "$OUT/summary.txt"
TF_CPP_VMODULE=conditional_thunk=3,while_thunk=3 TF_CPP_MIN_LOG_LEVEL=0 capped $((50 * X)) "$PY" "$DCD" sampler \
  --label thunks --timed-steps 8 --markers --dtype bfloat16 "${SAMPLER_ARGS[@]}" --json "$OUT/thunks_run.json" \
  > "$OUT/thunks_run.log" 2> "$OUT/thunks_vlog.log"
thunks_rc=$?
if [ "$thunks_rc" -eq 0 ]; then
  "$PY" "$DCD" thunks "$OUT/thunks_vlog.log" --json "$OUT/thunks.json" 2>&1 | tee -a "$OUT/summary.txt"
  thunks_rc=${PIPESTATUS[0]}
else
  tail -n 5 "$OUT/thunks_vlog.log" | tee -a "$OUT/summary.txt"
fi

echo "== the seed's workload on one GPU: Qwen2.5-32B shapes, 64 layers, random weights made on the device (bf16;" \
  "int8 linears where bf16 does not fit), prompt 8192, gen 128, 1/2/4/8 requests" | tee -a "$OUT/summary.txt"
capped $((200 * X)) "$PY" "$DCD" seed "${SEED_ARGS[@]}" --json "$OUT/seed_workload.json" 2>&1 \
  | tee "$OUT/seed_workload.log"
seed_rc=${PIPESTATUS[0]}
sed -n '/^qwen2.5/,$p' "$OUT/seed_workload.log" | grep -vE '^[IWE][0-9]{4} ' >> "$OUT/summary.txt"
decode66_rc=0
for rc in $table_rc $sampler_rc $thunks_rc $seed_rc; do [ "$rc" -ne 0 ] && decode66_rc=$rc; done
echo "issue 66: table rc=$table_rc sampler rc=$sampler_rc thunks rc=$thunks_rc seed rc=$seed_rc" \
  | tee -a "$OUT/summary.txt"
LATER=1

# which side of the command-buffer comparison this jaxlib takes (each probe: a fresh jax import under the flags)
accepts() { XLA_FLAGS="${XLA_FLAGS:-} $1" capped 60 "$PY" -c "import jax; jax.devices()" >/dev/null 2>&1; }
note() { echo "$*" | tee -a "$OUT/env.txt" | tee -a "$OUT/summary.txt"; }
if accepts "$CMDBUF_ON"; then
  CMDBUF_RUN=pallas_cmdbuf CMDBUF_FLAGS=$CMDBUF_ON
  note "command buffers: jax#27988's workaround accepted: pallas runs without and with $CMDBUF_ON"
elif accepts "$CMDBUF_OFF"; then
  CMDBUF_RUN=pallas_nocmdbuf CMDBUF_FLAGS=$CMDBUF_OFF
  note "command buffers: --legacy_command_buffer_custom_call_targets unknown to this jaxlib (it captures custom" \
    "calls by default): pallas runs with XLA's default and with $CMDBUF_OFF"
else
  CMDBUF_RUN="" CMDBUF_FLAGS="" env_rc=1
  note "command buffers: neither flag set parses in this jaxlib: no comparison"
fi

echo "== engine per attention path: greedy tokens vs XLA, decode tok/s" | tee -a "$OUT/summary.txt"
ENGINE_ARGS=(); [ "$DRY" -eq 1 ] && ENGINE_ARGS=(--max-tokens 4)  # on CPU every path falls back to XLA
capped 100 "$PY" benchmarks/device_check_engine.py --json "$OUT/engine_attention.json" "${ENGINE_ARGS[@]}" 2>&1 \
  | tee "$OUT/engine_attention.log"
engine_rc=${PIPESTATUS[0]}
sed -n '/^impl/,$p' "$OUT/engine_attention.log" >> "$OUT/summary.txt"

echo "== engine decode at Qwen3-0.6B shapes, bfloat16: tok/s at 1/8/32/64 requests under xla and pallas, HBM share" \
  "at 1; pallas at 1 request with command buffers the other way" | tee -a "$OUT/summary.txt"
big_rc=0
BIG_ARGS=(--model qwen3-0.6b --prompt-len 128 --gen-len 32)
ALL_C=1,8,32,64 CMDBUF_C=1  # measured on an H200: each concurrency's warm-up (its compiles) takes 15-31 s
if [ "$DRY" -eq 1 ]; then
  skipped "the 0.6B shapes at 1/8/32/64 requests: the micro preset at 1/2 requests instead"
  BIG_ARGS=(--model qwen3-micro --prompt-len 8 --gen-len 2) ALL_C=1,2 CMDBUF_C=1
fi
big() {  # big RUN CAP CONCURRENCY: bench_engine at the 0.6B shapes, one attention path (RUN: xla|pallas|$CMDBUF_RUN)
  local run=$1 cap=$2 conc=$3 flags=${XLA_FLAGS:-} rc
  [ "$run" = "$CMDBUF_RUN" ] && flags="$flags $CMDBUF_FLAGS"
  echo "-- $run at $conc${flags:+ (XLA_FLAGS=$flags)}" | tee -a "$OUT/summary.txt"
  XLA_FLAGS="$flags" capped "$cap" "$PY" benchmarks/bench_engine.py "${BIG_ARGS[@]}" --concurrency "$conc" \
    --dtype bfloat16 --repeats 1 --no-checks --breakdown --peers "" --attention "${run%_*cmdbuf}" \
    --json "$OUT/engine_06b_$run.json" 2>&1 | tee "$OUT/engine_06b_$run.log"
  rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && big_rc=$rc
  # the per-concurrency lines come as each ends (a run its cap cuts keeps them); the table at the end
  grep -E '^pocketjax c=' "$OUT/engine_06b_$run.log" >> "$OUT/summary.txt"
  sed -n '/^peaks/,$p' "$OUT/engine_06b_$run.log" >> "$OUT/summary.txt"
}
big xla 140 "$ALL_C"  # the first run also writes the random-weight checkpoint under /tmp (not in $OUT): ~20 s
big pallas 120 "$ALL_C"
[ -n "$CMDBUF_RUN" ] && big "$CMDBUF_RUN" 60 "$CMDBUF_C"

echo "== mixture-of-experts (issue 68): the qwen3-moe preset (Qwen3-30B-A3B's layer shapes: 128 experts, 8 active," \
  "4 layers, random weights) beside qwen3-moe-dense (the same active parameters), bfloat16, xla attention, experts" \
  "through XLA's grouped ragged_dot: tok/s at 1/8/32 requests" | tee -a "$OUT/summary.txt"
moe_rc=0
MOE_MODELS=(qwen3-moe qwen3-moe-dense) MOE_ARGS=(--prompt-len 128 --gen-len 32 --concurrency 1,8,32)
if [ "$DRY" -eq 1 ]; then
  skipped "the qwen3-moe shapes: qwen3-moe-micro and qwen2-moe-micro at 1/2 requests instead"
  MOE_MODELS=(qwen3-moe-micro qwen2-moe-micro) MOE_ARGS=(--prompt-len 8 --gen-len 2 --concurrency 1,2)
fi
for model in "${MOE_MODELS[@]}"; do  # the first writes its 6 GB checkpoint under /tmp (~1 min)
  capped $((120 * X)) "$PY" benchmarks/bench_engine.py --model "$model" "${MOE_ARGS[@]}" --dtype bfloat16 \
    --repeats 1 --no-checks --breakdown --peers "" --attention xla --json "$OUT/engine_$model.json" 2>&1 \
    | tee "$OUT/engine_$model.log"
  rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && moe_rc=$rc
  grep -E '^pocketjax c=' "$OUT/engine_$model.log" >> "$OUT/summary.txt"
done

echo "== kernel timings" | tee -a "$OUT/summary.txt"
KERNEL_ARGS=(); [ "$DRY" -eq 1 ] && KERNEL_ARGS=(--smoke)  # every implementation once, interpreted, tiny
capped 100 "$PY" benchmarks/kernels.py --json "$OUT/kernels.json" "${KERNEL_ARGS[@]}" 2>&1 \
  | tee "$OUT/kernels_bench.log"
bench_rc=${PIPESTATUS[0]}
sed -n '/^peak copy bandwidth/,$p' "$OUT/kernels_bench.log" >> "$OUT/summary.txt"

echo "== kernel tests (GPU, not interpreted)" | tee -a "$OUT/summary.txt"
[ "$DRY" -eq 1 ] && skipped "running the kernel tests compiled for the GPU: collected only"
test_rc=0
: > "$OUT/kernel_tests.log"
if [ "$has_pytest" -eq 1 ]; then
  capped 120 "$PY" -m pytest tests/test_kernels.py -q -p no:cacheprovider -o addopts="" "${COLLECT[@]}" \
    --junitxml "$OUT/kernel_tests.xml" 2>&1 | tee "$OUT/kernel_tests.log"
  test_rc=${PIPESTATUS[0]}
fi
if [ "$has_pytest" -eq 0 ] || [ "$DRY" -eq 1 ]; then
  # No pytest on this machine: run every test function with a stand-in for the few pytest APIs used. The dry run
  # builds its calls too (without running them), so a pytest API the stand-in lacks fails there.
  [ "$DRY" -eq 1 ] && skipped "the no-pytest runner's kernel test calls: built, not run"
  DRY=$DRY capped 150 "$PY" - <<'EOF' 2>&1 | tee -a "$OUT/kernel_tests.log"
import contextlib, inspect, os, sys, traceback, types
import jax, jaxlib, numpy, pallas_kernels  # before the stand-in: libraries probe for a real pytest
from jax.experimental.pallas.ops.gpu import decode_attention  # noqa: F401
pytest = types.ModuleType("pytest")
class _Skip(Exception): pass
def _param(name, values, ids=None):
    def wrap(f):
        f.__dict__.setdefault("_params", []).append((name, values)); return f
    return wrap
def _skipif(cond, reason=""):
    def wrap(f):
        f._skip = bool(cond); return f
    return wrap
@contextlib.contextmanager
def _raises(exc):
    try:
        yield
    except exc:
        return
    raise AssertionError(f"did not raise {exc}")
pytest.mark = types.SimpleNamespace(parametrize=_param, skipif=_skipif)
pytest.raises, pytest.skip = _raises, lambda *a, **k: (_ for _ in ()).throw(_Skip())
sys.modules["pytest"] = pytest
import tests.test_kernels as t  # conftest is pytest-only; the env above replaces it
failed = passed = built = 0
for name in [n for n in dir(t) if n.startswith("test_")]:
    fn = getattr(t, name)
    if getattr(fn, "_skip", False):
        continue
    given = {n.strip() for names, _ in getattr(fn, "_params", []) for n in names.split(",")}
    if fixtures := sorted(set(inspect.signature(fn).parameters) - given):  # conftest's: pytest-only
        print("skipped", name, "(needs the pytest fixtures", ", ".join(fixtures) + ")")
        continue
    calls = [{}]
    for names, values in getattr(fn, "_params", []):  # every combination, "a, b" names taking tuples
        names = [n.strip() for n in names.split(",")]
        values = [v if len(names) > 1 else (v,) for v in values]
        calls = [{**c, **dict(zip(names, v))} for c in calls for v in values]
    built += len(calls)
    if os.environ["DRY"] == "1":
        continue
    for kw in calls:
        try:
            fn(**kw); passed += 1
        except _Skip:
            pass
        except Exception:
            failed += 1; print("FAILED", name, kw); traceback.print_exc()
if os.environ["DRY"] == "1":
    print(f"dry run: {built} kernel test calls built")
    sys.exit(0 if built else 1)
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
EOF
  rc=${PIPESTATUS[0]}; [ "$rc" -ne 0 ] && test_rc=$rc
fi
tail -n 3 "$OUT/kernel_tests.log" >> "$OUT/summary.txt"

echo "== Triton kernels through jax-triton (numerics vs the XLA reference)" | tee -a "$OUT/summary.txt"
if [ "$DRY" -eq 0 ] && ! "$PY" -c "import jax_triton" 2>/dev/null; then
  # The GPU host has Triton but no jax-triton (and no network): attention_impl="triton" falls back to XLA there.
  echo "skipped: the Triton kernels through jax-triton: jax-triton is not importable here" \
    | tee -a "$OUT/summary.txt" | tee "$OUT/triton_tests.log"
  triton_rc=0
else
  [ "$DRY" -eq 1 ] && skipped "the Triton kernels launched through jax-triton: collected only"
  capped 90 "$PY" -m pytest tests/test_triton_kernels.py -q -p no:cacheprovider -o addopts="" -k numerics \
    "${COLLECT[@]}" --junitxml "$OUT/triton_tests.xml" 2>&1 | tee "$OUT/triton_tests.log"
  triton_rc=${PIPESTATUS[0]}
fi
tail -n 3 "$OUT/triton_tests.log" >> "$OUT/summary.txt"

echo "($SECONDS s of the ${BUDGET} s budget)" | tee -a "$OUT/summary.txt"
echo "env rc=$env_rc issue66 rc=$decode66_rc tests rc=$test_rc triton rc=$triton_rc bench rc=$bench_rc" \
  "engine rc=$engine_rc 0.6b rc=$big_rc moe rc=$moe_rc" | tee -a "$OUT/summary.txt"
[ "$env_rc" -eq 0 ] && [ "$decode66_rc" -eq 0 ] && [ "$test_rc" -eq 0 ] && [ "$triton_rc" -eq 0 ] \
  && [ "$bench_rc" -eq 0 ] && [ "$engine_rc" -eq 0 ] && [ "$big_rc" -eq 0 ] && [ "$moe_rc" -eq 0 ]
