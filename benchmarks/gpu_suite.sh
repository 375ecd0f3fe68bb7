#!/usr/bin/env bash
# The GPU measurements of docs/gpu.md in one command, on a machine with one NVIDIA GPU, onnxruntime-gpu and
# onnxruntime-genai-cuda installed, `meshplan` on PATH and two builder folders made for CUDA (fp16, int4):
#   MPIRUN="mpiexec --oversubscribe" [BUDGET=seconds] [ARCHIVE=file.tgz] [STEPS="doctor train serve ..."] \
#     bash benchmarks/gpu_suite.sh FP16_DIR INT4_DIR OUT_DIR [DEVICE=h200]
# Steps run in order of what they decide, each under its own limit cut to what is left of BUDGET (a step
# with less than 20 s left is skipped and says so); after each step OUT_DIR, less its plans, is archived to ARCHIVE,
# so that a lease cut short still brings back what ran; STEPS names the steps to run (default: all). Writes
# OUT_DIR/*.log and prints the tables: `meshplan doctor`; benchmarks/train.py --provider cuda (a 219 M GPT's
# training step against torch eager on the GPU, TF32 off in both; losses step for step, GPU memory, MFU; its 1x2 row
# again under CUDA MPS: train_mps); a pipelined training plan on CUDA against the CPU (train_pipeline), and a one-stage
# plan of 4 microbatches a step (train_microbatches);
# benchmarks/mixed_precision.py --provider cuda (float16 and bfloat16 GPTs with float32 master weights);
# benchmarks/serve.py --provider cuda on the fp16 folder (continuous batching against onnxruntime-genai one request at
# a time, logprobs' cost, a shared system prompt with and without prefix caching); benchmarks/generate.py --provider cuda (1x1 with and without CUDA graphs, 1x2 with both
# ranks on the one GPU, onnxruntime-genai; TTFT, ms/token, GPU memory per rank next to the plan's estimate);
# the fp16 1x2 plan with CUDA graphs in every segment (MESHPLAN_SEGMENT_GRAPHS=1); benchmarks/small_batch_split.py
# on the machine's cores (CPU provider, shared-host and own-device plans); a job's first requests with the GPU's
# clocks; benchmarks/decode_phases.py (where the fp16 1x1 decode step's time goes); both 1x2 runs under CUDA MPS
# where it starts; `meshplan verify --generate --provider cuda`; a non-LLM plan run on CUDA and verified;
# benchmarks/segment_pools.py with a 1x2 rank's 8 threads; the 70B shape's plan with its ILPs on 16, 4 and 1 cores
# (plan_workers).
set -u
FP16=$1; INT4=$2; O=$3; DEVICE=${4:-h200}; MPIRUN=${MPIRUN:-mpiexec}; BUDGET=${BUDGET:-3600}; ARCHIVE=${ARCHIVE:-}
HERE=$(cd "$(dirname "$0")/.." && pwd); mkdir -p "$O"; cd "$HERE"
left() { echo $((BUDGET - SECONDS)); }
save() { [ -n "$ARCHIVE" ] && tar czf "$ARCHIVE.part" -C "$(dirname "$O")" --exclude=work --exclude=gpt_1x2 --exclude=train_work --exclude=train_mps_work --exclude=mp_work --exclude=serve_work --exclude=train_pipeline/plan --exclude=train_microbatches/plan \
  --exclude=mps_pipe "$(basename "$O")" 2> /dev/null \
  && mv "$ARCHIVE.part" "$ARCHIVE"; return 0; }
