#!/usr/bin/env bash
# The riskiest GPU paths on one GPU in one call, from the repo root: bash bench/gpu/gpu_check.sh (LIMIT=330 s overall, W=work
# folder, PY=python with torch). A PASS/FAIL/SKIP line per check, images/s per stage; logs in $W, tails to $OUT if set.
set -u
PY=${PY:-.venv/bin/python}; [ -x "$PY" ] || PY=python3
W=${W:-/tmp/gpucheck}; rm -rf "$W"; mkdir -p "$W"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
TR=("$PY" -m torch.distributed.run --standalone --nproc-per-node 1)
LIMIT=${LIMIT:-330}; T0=$SECONDS
run() {  # name seconds cmd... : under timeout, clamped to the time left; log in $W/name.log; 99 = skipped
    local n=$1 t=$2 left=$((LIMIT - SECONDS + T0)); shift 2
    [ "$left" -lt 20 ] && { say SKIP "$n" "out of time"; return 99; }
    timeout -k 5 $((t < left ? t : left)) "$@" >"$W/$n.log" 2>&1
}
say() { echo "$1 $2${3:+ | $3}" | tee -a "$W/summary"; }
why() { grep -m1 -E "^error:|Error|error:|Killed" "$W/$1.log" | cut -c1-160; }
stat() { $PY bench/gpu/summ.py "$W/$1/metrics.csv" 2>/dev/null; }  # epochs= s/epoch= img/s= first= compile= acc=
field() { sed -n "s|.* $2=\([^ ]*\).*|\1|p" <<<" $1"; }
ge() { awk -v a="$1" -v b="$2" 'BEGIN{exit !(a+0 >= b+0)}'; }
stage() {  # name rc min-accuracy must-say: PASS if rc 0, test accuracy >= min and the log says must-say
    [ "$2" = 99 ] && return; local s; s=$(stat "$1")
    if [ "$2" = 0 ] && ge "$(field "$s" acc)" "$3" && grep -q -- "$4" "$W/$1.log"; then
        say PASS "$1" "acc $(field "$s" acc) %, $(field "$s" img/s) img/s after epoch 1, first $(field "$s" first) s, compile $(field "$s" compile) s"
    else say FAIL "$1" "rc=$2 acc=$(field "$s" acc) $(why "$1")"; fi
}
echo "== $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1) | torch $($PY -c 'import torch;print(torch.__version__)')" | tee "$W/summary"
run data 60 "$PY" tools/prepare_data.py data mnist || say FAIL data "$(why data)"

# 1. common/options/compiling.py: compiled Net (dropout), each optimizer, a partial batch, then the rate x 1e-6 (recorded
#    anew): a graph holding the old rate moves the weights as before; one replay's dropout masks are not the next's
cat >"$W/graph.py" <<'EOF'
import argparse, time, torch, torch.nn.functional as F
from common import optim
from common.models import Net
from common.options import compiling, recipes
dev, bad = torch.device("cuda"), []
def ts(s, x, y):
    loss = s.loss_fn(s.model(x), y); loss.backward(); s.optimizer.step(); return loss.detach()
