#!/usr/bin/env bash
# The GPU table (bench/gpu/README.md) in one call on one GPU, about 8 minutes: `make bench`, from the project's root.
# Sections in priority order, each run on its own; a run that would start after BUDGET seconds (default 480) is
# skipped and says so. Every result line goes to $OUT/results.txt as it comes, the runs' last lines to
# $OUT/logs.txt, the table to $OUT/table.md. SECTIONS="speedup perf compile plan resume doctor profile recipe steps probe"
# chooses (not in the default: speedup, the --compile rows alone; recipe, the search for the time-to-99 % recipe
# and its best compiled; steps, what makes a step fast; probe, stage
# 05's step taken apart); QUICK=1 (the default without a GPU) runs them on 640
# images to check the script (bench/gpu/README.md). PY is the Python with torch; RECIPE the time-to-99 % flags.
set -u
OUT=${OUT:-bench-results/gpu}
R=$OUT/results.txt L=$OUT/logs.txt RUNS=$OUT/runs
HERE=$(cd "$(dirname "$0")" && pwd)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PY:-python3}
TR=("$PY" -m torch.distributed.run --standalone --nproc-per-node 1)
SECTIONS=${SECTIONS:-"perf compile plan resume doctor profile"}
RECIPE=${RECIPE:-"--loader device --batch-size 1024 --lr 2.0 --gamma 0.85"}
read -ra RECIPE <<<"$RECIPE"
gpu=$($PY -c 'import torch; print(torch.cuda.is_available())' 2>/dev/null)
if [ "$gpu" != True ] && [ -z "${QUICK:-}" ]; then
    echo "no GPU: QUICK=1, 640 images, to check the script (its figures measure nothing)"
    QUICK=1
fi
LIM=() EP=3 EP05=2 SEEDS="1 2 3 4 5" WRN=("16 4 128" "16 4 512" "28 10 128" "28 10 512") WRNLIM=2048 STOP=12800
SKIP=${SKIP:-}  # runs to leave out: " name name ". On a CPU compiling takes minutes a run: QUICK compiles once,
# has no BUDGET unless given one, and leaves
[ -n "${QUICK:-}" ] && { LIM=(--limit 640) EP=1 EP05=1 SEEDS="1 2" WRN=("16 4 128") WRNLIM=128 STOP=1280  # out
    SKIP="$SKIP r1024c p03c p05c rc1 rc2 ddp_profile " BUDGET=${BUDGET:-100000}; }  # ddp_profile, which has no short form
rm -rf "$RUNS" "$R" "$L" "$OUT/table.md"  # this script's own files: a run refuses a folder another run wrote
mkdir -p "$RUNS"
note() { echo "$*" | tee -a "$R"; }
T0=$(date +%s)
BUDGET=${BUDGET:-480}
late() {  # is it past BUDGET (or is `name` one QUICK skips)? Then say so
    [[ $SKIP == *" $1 "* ]] && note "$1 skipped: QUICK" && return
    [ -e "$RUNS/$1.log" ] && note "$1 skipped: measured above" && return  # speedup's runs, then perf's
    [ $(($(date +%s) - T0)) -ge "$BUDGET" ] && note "$1 skipped: past BUDGET=$BUDGET s"
}
device=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
note "== start $(date -u +%T) | ${device:-no GPU} | $($PY -c 'import torch,sys;print("torch",torch.__version__,"py",sys.version.split()[0],"cuda",torch.cuda.is_available())' 2>&1 | tail -1) | cpus $(nproc) | $(git describe --always --dirty 2>/dev/null)"
$PY tools/prepare_data.py data mnist >/dev/null 2>&1 || note "prepare_data failed"
run() {  # name timeout cmd... : one run into $RUNS/<name>, its summary line
    local name=$1 t=$2; shift 2; local o=$RUNS/$name s e rc
    late "$name" && return
    s=$EPOCHREALTIME; timeout "$t" "$@" --output-dir "$o" >"$RUNS/$name.log" 2>&1; rc=$?; e=$EPOCHREALTIME
    { echo "######## $name rc=$rc: $*"; tail -25 "$RUNS/$name.log"; } >>"$L"
    note "$name rc=$rc wall=$(awk "BEGIN{printf \"%.1f\", $e - $s}") $($PY "$HERE/summ.py" "$o/metrics.csv")"
}
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
if has speedup; then  # the --compile rows alone: 01, 03 and 05 at batch 64, eager then compiled, side by side
    run p01 120 "$PY" 01_single_gpu/train.py --epochs $EP "${LIM[@]}"
    run p01c 150 "$PY" 01_single_gpu/train.py --epochs $EP --compile "${LIM[@]}"
    run p03 120 "${TR[@]}" 03_ddp_single_node/train.py --epochs $EP "${LIM[@]}"
    run p03c 150 "${TR[@]}" 03_ddp_single_node/train.py --epochs $EP --compile "${LIM[@]}"
    run p05 120 "${TR[@]}" 05_fsdp/train.py --epochs $EP05 "${LIM[@]}"
    run p05c 150 "${TR[@]}" 05_fsdp/train.py --epochs $EP05 --compile "${LIM[@]}"
    note "compile: $(for n in p01c p03c; do grep -m1 '^compile: ' "$RUNS/$n.log" 2>/dev/null |  # compiling.py's line
        sed "s/^compile:/$n/"; done | tr '\n' ';')"
    note "-- speedup done at $(($(date +%s) - T0)) s"
