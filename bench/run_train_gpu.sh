#!/usr/bin/env bash
# Issue 13 on one GPU machine, in one device call (< 9 minutes): ranks as emulated hosts on the
# local GPU(s), each in its own network namespace with a tc-tbf-shaped veth, NCCL over sockets.
# Run from the repository root as root, carrying .tools (ip, tc and their libraries, made by
# bench/collect_tools.sh on a machine that has iproute2) and optionally .whl (DeepSpeed wheels):
#
#     OUT=... bash bench/run_train_gpu.sh
#
# Phases, each under its own time limit and skipped when the 9 minutes would run out (PHASES picks
# them, default "timing loss sweep"; the build always runs), in this order:
#   1. build compcomm (NCCL headers from the nvidia-nccl wheel)
#   3. training timing runs (compcomm-bench train --timing-only): eth1g, eth10g, unshaped, W=4
#   4. loss runs: OneBitAdam / OneBitLamb vs their uncompressed twins, W=4 (eth10g), 40 steps
#   2. collective sweep on the emulated hosts (bench/bench_nccl.py --profile): eth1g and eth10g, W=4
# Without working network namespaces (no .tools, not root) everything runs on loopback instead.
# $OUT receives at most 8 files: run.log, the markdown tables and plots, results.tar.gz (all JSON,
# plots and logs).
set -u -o pipefail
T0=$(date +%s)
LIMIT=${LIMIT:-525}                      # seconds for the whole script (the call allows 540+)
OUT=${OUT:-$PWD/out/train}
WORK=$(mktemp -d /tmp/train_gpu.XXXX)
mkdir -p "$OUT" "$WORK/logs"
PY=${PYTHON:-python3}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
[ -d .tools/bin ] && export PATH="$PWD/.tools/bin:$PATH"
log() { echo "[$(date +%T) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/run.log"; }
left() { echo $(( LIMIT - ( $(date +%s) - T0 ) )); }
# run NAME BUDGET CMD...: at most BUDGET seconds and never past the limit; output in logs/NAME.log
run() {
  local name=$1 budget=$2; shift 2
  local l; l=$(left); [ "$budget" -gt $(( l - 15 )) ] && budget=$(( l - 15 ))
  if [ "$budget" -lt 30 ]; then log "SKIP $name: only ${l}s left"; return 99; fi
  log "$name (limit ${budget}s): $*"
  timeout -k 10 "$budget" "$@" >"$WORK/logs/$name.log" 2>&1
  local rc=$?
  log "$name rc=$rc"; grep -E "^\[train\]|FAILED|Error|error" "$WORK/logs/$name.log" | tail -25 | tee -a "$OUT/run.log"
  return $rc
}
finish() {
  [ -n "${MPS_ON:-}" ] && { echo quit | nvidia-cuda-mps-control; log "MPS daemon stopped"; }
  cp "$WORK"/*.md "$WORK"/*.json "$WORK"/*.png "$WORK/logs/" 2>/dev/null
  tar -czf "$OUT/results.tar.gz" -C "$WORK" . 2>/dev/null
  ls -la "$OUT" | tee -a "$OUT/run.log"
  log "done"
}
trap finish EXIT

log "python: $($PY -c 'import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.device_count(), "GPU(s)")')"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$OUT/run.log" 2>&1
log "ip: $(command -v ip || echo missing), tc: $(command -v tc || echo missing)"

# DeepSpeed 0.19.6 (NcclBackend, needs cupy) from .whl, when carried
for d in .whl ../.whl; do
  if ls $d/deepspeed-*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$d"/*.whl >"$WORK/logs/pip_deepspeed.log" 2>&1 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} \
      && log "deepspeed wheels from $d" || log "deepspeed install failed"
    break
  fi
done

# 1. build
NCCL_INCLUDE_DIR=$($PY -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "include"))' 2>/dev/null)
export NCCL_INCLUDE_DIR
if [ "${SKIP_BUILD:-0}" = 1 ]; then log "build skipped (SKIP_BUILD=1: installed by an earlier call)"
elif ! run build 240 $PY -m pip install --no-build-isolation --no-deps .; then
  tail -40 "$WORK/logs/build.log" | tee -a "$OUT/run.log"; exit 1
fi
(cd /tmp && $PY -c 'import compcomm, json; print(json.dumps(compcomm.build_info()))') | tee -a "$OUT/run.log"

PROFILES_OK=1
if ! (command -v ip && command -v tc && ip netns add ccbn-probe-$$ && ip netns del ccbn-probe-$$) >>"$OUT/run.log" 2>&1; then
  log "network namespaces unusable here (no .tools? not root?): only the loopback profile"; PROFILES_OK=0
fi
P1=eth1g; P10=eth10g; PU=unshaped; [ $PROFILES_OK = 1 ] || { P1=loopback; P10=; PU=; }

PHASES=${PHASES:-"timing loss sweep"}
has() { case " $PHASES " in *" $1 "*) return 0 ;; esac; return 1; }

# OneBitAdam/ZeroOneAdam: one compressed allreduce per param group (fused=True) where the installed
# optimizers still default to one per parameter; nothing where they are bucketed by default.
FUSED_FLAG=${FUSED_FLAG-$($PY -c 'import inspect, compcomm.optim as o; p = inspect.signature(o.OneBitAdam).parameters.get("fused"); print("--fused" if p is not None and p.default is False else "")' 2>/dev/null)}
# bias_correction=True: with the default (False) a variance frozen after a short warm-up is far too
# small and OneBitAdam/ZeroOneAdam diverge within a few steps (seen: freeze_step 1 on the H200, loss
# 5.3 -> 66 -> NonFiniteError); it changes neither the bytes nor the cost of a step.
TIMING_FLAGS=${TIMING_FLAGS---bias-correction}
LOSS_FLAGS=${LOSS_FLAGS---bias-correction}
# MPS=1: the ranks' kernels run side by side under an MPS daemon (started here, stopped on exit)
# instead of time-slicing the GPU. Without it every collective of W processes sharing one GPU pays
# tens of ms of context switching (a 2^16-element NCCL allreduce took 27 ms at W=4), which separate
# hosts do not; with it the shared GPU behaves more like W GPUs. Results get the suffix _mps.
SFX=
if [ "${MPS:-0}" = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/ccmps/pipe CUDA_MPS_LOG_DIRECTORY=/tmp/ccmps/log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  if command -v nvidia-cuda-mps-control >/dev/null && nvidia-cuda-mps-control -d; then
    MPS_ON=1; SFX=_mps; log "MPS daemon started"
  else
    log "MPS unavailable (no nvidia-cuda-mps-control or it failed): time-sliced GPU"
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  fi
fi
log "phases: $PHASES; optimizer flags: '${FUSED_FLAG}', timing '${TIMING_FLAGS}', loss '${LOSS_FLAGS}'"

# 3. training timing runs: ~121M-parameter byte-level GPT, bf16 autocast, batch 8 x 256 per rank
#    (in order of importance: eth1g holds most targets; unshaped is the efficiency reference)
# LOCAL_STEP_SCALER: ZeroOneAdam local_step_scaler (default 1: local steps from the start; 32678 is
# the optimizer default, no local steps in a short run). WORLD: ranks (emulated hosts);
# TIMING_EXTRA: more train flags (e.g. --reduce-bucket-size 16777216),
# TAG: a suffix for the result names so several calls of this script do not overwrite each other
WORLD=${WORLD:-4}; TAG=${TAG:-}; [ "$WORLD" = 4 ] || TAG="_w$WORLD$TAG"
TIMING_OPTS=${TIMING_OPTS:-ddp_adamw,ddp_adamw_bf16hook,onebitadam,zerooneadam,zero2_adamw,zero2_onebitadam}
if has timing; then
  for P in ${TIMING_PROFILES:-$P1 $P10 $PU}; do
    case $P in eth1g) B=${B1G:-165}; MS=${MS1G:-22} ;; *) B=${B10G:-65}; MS=${MS10G:-10} ;; esac
    OPTS=$TIMING_OPTS; [ $P = eth1g ] || OPTS=${TIMING_OPTS_FAST:-$TIMING_OPTS}
    run timing_$P$TAG $B $PY -m compcomm.bench train --device cuda --profile $P --world-size $WORLD --model gpt2s \
      --optimizers "$OPTS" $FUSED_FLAG $TIMING_FLAGS ${TIMING_EXTRA:-} --steps ${TIMING_STEPS:-6} --baseline-steps 3 --warmup 2 --lr 1e-4 --local-step-scaler ${LOCAL_STEP_SCALER:-1} \
      --timing-only --compute-steps 2 --max-seconds $MS --timeout $(( B - 5 )) --out "$WORK" --name train_timing_$P$TAG$SFX
  done
  # one table over the profiles (the efficiency check needs unshaped next to the shaped ones)
  $PY - "$WORK" "$SFX" <<'PYEOF' >>"$OUT/run.log" 2>&1
import glob, json, os, sys
from compcomm.bench import train
w = sys.argv[1]
docs = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(w, "train_timing_*%s.json" % sys.argv[2])))]
docs = [d for d in docs if d["rows"]]
if docs:
    doc = {"meta": docs[0]["meta"], "rows": [r for d in docs for r in d["rows"]]}
    doc["meta"]["command"] = " ; ".join(d["meta"]["command"] for d in docs)
    print(train.write_outputs(doc, w, "train_gpu_timing" + sys.argv[2]))
PYEOF
  cp "$WORK"/train_gpu_timing$SFX.md "$WORK"/train_gpu_timing$SFX.png "$OUT/" 2>/dev/null
  cp "$WORK"/train_gpu_timing$SFX.md "$WORK"/train_gpu_timing$SFX.json "$OUT/" 2>/dev/null
fi

# 4. loss runs (equal steps vs the uncompressed twin, freeze_step past the run; LOSS_FLAGS come last
#    so they override the defaults, e.g. "--bias-correction --lr-schedule cosine --lr-warmup 30
#    --eval-every 50"): the twins average
#    fp32 gradients every step (~1.1 s at W=4 on eth10g, the fastest emulated link measured)
if has loss; then
  LP=${LOSS_PROFILE:-${P10:-loopback}}
  run loss_$LP ${LOSS_BUDGET:-150} $PY -m compcomm.bench train --device cuda --profile $LP --world-size $WORLD --model gpt2s \
    --optimizers ${LOSS_OPTS:-onebitadam,onebitadam_nofreeze,onebitlamb,onebitlamb_nofreeze} $FUSED_FLAG \
    --steps ${LOSS_STEPS:-40} --warmup ${LOSS_WARMUP:-10} --eval-every 10 --val-batches 8 $LOSS_FLAGS \
    --compute-steps 2 --max-seconds ${LOSS_MAXS:-50} --timeout $(( ${LOSS_BUDGET:-150} - 5 )) --out "$WORK" --name train_gpu_loss$SFX
  cp "$WORK"/train_gpu_loss$SFX.md "$WORK"/train_gpu_loss$SFX.png "$OUT/" 2>/dev/null
fi

# 2. collective sweep on emulated hosts, W=4 (quick: 1 warm-up, 1 probe, >= 2 timed calls)
if has sweep; then
  run sweep_$P1 45 $PY bench/bench_nccl.py --profile $P1 --world-size 4 --min-log 16 --max-log 24 \
    --log-step 2 --quick --budget 0.3 --skip nccl_allreduce_nonblocking --out "$WORK/nccl_${P1}_w4" --timeout 40
  [ -n "$P10" ] && run sweep_$P10 40 $PY bench/bench_nccl.py --profile $P10 --world-size 4 --min-log 16 \
    --max-log 26 --log-step 2 --quick --budget 0.2 --skip nccl_allreduce_nonblocking --out "$WORK/nccl_${P10}_w4" --timeout 35
fi
for f in "$WORK"/train_gpu_timing$SFX.md "$WORK"/train_gpu_loss$SFX.md; do [ -f "$f" ] && cat "$f" >>"$OUT/run.log"; done
exit 0
