#!/usr/bin/env bash
# The CUDA check, run ON the GPU machine from the repo root (python3 = the device's python):
#   OUT=/some/folder bash bench/gpu_check.sh
# Needs .gpu/ from bench/gpu_prep.sh (git-ignored: name it in the device tool's carry, e.g.
# run(command="bash bench/gpu_check.sh", carry=[".gpu"], timeout_s=580)). Every step runs in its
# own process with its own limit, in PLAN's order: the headline figures first (the 135M shape
# with graphs, then the 8B shape), transformers' baselines last. The limits add up to no more
# than the budget (GPU_CHECK_BUDGET_S, 560 s: a 580 s command with the summary), so no step is
# squeezed by an earlier one's overrun and one failure or hang never stops the rest. Prints one
# JSON line per step (its wall and limit seconds, its last JSON object or pytest tally) and,
# last, a summary JSON; writes $OUT/gpu_check.jsonl, $OUT/log.txt (all output),
# $OUT/summary.json. Figures come from random-weight models (bench/random_model.py): the real
# shapes' speed with EOS ignored; label them "random weights".
# GPU_CHECK_SMOKE=1 runs every step on this machine's CPU at toy sizes (the larger shapes are
# recorded as skipped, in their place): a rehearsal that each step's command works and that the
# order and the budget hold, before the GPU's few minutes are spent on it.
# GPU_CHECK_PLAN=1 prints the plan (JSON) and exits 0 if it fits the budget, 1 if not.
set -u
cd "$(dirname "$0")/.." || exit 1
T0=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-560}
COMMAND_S=580  # the device tool's longest command
FINISH_S=10    # the summary after the last step
SETUP_S=10     # unpacking .gpu's wheels before the first step
# step:limit seconds, in the order they run. Estimates for an H100 80 GB (the H200 is no
# slower); each includes its process's start (torch + CUDA: ~10 s). The JSON says each step's
# wall time, so the next run can tighten them.
PLAN=(
  env:20                     # versions, the GPU, nvidia-smi
  random_model:20            # the 135M shape's random weights (bench/random_model.py)
  throughput:70              # 135M, nf4, graphs: 1 / 32 / 64 / 128 users (the headline)
  random_llama-3.1-8b:40     # drawn on the GPU into memory (/dev/shm): no 15 GB disk trip
  throughput_llama-3.1-8b:90 # 8B shape, nf4, graphs, --max-model-len 8192: 1 / 32 users
  throughput_eager:30        # 135M, every step eager (--cuda-graph-rows 0): 1 / 32 users
  tests:50                   # tests/test_cuda.py and the Triton kernels' tests
  http:40                    # 32 users over the API server
  restore:25                 # 135M: KV restore from the host tier against a recompute
  restore_llama-3.1-8b:45    # 8B shape: 2,000 tokens
  mixed:25                   # a long prompt among short decodes: mixed_itl_ratio
  random_llama-3.2-1b:15
  throughput_llama-3.2-1b:30 # 1B shape: 1 / 32 users
  hf_generate:50             # transformers' generate (static cache, compiled) and batch
)
plan_json() {
  local IFS=,
  "${PYTHON:-python3}" - "$BUDGET" "$COMMAND_S" "$SETUP_S" "$FINISH_S" "${PLAN[*]}" <<'PY'
import json, sys
budget, command, setup, finish = map(int, sys.argv[1:5])
steps = [(n, int(s)) for n, s in (x.split(":") for x in sys.argv[5].split(","))]
total = sum(s for _, s in steps) + setup
fits = total <= budget and budget + finish <= command
print(json.dumps({"plan": [n for n, _ in steps], "limits_s": dict(steps), "sum_s": total,
                  "budget_s": budget, "command_s": command, "fits": fits}))
sys.exit(0 if fits else 1)
PY
}
if [ "${GPU_CHECK_PLAN:-0}" = 1 ]; then
  plan_json
  exit $?
fi
OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
if [ "${GPU_CHECK_SMOKE:-0}" = 1 ]; then
  DEV=cpu USERS=1,2 EAGER_USERS=1,2 HTTP_USERS=2 BATCH=2 NEW=8 LENGTHS=200 SEQS=2
  MIXED=(--short-users 2 --new-tokens 24 --long-tokens 300 --long-new-tokens 4 --alone-seconds 2)
else
  DEV=cuda USERS=1,32,64,128 EAGER_USERS=1,32 HTTP_USERS=32 BATCH=32 NEW=64 LENGTHS=500,2000
  SEQS=128 MIXED=()