fi
if has perf; then  # batch 64 defaults, eager; the classic reference; --compile; the recipe over 5 seeds
    run p01 120 "$PY" 01_single_gpu/train.py --epochs $EP "${LIM[@]}"
    run p03 120 "${TR[@]}" 03_ddp_single_node/train.py --epochs $EP "${LIM[@]}"
    run p05 120 "${TR[@]}" 05_fsdp/train.py --epochs $EP05 "${LIM[@]}"
    run classic 120 "$PY" 01_single_gpu/train.py --epochs 2 --loader classic --num-workers 1 "${LIM[@]}"
    run p01c 150 "$PY" 01_single_gpu/train.py --epochs $EP --compile "${LIM[@]}"
    for seed in $SEEDS; do  # each stops once its test accuracy reaches 99 %
        run "r1024$([ "$seed" = 1 ] || echo "s$seed")" 120 "$PY" 01_single_gpu/train.py "${RECIPE[@]}" --seed "$seed" \
            --epochs $((EP * 4)) --target 99 "${LIM[@]}"
    done
    run r1024c 150 "$PY" 01_single_gpu/train.py "${RECIPE[@]}" --epochs $((EP * 4)) --compile "${LIM[@]}"
    note "-- perf done at $(($(date +%s) - T0)) s"
fi
if has compile; then
    run p03c 150 "${TR[@]}" 03_ddp_single_node/train.py --epochs $EP --compile "${LIM[@]}"
    run p05c 150 "${TR[@]}" 05_fsdp/train.py --epochs $EP05 --compile "${LIM[@]}"
    run p01b 120 "$PY" 01_single_gpu/train.py --epochs $EP "${LIM[@]}"  # a second round of 01 and 03: the noise
    run p03b 120 "${TR[@]}" 03_ddp_single_node/train.py --epochs $EP "${LIM[@]}"
    note "-- compile done at $(($(date +%s) - T0)) s"
fi
if has plan; then  # the planner against measured peak memory (max_memory_allocated, rank 0), WideResNet on synthetic
    for c in "${WRN[@]}"; do
        read -r d w b <<<"$c"
        wrn=(--dataset synthetic --model wideresnet --depth "$d" --width "$w" --batch-size "$b" --test-batch-size "$b")
        late "plan wrn-$d-$w b$b" && continue
        note "plan wrn-$d-$w b$b: $($PY tools/plan.py "${wrn[@]}" --gpu-memory 140 --max-gpus 1 2>&1 | grep -E '^\| 1 \| (DDP|FSDP)' | tr -s ' ' | tr '\n' ' ')"
        run "m_ddp_${d}_${w}_$b" 150 "${TR[@]}" 03_ddp_single_node/train.py "${wrn[@]}" --epochs 1 --limit "$WRNLIM"
        [ "$d" = 28 ] || [ -n "${QUICK:-}" ] && run "m_fsdp_${d}_${w}_$b" 150 "${TR[@]}" 05_fsdp/train.py "${wrn[@]}" --epochs 1 --limit "$WRNLIM"
    done
    note "-- plan done at $(($(date +%s) - T0)) s"