for kind in ("adadelta", "adam", "sgd", "rmsprop"):
    torch.manual_seed(0)
    a = argparse.Namespace(optimizer=kind, lr={"adadelta": 1.0, "adam": 1e-3}.get(kind, 0.01), batch_size=64,
                           lr_scaling="none", weight_decay=0.0, momentum=0.9, amp=False)
    model = Net().to(dev); model.compile()
    opt = recipes.optimizer(a, model.parameters()); sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=1e-6)
    graph = compiling.StepGraph(ts)
    step = optim.Step(model, dev, opt, F.nll_loss, None, graph)
    data = [(torch.randn(n, 1, 28, 28, device=dev), torch.randint(0, 10, (n,), device=dev)) for n in [64] * 6 + [32]]
    def epoch(batches):  # as the stages' train(): grads to None, then the step (replayed where it can be)
        return [opt.zero_grad(set_to_none=True) or step.run(step, x, y).clone() for x, y in batches]
    w0 = [p.detach().clone() for p in model.parameters()]; epoch(data)
    w1 = [p.detach().clone() for p in model.parameters()]; sched.step(); l2 = epoch(data + data[:1] * 2)
    moved = max((p.detach() - w).abs().max().item() for p, w in zip(model.parameters(), w1))
    trained = max((w - v).abs().max().item() for w, v in zip(w1, w0))
    drop = abs(l2[-1].item() - l2[-2].item()) > 1e-4  # same batch, same weights: only the dropout masks differ
    torch.cuda.synchronize(); t = time.perf_counter(); [step.run(step, *data[0]) for _ in range(200)]
    torch.cuda.synchronize(); ms = (time.perf_counter() - t) * 5
    ok = graph.graph is not None and trained > 0 and moved < 1e-3 * trained and drop
    print(f"{kind}: trained {trained:.1e} moved after {moved:.1e} dropout-differs {drop} replay {ms:.3f} ms/step {'ok' if ok else 'BAD'}")
    bad += [] if ok else [kind]
print("graph-check", "BAD " + ",".join(bad) if bad else "ok")
EOF
run graph 120 "$PY" "$W/graph.py"; rc=$?
if [ $rc = 0 ] && grep -q "^graph-check ok" "$W/graph.log"; then say PASS graph "$(grep -E ' ms/step' "$W/graph.log" | tr '\n' ';')"
elif [ $rc != 99 ]; then say FAIL graph "rc=$rc $(grep -E 'BAD' "$W/graph.log" | tr '\n' ';') $(why graph)"; fi
run tests 90 "$PY" -m pytest -q -p no:cacheprovider tests/test_graphs.py; rc=$?
[ $rc = 99 ] || say "$([ $rc = 0 ] && echo PASS || echo FAIL)" test_graphs "rc=$rc $(tail -1 "$W/tests.log")"

# 2. stage 01, 2 epochs (60000 % 64 = 32: each epoch's last batch eager), eager then --compile: the same accuracy
run e01 60 "$PY" 01_single_gpu/train.py --epochs 2 --save-model --output-dir "$W/e01"; stage e01 $? 98.0 "world size 1"
run c01 90 "$PY" 01_single_gpu/train.py --epochs 2 --compile --output-dir "$W/c01"; stage c01 $? 98.0 "the step one CUDA graph"
ea=$(field "$(stat e01)" acc) ca=$(field "$(stat c01)" acc) ei=$(field "$(stat e01)" img/s) ci=$(field "$(stat c01)" img/s)
if [ -n "$ea" ] && [ -n "$ca" ] && awk -v a="$ea" -v b="$ca" 'BEGIN{d=a-b; exit !(d < 0.4 && d > -0.4)}'; then
    say PASS "c01~e01" "acc $ca vs $ea; compiled/eager $(awk -v a="$ci" -v b="$ei" 'BEGIN{printf "%.2fx", a/(b+1e-9)}')"
else say FAIL "c01~e01" "acc compiled ${ca:-?} vs eager ${ea:-?}"; fi

# 3. --compile, pytorch/examples' loader: its pin-memory thread runs while each epoch's step is recorded ("global" mode)
run k01 60 "$PY" 01_single_gpu/train.py --epochs 3 --loader classic --num-workers 4 --compile --limit 12800 \
    --output-dir "$W/k01"; stage k01 $? 94.0 "the step one CUDA graph"

# 4. stage 05, torchrun world size 1: meta device, fully_shard, the task's weights() (01's model.pt) from rank 0,
#    units compiled: the first loss is a trained model's (fresh: 2.3); then without a process group, no weights
printf 'from common.tasks.images import add_arguments, check, datasets, model\n\ndef weights(args):\n    return %s\n' \
    "'$W/e01/model.pt'" >"$W/weighted.py"