fi
SITE=${GPU_CHECK_SITE:-/tmp/crowdchat-site}
DATA=/tmp/crowdchat-gpu-data
MODEL=${CROWDCHAT_CUDA_MODEL:-/tmp/crowdchat-random-smollm2}
# the larger shapes' weights in memory where /dev/shm has room (16 GB for the 8B in bf16)
BIG=/tmp
shm=$(df --output=avail -BG /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)
[ "${shm:-0}" -ge 40 ] && BIG=/dev/shm
JSONL=$OUT/gpu_check.jsonl
LOG=$OUT/log.txt
: >"$JSONL"
: >"$LOG"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error CROWDCHAT_CUDA_MODEL=$MODEL
if ! plan_json >>"$LOG"; then
  echo '{"step": "plan", "rc": 1, "ok": false, "why": "the limits exceed the budget"}' |
    tee -a "$JSONL"
  [ "${GPU_CHECK_SMOKE:-0}" = 1 ] && exit 1
fi
NEXT=0 # index in PLAN of the next step
ORDER_OK=1

left() { echo $((BUDGET - ($(date +%s) - T0))); }

# record NAME RC SECONDS FILE: one JSON line with the step's last JSON object, or its pytest
# tally, or the tail of its output.
record() {
  "$PY" - "$@" <<'PY' | tee -a "$JSONL"
import json, re, sys
name, rc, secs, limit, path = sys.argv[1:6]
try:
    lines = open(path, errors="replace").read().splitlines()
except OSError:
    lines = []
row = {"step": name, "rc": int(rc) if rc.lstrip("-").isdigit() else rc, "wall_s": int(secs),
       "limit_s": int(limit)}
row["ok"] = row["rc"] == 0
for line in reversed(lines):
    line = line.strip()
    if line.startswith("{") and line.endswith("}"):
        try:
            row["result"] = json.loads(line)
            break
        except ValueError:
            pass
tally = [l for l in lines if re.search(r"\d+ (passed|failed|error)", l)]
if tally:
    row["pytest"] = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped)", tally[-1])}
    row["failures"] = [l[:300] for l in lines if l.startswith(("FAILED", "ERROR"))][:12]
if "result" not in row and not tally:
    row["tail"] = [l[:300] for l in lines[-6:]]
if row["rc"] in (124, 137):
    row["timed_out"] = True
print(json.dumps(row))
PY
}