fi
term_resume() {  # name stage : SIGTERM to every process of a torchrun step mid-epoch 2, then --resume; epochs 2
    local name=$1 stage=$2 o=$RUNS/$1 log=$RUNS/$1.log pid rc rc2 t saved
    late "$name" && return
    setsid "${TR[@]}" "$stage/train.py" --epochs 2 --log-interval 10 --limit "$STOP" --output-dir "$o" >"$log" 2>&1 &
    pid=$!
    for _ in $(seq 1 900); do grep -qE 'epoch 2 batch [1-9][0-9]+/' "$log" 2>/dev/null && break; sleep 0.1; done
    kill -TERM -- -"$pid" 2>/dev/null; SECONDS=0; wait "$pid"; rc=$? t=$SECONDS
    saved=$(grep -m1 -iE 'saved at|saving|stopp' "$log" | cut -c1-160)
    timeout 120 "${TR[@]}" "$stage/train.py" --epochs 2 --log-interval 10 --limit "$STOP" --output-dir "$o" --resume >>"$log" 2>&1
    rc2=$?
    { echo "######## $name (SIGTERM rc=$rc after ${t}s, resume rc=$rc2)"; tail -30 "$log"; } >>"$L"
    note "$name: SIGTERM to the step's group -> rc=$rc in ${t}s [$saved]; resume rc=$rc2 $($PY "$HERE/summ.py" "$o/metrics.csv")"
}
if has resume; then  # NCCL paths: 03 and 05 under torchrun, SIGTERM + resume; 04 with srun's variables
    term_resume t03 03_ddp_single_node
    term_resume t05 05_fsdp
    SLURM_PROCID=0 SLURM_LOCALID=0 SLURM_NTASKS=1 SLURM_NODEID=0 SLURM_NNODES=1 SLURM_JOB_ID=4242 SLURM_STEP_ID=0 \
        SLURM_JOB_NODELIST=$(hostname) SLURM_GPUS_ON_NODE=1 SLURM_CPUS_PER_TASK=8 SLURM_NTASKS_PER_NODE=1 \
        run s04 120 "$PY" 04_ddp_multi_node/train.py --epochs 1 "${LIM[@]}"
    note "-- resume done at $(($(date +%s) - T0)) s"
fi
if has doctor && ! late doctor; then
    timeout 120 "${TR[@]}" tools/doctor.py --output-dir "$RUNS/doctor" >"$RUNS/doctor.log" 2>&1; rc=$?
    { echo "######## doctor rc=$rc"; cat "$RUNS/doctor.log"; } >>"$L"
    note "doctor rc=$rc: $(grep -c '^PASS' "$RUNS/doctor.log") PASS, $(grep -c '^WARN' "$RUNS/doctor.log") WARN, $(grep -c '^FAIL' "$RUNS/doctor.log") FAIL; $(grep -E '^(WARN|FAIL)|busbw' "$RUNS/doctor.log" | cut -c1-140 | tr -s ' ' | tr '\n' ';')"
fi
if has profile && ! late ddp_profile; then  # the whole table goes to table.md, the two rows that matter here
    timeout 120 "$PY" bench/ddp_profile.py >"$OUT/ddp_profile.txt" 2>&1; rc=$?
    note "ddp_profile rc=$rc: $(grep -E '^\| (no DDP|DDP as|torch.compile)' "$OUT/ddp_profile.txt" | tr -s ' ' | tr '\n' ' ')"
fi
if has recipe && ! late recipes; then  # steps to 99 % of candidate recipes over the seeds, then the best compiled
    timeout 240 "$PY" "$HERE/recipes.py" "$(wc -w <<<"$SEEDS")" $((EP * 4)) >"$OUT/recipes.txt" 2>&1; rc=$?
    best=$(sed -n 's/^best: --/--/p' "$OUT/recipes.txt")
    note "recipes rc=$rc: best ${best:-none}"
    read -ra best <<<"--loader device ${best:-${RECIPE[*]}}"
    [[ " ${best[*]} " == *" --epochs "* ]] || best+=(--epochs $((EP * 4)))
    for seed in $SEEDS; do
        run "rc$seed" 150 "$PY" 01_single_gpu/train.py "${best[@]}" --seed "$seed" --compile --target 99 \
            "${LIM[@]}"
    done
    note "-- recipe done at $(($(date +%s) - T0)) s"
fi
if has steps && ! late step_probe; then  # ms per step: eager, compile modes, the whole step as a CUDA graph
    timeout 240 "$PY" "$HERE/step_probe.py" >"$OUT/steps.txt" 2>&1; rc=$?
    note "steps rc=$rc: $(grep -E '^speed-up' "$OUT/steps.txt")"
fi
if has probe && ! late probe; then
    timeout 120 "$PY" "$HERE/fsdp_probe.py" >"$OUT/probe.txt" 2>&1; rc=$?
    note "probe rc=$rc: $(grep 'ms/step' "$OUT/probe.txt" | cut -d'(' -f1 | tr -s ' ' | tr '\n' ';')"
fi
note "== end after $(($(date +%s) - T0)) s"
$PY "$HERE/table.py" "$R" | tee "$OUT/table.md"