want() { [ -z "${STEPS:-}" ] || [[ " $STEPS " == *" $1 "* ]]; }
# a step's losses on CUDA against the CPU (DIR/cuda.json, DIR/cpu.json: meshplan train --log)
same_losses() { python3 -c "
import json; a, b = (json.load(open('$2/' + n + '.json'))['losses'] for n in ('cuda', 'cpu'))
print('== $1: losses on CUDA against the CPU, largest relative difference',
      max(abs(x - y) / abs(y) for x, y in zip(a, b)), '; steps', len(a))"; }
step() { local name=$1 limit=$2; shift 2; local l; l=$(left)
  want "$name" || return 1
  [ "$l" -lt 20 ] && { echo "== $name: skipped, $l s of the budget left"; return 1; }
  [ "$limit" -gt "$l" ] && limit=$l
  echo "== $name"; local t=$SECONDS
  timeout "$limit" "$@" > "$O/$name.log" 2>&1; local rc=$?
  tail -n "${TAIL:-25}" "$O/$name.log"; echo "== $name: exit $rc, $((SECONDS - t)) s"; save; return $rc; }
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
TAIL=12 step doctor 60 meshplan doctor
# training on the GPU: meshplan 1x1 and 1x2 (both ranks on the one GPU) against torch eager on CUDA
TRAIN_GPT="--layers 12 --hidden 1024 --heads 16 --vocab 32768 --seq 512 --batch 8 --warmup 2 --steps ${TRAIN_STEPS:-6}"
TAIL=30 step train 300 python3 benchmarks/train.py --provider cuda --device "$DEVICE" --torch-python python3 \
  --mpiexec "$MPIRUN" --solver highs --no-profile $TRAIN_GPT --only eager --only 1x1 --only 1x2-data \
  --workdir "$O/train_work" --json "$O/train.json"
# a pipelined training plan (the sample GPT, 2 stages of 4 microbatches, both ranks on the one GPU) trained on CUDA
# and on the CPU: its losses step for step
if want train_pipeline && [ "$(left)" -gt 60 ]; then
  TP="$O/train_pipeline"; mkdir -p "$TP"
  meshplan plan sample_models/training/gpt_adamw.onnx --train --loss cross_entropy:logits:target --optimizer adamw \
    --mesh 1x2 --stages 2 --microbatches 4 --device cpu --dim batch=8 --solver highs -o "$TP/plan" > "$TP/plan.log" 2>&1 \
    || tail -n 3 "$TP/plan.log"
  TRAIN_PIPE="-n 2 meshplan train $TP/plan --data sample_models/training/gpt_adamw.data.npz --steps 10 --lr 3e-3 -q"
  TAIL=6 step train_pipeline 120 $MPIRUN $TRAIN_PIPE --provider cuda --log "$TP/cuda.json" \
    && TAIL=4 step train_pipeline_cpu 120 $MPIRUN $TRAIN_PIPE --provider cpu --log "$TP/cpu.json" \
    && same_losses train_pipeline "$TP"
fi
# a one-stage plan of 4 microbatches a step (the sample GPT, 1x1) trained on CUDA and on the CPU: the calls before a
# step's last pruned to what accumulates and the last writing the state, all kept on the GPU; its losses step for step
if want train_microbatches && [ "$(left)" -gt 60 ]; then
  TM="$O/train_microbatches"; mkdir -p "$TM"
  meshplan plan sample_models/training/gpt_adamw.onnx --train --loss cross_entropy:logits:target --optimizer adamw \
    --mesh 1x1 --microbatches 4 --device cpu --dim batch=8 --solver highs -o "$TM/plan" > "$TM/plan.log" 2>&1 \
    || tail -n 3 "$TM/plan.log"
  TRAIN_MB="-n 1 meshplan train $TM/plan --data sample_models/training/gpt_adamw.data.npz --steps 10 --lr 3e-3"
  TAIL=6 step train_microbatches 120 $MPIRUN $TRAIN_MB --provider cuda --log "$TM/cuda.json" \
    && TAIL=4 step train_microbatches_cpu 120 $MPIRUN $TRAIN_MB --provider cpu --log "$TM/cpu.json" \
    && same_losses train_microbatches "$TM"
fi
# mixed precision on the GPU: a GPT in float16 (own dtype, and with float32 master weights and a loss scale) and in
# bfloat16 with float32 masters, against the same GPT in float32: losses step for step, step time, memory
TAIL=8 step mixed_precision 300 python3 benchmarks/mixed_precision.py --provider cuda --device "$DEVICE" \
  --mpiexec "$MPIRUN" --layers 12 --hidden 1024 --heads 16 --vocab 32768 --seq 512 --batch 8 --steps 20 \
  --workdir "$O/mp_work" --json "$O/mixed_precision.json"
# serving on the GPU (the fp16 folder): continuous batching against one request at a time, logprobs' cost; then a
# shared system prompt with and without prefix caching
TAIL=14 step serve 150 python3 benchmarks/serve.py --folder "$FP16" --provider cuda --device "$DEVICE" \
  --mpiexec "$MPIRUN" --meshplan meshplan --solver highs --max-length 512 --batch 8 --clients 8 --requests 32 \
  --prompt-lengths 16:64 --new-tokens 32:96 --logprobs 5 --workdir "$O/serve_work" --json "$O/serve.json"
TAIL=8 step serve_prefix 120 python3 benchmarks/serve.py --folder "$FP16" --provider cuda --device "$DEVICE" \
  --mpiexec "$MPIRUN" --meshplan meshplan --solver highs --max-length 1024 --batch 8 --system-prompt 512 --only continuous \
  --only continuous-no-prefix --clients 4 --requests 32 --prompt-lengths 8:16 --new-tokens 8:16 \
  --workdir "$O/serve_work" --json "$O/serve_prefix.json"
python3 -c "import json; print(json.dumps([[(7 * i + 5) % 250 + 2 for i in range(32)]]))" > "$O/ids.json"
TAIL=48 step generate 360 python3 benchmarks/generate.py --provider cuda --device "$DEVICE" \
  --folders "fp16=$FP16" "int4=$INT4" --mpiexec "$MPIRUN" --max-length 512 --prompt-length 32 --new-tokens 128 \
  --repeat "${REPEAT:-3}" --solver highs --workdir "$O/work" --json "$O/generate.json"
# generate.py's plans of the fp16 folder (made here if it did not run)
P11="$O/work/$(basename "$FP16")_model_1x1_512"; P12="$O/work/$(basename "$FP16")_model_1x2_512"
fp16_plans=""; for s in segment_graphs_1x2 first_requests decode_phases mps_1x2 mps_segment_graphs_1x2 verify_generate \
  transfer_device; do want $s && fp16_plans=1; done
for m in ${fp16_plans:+1x1 1x2}; do P="$O/work/$(basename "$FP16")_model_${m}_512"; [ -f "$P/plan.json" ] || meshplan plan \
  "$FP16/model.onnx" --mesh $m --device "$DEVICE" --generate --max-length 512 --solver highs -o "$P" \
  > "$O/plan_fp16_$m.log" 2>&1 || tail -n 3 "$O/plan_fp16_$m.log"; done
openmpi=""; ${MPIRUN%% *} --version 2>&1 | grep -q "Open MPI\|OpenRTE" && openmpi=1
# graphs in every segment of the 1x2 programs, the integers they read made in each (MESHPLAN_SEGMENT_GRAPHS)
# (with onnxruntime's info log: the copies between the host and the GPU it adds to a segment, and where)
SEGMENT_GRAPHS="env MESHPLAN_SEGMENT_GRAPHS=1 MESHPLAN_ORT_LOG_LEVEL=1 $MPIRUN ${openmpi:+-x MESHPLAN_SEGMENT_GRAPHS -x MESHPLAN_ORT_LOG_LEVEL}"
GENERATE_1X2="-n 2 meshplan generate $P12 --prompt-ids $O/ids.json --max-new-tokens 128 --eos -1 --provider cuda"
TAIL=8 step segment_graphs_1x2 90 $SEGMENT_GRAPHS $GENERATE_1X2 --output "$O/segment_graphs_1x2.json"
grep -i "memcpy" "$O/segment_graphs_1x2.log" 2> /dev/null | sed "s/^[^]]*\] //" | sort | uniq -c | sort -rn | head -n 20
grep -i "graph" "$O/segment_graphs_1x2.log" 2> /dev/null | grep -iv "memcpy" | sed "s/^[^]]*\] //" | sort | uniq -c | sort -rn | head -n 12
# the machine's cores (CPU provider), while nothing else runs
TAIL=40 step small_batch_split 200 python3 benchmarks/small_batch_split.py --cores --repeat 20 --rounds "${ROUNDS:-3}" \
  --solver highs --host both --mpiexec "$MPIRUN"
# a job's first requests with the GPU's clocks read beside them (every 200 ms: a read stalls the
# driver's calls for a moment): whether the prefill's slow first seconds are the clocks rising
want first_requests && { nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw --format=csv,noheader \
  -lms 200 > "$O/first_requests_clocks.csv" 2>&1 & CLOCKS=$!; }
TAIL=20 step first_requests 90 python3 benchmarks/decode_phases.py "$P11" --provider cuda --rounds 1 --first-requests 5
[ -n "${CLOCKS:-}" ] && { kill $CLOCKS 2> /dev/null; wait $CLOCKS 2> /dev/null; }
[ -f "$O/first_requests_clocks.csv" ] && awk -F', ' '{gsub(/ MHz/, "", $2); print $2}' "$O/first_requests_clocks.csv" | sort -n | awk \
  '{v[NR] = $1} END {if (NR) print "== SM clock during first_requests (MHz): min " v[1] ", median " v[int((NR + 1) / 2)] ", max " v[NR] " (" NR " reads)"}'
TAIL=34 step decode_phases 150 python3 benchmarks/decode_phases.py "$P11" --provider cuda --floor --choice both
# 1x2 on the one GPU under CUDA MPS (the two ranks' kernels share the GPU instead of taking turns in
# time slices), where MPS starts
if { want mps_1x2 || want mps_segment_graphs_1x2 || want train_mps; } && command -v nvidia-cuda-mps-control > /dev/null \
    && [ "$(left)" -gt 60 ]; then
  export CUDA_MPS_PIPE_DIRECTORY="$O/mps_pipe" CUDA_MPS_LOG_DIRECTORY="$O/mps_log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  forward=""   # Open MPI passes a rank only the variables -x names; MPICH's hydra passes all
  [ -n "$openmpi" ] && forward="-x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY"
  if nvidia-cuda-mps-control -d; then
    # the 1x2 data-parallel training step with both ranks' kernels sharing the GPU
    TAIL=12 step train_mps 240 python3 benchmarks/train.py --provider cuda --device "$DEVICE" \
      --mpiexec "$MPIRUN $forward" --solver highs --no-profile $TRAIN_GPT --only 1x2-data \
      --workdir "$O/train_mps_work" --json "$O/train_mps.json"
    [ -f "$P12/plan.json" ] && TAIL=8 step mps_1x2 90 $MPIRUN $forward -n 2 meshplan generate "$P12" --prompt-ids "$O/ids.json" --max-new-tokens 128 \
      --eos -1 --provider cuda --output "$O/mps_1x2.json"
    [ -f "$P12/plan.json" ] && TAIL=8 step mps_segment_graphs_1x2 90 $SEGMENT_GRAPHS $forward $GENERATE_1X2 --output "$O/mps_segment_graphs_1x2.json"
    echo quit | nvidia-cuda-mps-control
  else echo "== mps_1x2: MPS did not start"; fi
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
fi
TAIL=12 step verify_generate 150 meshplan verify "$P11" --generate --prompt-ids "$O/ids.json" \
  --max-new-tokens 32 --provider cuda
TAIL=6 step transfer_device 120 meshplan generate "$P11" --prompt-ids "$O/ids.json" --max-new-tokens 64 \
  --eos -1 --provider cuda --transfer device --output "$O/transfer_device.json"
if want run_gpt && [ "$(left)" -gt 60 ]; then
  meshplan plan sample_models/gpt.onnx --mesh 1x2 --device "$DEVICE" --dim batch=8 --dim seq=32 --microbatches 2 \
    --solver highs -o "$O/gpt_1x2" > "$O/plan_gpt.log" 2>&1 || tail -n 3 "$O/plan_gpt.log"
  python3 -c "
import numpy as np; r = np.random.default_rng(0)
np.savez('$O/gpt_in.npz', input_ids=r.integers(0, 100, (8, 32)).astype(np.int64))" 2>/dev/null
  TAIL=6 step run_gpt 90 $MPIRUN -n 2 meshplan run "$O/gpt_1x2" --inputs "$O/gpt_in.npz" --provider cuda --repeat 20 \
    --output "$O/gpt_out.npz" \
  && TAIL=6 step verify_gpt 90 meshplan verify "$O/gpt_1x2" --inputs "$O/gpt_in.npz" --outputs "$O/gpt_out.npz"
fi
TAIL=6 step segment_pools 120 python3 benchmarks/segment_pools.py --threads 8 --blocks 10
# the 70B shape planned on 128x8 with its layer ILPs solved by 16, 4 and 1 processes (the machine's cores)
TAIL=6 step plan_workers 400 python3 benchmarks/plan_time.py --rows llama70b --meshes 128x8 --workers 16 4 1 \
  --solver highs
echo "== the suite took $SECONDS s"
save