# planned NAME: LIMIT = the limit PLAN gives NAME, which must be the next step in PLAN (else
# the order is broken: said in the JSON, and a smoke run fails). Not in a subshell: NEXT counts.
planned() {
  local entry=${PLAN[$NEXT]:-}
  if [ "${entry%%:*}" != "$1" ]; then
    ORDER_OK=0
    echo "{\"step\": \"$1\", \"order\": \"not next in PLAN (expected ${entry%%:*})\"}" |
      tee -a "$JSONL"
    entry=$(printf '%s\n' "${PLAN[@]}" | grep "^$1:" | head -1)
  fi
  NEXT=$((NEXT + 1))
  LIMIT=${entry##*:}
}

# skip NAME WHY: a planned step that does not run here (in its place, so the order holds).
skip() {
  planned "$1"
  echo "{\"step\": \"$1\", \"rc\": \"skipped\", \"ok\": true, \"why\": \"$2\"}" | tee -a "$JSONL"
}

# step NAME CMD...: run CMD with PLAN's limit for NAME (less only where the budget has less).
step() {
  local name=$1 limit
  shift
  planned "$name"
  limit=$LIMIT
  local rem=$(($(left) - FINISH_S))
  if [ "$rem" -lt 10 ]; then
    echo "{\"step\": \"$name\", \"rc\": \"skipped\", \"ok\": false, \"why\": \"out of time\"}" |
      tee -a "$JSONL"
    return
  fi
  [ "$limit" -gt "$rem" ] && limit=$rem
  local f=/tmp/gpu-check-$name.txt s
  s=$(date +%s)
  echo "===== $name (limit ${limit}s): $*" >>"$LOG"
  timeout -k 5 "$limit" "$@" >"$f" 2>&1
  local rc=$?
  cat "$f" >>"$LOG"
  record "$name" "$rc" $(($(date +%s) - s)) "$limit" "$f"
}

finish() {
  "$PY" - "$JSONL" "$(($(date +%s) - T0))" "$MODEL" <<'PY' | tee "$OUT/summary.json"
import json, sys
rows = []
for line in open(sys.argv[1]):
    try:
        rows.append(json.loads(line))
    except ValueError:
        pass
s = {"gpu_check": "summary", "seconds": int(sys.argv[2]), "model": sys.argv[3],
     "weights": "random (bench/random_model.py): speed only, text is noise"}
s["steps"] = {r["step"]: r.get("rc") for r in rows if "step" in r and "rc" in r}
s["wall_s"] = {r["step"]: r["wall_s"] for r in rows if "wall_s" in r}
s["failed"] = [r["step"] for r in rows if "rc" in r and not r.get("ok")]
s["order"] = next((r["order"] for r in rows if "order" in r and "step" not in r), None)
for r in rows:
    res, name = r.get("result") or {}, r.get("step")
    if "cuda" in r:
        s["cuda"] = r["cuda"]
    if name == "env":
        s["cuda"] = res.get("cuda", False)
        s["env"] = res
    elif name == "tests":
        s["tests"] = r.get("pytest", {})
        s["test_failures"] = r.get("failures", [])
    elif res:
        s[name] = res


def ratio(a, b):
    return round(a / b, 2) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


tp, eager = s.get("throughput", {}), s.get("throughput_eager", {})
s["cuda_graphs_captured"] = tp.get("cuda_graphs_captured")  # 0 or None: the figures are eager
s["runs_ahead"] = tp.get("runs_ahead")  # False or None: every step waited for its tokens
http, hf = s.get("http", {}), s.get("hf_generate", {})
s["ratios"] = {  # the issue's targets, each from this run
    "graphs_over_eager_1_user": ratio(tp.get("users_1_tokens_per_s"), eager.get("users_1_tokens_per_s")),
    "http_over_in_process_32_users": ratio(http.get("users_32_tokens_per_s"), tp.get("users_32_tokens_per_s")),
    "over_static_cache_generate_32": ratio(tp.get("users_32_tokens_per_s"), hf.get("static_tokens_per_s")),
    "over_generate_batch_32": ratio(tp.get("users_32_tokens_per_s"), hf.get("continuous_tokens_per_s")),
}
print(json.dumps(s))
PY
}

# --- the device's missing packages: wheels unpacked, bitsandbytes already unpacked ---
rm -rf "$SITE" && mkdir -p "$SITE" "$DATA"
# guard wheels: regex and tokenizers only where the device's own are older than transformers
# (and the engine's detokenizer: tokenizers' DecodeStream) want
old() { # old DIST MIN: 1 when DIST is missing or older than MIN
  "$PY" -c 'import importlib.metadata as m, sys
from packaging.version import Version as V
try:
    print(int(V(m.version(sys.argv[1])) < V(sys.argv[2])))
except Exception:
    print(1)' "$1" "$2" 2>/dev/null || echo 1
}
old_regex=$(old regex 2025.10.22)
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' || old_regex=0  # cp312 wheel
old_tokenizers=$(old tokenizers 0.23.1)
if [ "$DEV" = cuda ]; then  # a smoke run uses this machine's own packages
  for w in .gpu/wheels/*.whl; do
    case $w in
      */regex-*) [ "$old_regex" = 1 ] || continue ;;
      */tokenizers-*) [ "$old_tokenizers" = 1 ] || continue ;;
    esac
    [ -f "$w" ] && "$PY" -m zipfile -e "$w" "$SITE" >>"$LOG" 2>&1
  done
  [ -d .gpu/site ] && cp -r .gpu/site/. "$SITE"/
fi
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}
echo "{\"setup_s\": $(($(date +%s) - T0)), \"guard_wheels\": {\"regex\": $old_regex, \"tokenizers\": $old_tokenizers}, \"big_models_in\": \"$BIG\"}" >>"$LOG"

step env "$PY" -c '
import json, subprocess, importlib.metadata as md, torch
row = {"python": __import__("sys").version.split()[0], "torch": torch.__version__,
       "cuda": torch.cuda.is_available()}
if row["cuda"]:
    row["gpu"] = torch.cuda.get_device_name(0)
    row["vram_mb"] = torch.cuda.mem_get_info()[1] >> 20
    try:
        row["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total,memory.used,driver_version",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=15).stdout.strip()
    except Exception as e:
        row["nvidia_smi"] = repr(e)[:200]
for name in ("transformers", "bitsandbytes", "sqlite-utils", "safetensors", "tokenizers",
             "huggingface-hub", "accelerate", "prometheus-client", "triton"):
    try:
        row[name] = md.version(name)
    except md.PackageNotFoundError:
        row[name] = None