if [ -f "$W/e01/model.pt" ]; then
    run w05 90 "${TR[@]}" 05_fsdp/train.py --task "$W/weighted.py" --epochs 1 --compile --limit 19200 \
        --log-interval 50 --output-dir "$W/w05"; rc=$?
    first=$(grep -m1 'epoch 1 batch 0/' "$W/w05.log" | awk '{print $NF}')
    if [ -n "$first" ] && ge 0.6 "$first"; then stage w05 $rc 97.5 "mesh: 1 ranks"
    elif [ $rc != 99 ]; then say FAIL w05 "rc=$rc first loss ${first:-none} (weights not loaded?) $(why w05)"; fi
else say SKIP w05 "no model.pt from e01"; fi
run m05 60 "$PY" 05_fsdp/train.py --epochs 1 --limit 6400 --output-dir "$W/m05"; stage m05 $? 85.0 "world size 1"

# 5. stage 03 under torchrun at world size 1 (DDP: fused kernels, no graph); 6. --amp --compile (no graph)
run c03 90 "${TR[@]}" 03_ddp_single_node/train.py --epochs 1 --compile --output-dir "$W/c03"; stage c03 $? 97.5 "no CUDA graph: DDP"
run a01 60 "$PY" 01_single_gpu/train.py --epochs 1 --amp --compile --output-dir "$W/a01"; stage a01 $? 97.5 "no CUDA graph: --amp"

# 7. NCCL's flight recorder under the job scripts' variables: entries recorded (2.9/2.10 record none by default)
printf '%s\n' 'import pickle, torch, torch.distributed as dist' 'dist.init_process_group("nccl", device_id=torch.device("cuda", 0))' \
    't = torch.ones(4, device="cuda")' '[dist.all_reduce(t) for _ in range(3)]' 'torch.cuda.synchronize()' \
    'print("fr_entries", len(pickle.loads(torch._C._distributed_c10d._dump_nccl_trace()).get("entries", [])))' \
    'dist.destroy_process_group()' >"$W/fr.py"
vars=$(cd 03_ddp_single_node && $PY -m common.guards.flightrecorder --output-dir "$W/fr" 2>"$W/frvars.err")
(eval "$vars" && run fr 40 "${TR[@]}" "$W/fr.py"); rc=$?; n=$(sed -n 's/^fr_entries \([0-9]*\).*/\1/p' "$W/fr.log" 2>/dev/null)
if [ $rc = 0 ] && [ -n "$vars" ] && ge "${n:-0}" 3; then say PASS flight_recorder "$n entries; $vars"
elif [ $rc != 99 ]; then say FAIL flight_recorder "rc=$rc entries=${n:-?} $vars"; fi

# 8. torchrun --numa-binding=node (the job scripts' flag, given numactl) and the doctor's sysfs NUMA reading
printf '%s\n' 'import os, sys, torch' 'sys.path.insert(0, "tools"); import doctor' 'p = torch.cuda.get_device_properties(0)' \
    'bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"; cpus = os.sched_getaffinity(0)' \
    'print("affinity", len(cpus), "CPUs; GPU", bus, "(node, CPUs off it):", doctor.beside_gpu(cpus, bus))' >"$W/aff.py"
if command -v numactl >/dev/null && $PY -m torch.distributed.run --help 2>/dev/null | grep -q -- --numa-binding; then
    run numa 40 "$PY" -m torch.distributed.run --numa-binding=node --standalone --nproc-per-node 1 "$W/aff.py"; rc=$?
    if [ $rc = 0 ]; then say PASS numa_binding "$(grep -m1 affinity "$W/numa.log")"
    elif [ $rc != 99 ]; then say FAIL numa_binding "rc=$rc $(why numa)"; fi
else run numa 30 "$PY" "$W/aff.py" && say SKIP numa_binding "no numactl or no --numa-binding; $(grep -m1 affinity "$W/numa.log")"; fi

echo "== done in $((SECONDS - T0)) s: $(grep -c '^PASS' "$W/summary") PASS, $(grep -c '^FAIL' "$W/summary") FAIL" | tee -a "$W/summary"
if [ -n "${OUT:-}" ] && [ -d "$OUT" ]; then
    cp "$W/summary" "$OUT/gpu_check.txt"
    for f in "$W"/*.log; do echo "######## $f"; tail -n 25 "$f"; done >"$OUT/gpu_check_logs.txt"
fi
