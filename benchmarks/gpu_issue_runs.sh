#!/usr/bin/env bash
# Device call (kind nvidia-h200, carry [".peer", ".whl"]): the GPU figures of the memory, prefix-cache and MTP issues,
# phase by phase, each under its own time limit, into $OUT. Meant to follow benchmarks/gpu_vs_llama.sh with KEEP_GGUF=1
# on the same warm machine (the Q4_K_M file stays in /dev/shm), or to run alone (the file is written when missing).
#   PHASES   comma list, in order [edge,replay,mtp,tests]; also locality, ppprof, dprof
#   edge     issue 17: benchmarks/edge_memory.py on the Qwen3.6-shaped Q4_K_M GGUF at CAPS [4,8,12,24], PROMPT [32768]
#            tokens, BACKEND [offload], EDGE_CAP_S [300] a cap (a 32k prompt at 4 GiB needs ~140 s of prefill), EDGE_S [560]
#            -> $OUT/edge_memory.{json,md,log}
#   edgefp8  issue 17: the same on the Qwen3.6-shaped HF FP8 checkpoint (benchmarks/make_qwen36_fp8.py) at FP8_CAPS [4,8]
#            with FP8_KV [fp8] / FP8_HEAD [q8_0] (--kv-cache-dtype / --lm-head-quant)
#   replay   issue 19: benchmarks/agent_replay.py against `moestream serve` of that file at REPLAY_GB [12] GiB
#            (REPLAY_ARGS [--max-seq-len-override 40960]: the KV of one whole conversation): an ~8k-token system
#            prompt + tools (SYSTEM_WORDS [4100], ~2 tokens a word), ~600 new tokens a turn (TOOL_WORDS [300] of tool
#            output + the answer) for REPLAY_TURNS [41] turns (~32k at the end); the cache-free baseline measures
#            SAMPLE [0,20,40] of them -> $OUT/agent_replay.*
#   mtp      issue 22: benchmarks/mtp_decode.py (random bf16 Qwen3.6 shape with a one-layer MTP block made predictable)
#            at MTP_CAPS [12,24,8], MTP_BACKENDS [offload], MTP_ACCEPT [1.0,0.8], routing forced by token position
#            from MTP_TRACE [synthetic:qwen36] (empty: the random router's) -> $OUT/mtp.{json,log}
#   locality issue 18: benchmarks/decode_sweep.py (random bf16 Qwen3.6 shape) at LOC_CAPS [12,24], LOC_BACKENDS [offload],
#            batch 1 / 4 / 6, routing forced from LOC_TRACE [synthetic:qwen36] (empty: the random router's, uniform)
#            -> $OUT/locality.{json,log}: batch-4 aggregate / batch 1 under locality; LOC_GGUF=1: on the GGUF file instead
#   ppprof   issue 13: benchmarks/step_profile.py --prefill PROF_TOKENS [512] on that file, PROF_BACKEND [fused]
#            (PROF_GB: a cap) -> $OUT/prefill_profile.{json,log}: kernels by GPU time, host ops by CPU time
#   dprof    issue 13: benchmarks/step_profile.py (one recorded batch-1 decode step replayed, kernel by kernel) on that
#            file for each BACKEND@GIB[@FLAGS] of DPROF [fused@0] (0: no cap; FLAGS q: dense layers kept compressed, s:
#            no overlapped decode, t: STEPS whole steps profiled, for cpu / hybrid) -> $OUT/decode_profile_BACKEND_GIB[_FLAGS].{json,log}; STEADY=N: then N-token
#            decodes at batch 1 / 4 and host ops
#   qlinear  issue 13: benchmarks/qlinear_gpu.py (the compressed dense GEMVs' launch constants vs cuBLAS bf16, the
#            Q4_K_M file's dense shapes) -> $OUT/qlinear.{json,log}
#   tests    benchmarks/gpu_tests.sh  -> $OUT/gpu_tests.log
set -uo pipefail
MTP_TRACE=${MTP_TRACE-synthetic:qwen36}
LOC_TRACE=${LOC_TRACE-synthetic:qwen36}
source benchmarks/device_env.sh
T0=$(date +%s)
Q=${QUANT:-q4_k_m}; F=${GGUF_DIR:-/dev/shm}/qwen36-$Q.gguf
need_file() {
  [ -f "$F" ] || timeout 300 python3 benchmarks/make_qwen36_q4km.py "$F" --quant "$Q" \
    --vocab-from .peer/qwen3-tokenizer-gguf-fields.json 2>&1 | tail -1
}
for P in $(echo "${PHASES:-edge,replay,mtp,tests}" | tr , ' '); do
  echo "== $(date -u +%T) [+$(( $(date +%s) - T0 )) s] phase $P"
  case $P in
    edge)
      need_file
      timeout "${EDGE_S:-560}" python3 benchmarks/edge_memory.py "$F" --caps "${CAPS:-4,8,12,24}" --prompt "${PROMPT:-32768}" \
        --decode "${DECODE:-32}" --backend "${BACKEND:-offload}" --timeout "${EDGE_CAP_S:-300}" \
        --json "$OUT/edge_memory.json" --md "$OUT/edge_memory.md" 2>&1 | tee "$OUT/edge_memory.log" | grep -v "^\s*warm"
      ;;
    edgefp8)
      # issue 17's FP8 checkpoint at the edge: benchmarks/make_qwen36_fp8.py (HF FP8 block-scaled, ~35 GB, written to
      # FP8_DIR [/dev/shm]) then edge_memory.py on it at FP8_CAPS [4,8] -> $OUT/edge_fp8.{json,md,log}, with
      # FP8_KV [fp8] (--kv-cache-dtype) and FP8_HEAD [q8_0] (--lm-head-quant): at 4 GiB with a 32k context the plan
      # needs both (tests/test_moe_planner.py::test_qwen36_fp8_32k_context_at_4gib); FP8_KV=auto FP8_HEAD=none: the
      # checkpoint's own (refused at 4 GiB on the H100, 2026-12-06)
      D=${FP8_DIR:-/dev/shm}/qwen36-fp8
      [ -f "$D/config.json" ] || timeout 300 python3 benchmarks/make_qwen36_fp8.py "$D" 2>&1 | tail -1
      timeout "${EDGE_S:-560}" python3 benchmarks/edge_memory.py "$D" --caps "${FP8_CAPS:-4,8}" --prompt "${PROMPT:-32768}" \
        --decode "${DECODE:-32}" --backend "${BACKEND:-offload}" --timeout "${EDGE_CAP_S:-300}" \
        --kv-cache-dtype "${FP8_KV:-fp8}" --lm-head-quant "${FP8_HEAD:-q8_0}" \
        --json "$OUT/edge_fp8.json" --md "$OUT/edge_fp8.md" 2>&1 | tee "$OUT/edge_fp8.log" | grep -v "^\s*warm"
      ;;
    replay)
      need_file
      # the GPU image has no server packages: carried wheels (.whl/server/, e.g. `pip download --no-deps -d
      # .whl/server fastapi starlette uvicorn h11 click anyio sniffio prometheus_client pydantic annotated-types
      # typing-inspection typing_extensions` + pydantic_core for cp312 manylinux) on this phase's path only
      if ls .whl/server/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_srv .whl/server/*.whl 2>&1 | grep -v "already exists"
      fi
      PYTHONPATH=/tmp/site_srv:$PYTHONPATH timeout "${REPLAY_S:-330}" python3 benchmarks/agent_replay.py \
        --serve-args "--model-path $F --gpu-memory-gb ${REPLAY_GB:-12} ${REPLAY_ARGS:---max-seq-len-override 40960}" \
        --turns "${REPLAY_TURNS:-41}" --system-words "${SYSTEM_WORDS:-4100}" --tool-words "${TOOL_WORDS:-300}" \
        --max-tokens 16 --sample-turns "${SAMPLE:-0,20,40}" --log-prefix "$OUT/agent_replay_server" \
        --out "$OUT/agent_replay.json" 2>&1 | tee "$OUT/agent_replay.log"
      ;;
    mtp)
      timeout "${MTP_S:-300}" python3 benchmarks/mtp_decode.py --caps "${MTP_CAPS:-12,24,8}" \
        --backends "${MTP_BACKENDS:-offload}" --batch 1,4 --k "${MTP_K:-0,2}" --accept "${MTP_ACCEPT:-1.0,0.8}" \
        --new-tokens 48 ${MTP_TRACE:+--trace "$MTP_TRACE"} --out "$OUT/mtp.json" 2>&1 | tee "$OUT/mtp.log"
      ;;
    locality)
      [ -n "${LOC_GGUF:-}" ] && need_file
      timeout "${LOC_S:-420}" python3 benchmarks/decode_sweep.py ${LOC_GGUF:+--model "$F"} --caps "${LOC_CAPS:-12,24}" \
        --backends "${LOC_BACKENDS:-offload}" --batch 1,4,6 --no-fused --prefill 256 --new-tokens 48 \
        ${LOC_TRACE:+--trace "$LOC_TRACE"} --out "$OUT/locality.json" 2>&1 | tee "$OUT/locality.log"
      ;;
    ppprof)
      need_file
      timeout "${PROF_S:-240}" python3 benchmarks/step_profile.py --model "$F" --backend "${PROF_BACKEND:-fused}" \
        --prefill "${PROF_TOKENS:-512}" ${PROF_GB:+--gpu-memory-gb "$PROF_GB"} --out "$OUT/prefill_profile.json" \
        2>&1 | tee "$OUT/prefill_profile.log"
      ;;
    dprof)
      need_file
      # BACKEND@GIB[@FLAGS]: FLAGS q keeps the dense layers compressed (MOESTREAM_DENSE_QUANT=1) where `auto` would
      # not; s steps without overlap (--overlap-schedule off); t whole steps profiled instead of a replay (--steps STEPS
      # [32]: cpu and hybrid, whose graph waits on the CPU worker); ROWS [1]: the recorded steps replayed, e.g. 1,4
      for C in $(echo "${DPROF:-fused@0}" | tr , ' '); do
        B=${C%%@*}; R=${C#*@}; G=${R%%@*}; FL=$( [ "$R" != "$G" ] && echo "${R#*@}" ); S=${B}_$G${FL:+_$FL}
        Dq=$( [[ "$FL" == *q* ]] && echo 1 || echo auto ); Ov=$( [[ "$FL" == *s* ]] && echo off || echo auto )
        St=$( [[ "$FL" == *t* ]] && echo "--steps ${STEPS:-32}" )
        MOESTREAM_DENSE_QUANT=$Dq timeout "${DPROF_S:-120}" python3 benchmarks/step_profile.py --model "$F" --backend "$B" \
          $( [ "$G" != 0 ] && echo --gpu-memory-gb "$G" ) --overlap $Ov --steady "${STEADY:-0}" $St --rows "${ROWS:-1}" --out "$OUT/decode_profile_$S.json" \
          2>&1 | tee "$OUT/decode_profile_$S.log" | tail -75
      done
      ;;
    qlinear)
      timeout "${QLIN_S:-150}" python3 benchmarks/qlinear_gpu.py --out "$OUT/qlinear.json" 2>&1 | tee "$OUT/qlinear.log"
      ;;
    tests)
      TESTS_S=${TESTS_S:-170} TESTS2_S=${TESTS2_S:-50} TESTS_LOG=$OUT/gpu_tests.log bash benchmarks/gpu_tests.sh
      ;;
    *) echo "unknown phase $P" ;;
  esac
done
echo "== done after $(( $(date +%s) - T0 )) s"