import transformers, sqlite_utils, sessions, engine  # the imports the steps need
from engine.core.detokenizer import DecodeStream
row["decode_stream"] = DecodeStream is not None
try:
    import bitsandbytes as bnb
    row["bnb_native"] = type(bnb.cextension.lib).__name__
except Exception as e:
    row["bnb_error"] = repr(e)[:300]
print(json.dumps(row))'

if [ "$DEV" = cuda ] &&
  ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo '{"cuda": false, "note": "no CUDA: GPU steps skipped"}' | tee -a "$JSONL"
  echo "no CUDA: skipping the GPU steps" >&2
  finish
  exit 0
fi

# big STEP SHAPE: on CUDA the step; in a smoke run its place, recorded as skipped
big() {
  if [ "$DEV" = cuda ]; then step "$@"; else skip "$1" "smoke: no larger shapes on the CPU"; fi
}
B8=$BIG/crowdchat-random-llama-3.1-8b
B1=$BIG/crowdchat-random-llama-3.2-1b

step random_model "$PY" bench/random_model.py "$MODEL"
# the headline: 135M shape, nf4, graphs (cuda_graphs_captured in every row)
step throughput "$PY" bench/throughput.py --device $DEV --model "$MODEL" --data-dir "$DATA" \
  --users $USERS --new-tokens $NEW --max-num-seqs $SEQS --no-baselines
# larger Llama shapes (random weights over SmolLM2's tokenizer: bench/random_model.py), nf4,
# drawn on the GPU; contexts capped at 8,192 as a serving config would
big random_llama-3.1-8b "$PY" bench/random_model.py "$B8" --shape llama-3.1-8b --device cuda
big throughput_llama-3.1-8b "$PY" bench/throughput.py --device cuda --model "$B8" \
  --data-dir "$DATA" --max-model-len 8192 --users 1,32 --new-tokens $NEW --no-baselines
# the 135M shape with every step eager (no CUDA graphs: vLLM's --enforce-eager)
step throughput_eager "$PY" bench/throughput.py --device $DEV --model "$MODEL" \
  --data-dir "$DATA" --users $EAGER_USERS --new-tokens $NEW --cuda-graph-rows 0 --no-baselines
step tests "$PY" -m pytest -q -p no:cacheprovider -rfE -x tests/test_cuda.py \
  tests/test_triton_attention.py tests/test_triton_layer.py tests/test_sampler.py
# users over HTTP: the API server (no Gradio on the GPU box), streamed chats of 2 turns
step http "$PY" bench/load.py --users $HTTP_USERS --turns 2 --new-tokens $NEW \
  --server-args "--ui off --device $DEV --model $MODEL"
step restore "$PY" bench/restore.py --device $DEV --model "$MODEL" --data-dir "$DATA" \
  --lengths $LENGTHS --repeats 1
big restore_llama-3.1-8b "$PY" bench/restore.py --device cuda --model "$B8" \
  --data-dir "$DATA" --max-model-len 8192 --lengths 2000 --repeats 1
[ "$DEV" = cuda ] && MIXED=(--new-tokens 1000 --alone-seconds 5)
step mixed "$PY" bench/mixed.py --model "$MODEL" --device $DEV --data-dir "$DATA" \
  ${MIXED[@]+"${MIXED[@]}"}
big random_llama-3.2-1b "$PY" bench/random_model.py "$B1" --shape llama-3.2-1b --device cuda
big throughput_llama-3.2-1b "$PY" bench/throughput.py --device cuda --model "$B1" \
  --data-dir "$DATA" --max-model-len 8192 --users 1,32 --new-tokens $NEW --no-baselines
# transformers' own, last: generate with a static cache (compiled by transformers: the
# slowest start) and generate_batch
step hf_generate "$PY" bench/hf_generate.py --device $DEV --model "$MODEL" \
  --data-dir "$DATA" --batch $BATCH --new-tokens $NEW
[ "$NEXT" = "${#PLAN[@]}" ] || ORDER_OK=0
echo "{\"order\": $([ "$ORDER_OK" = 1 ] && echo '"as planned"' || echo '"broken"'), \"steps\": $NEXT}" |
  tee -a "$JSONL"
finish
[ "${GPU_CHECK_SMOKE:-0}" = 1 ] && [ "$ORDER_OK" != 1 ] && exit 1
exit 0
