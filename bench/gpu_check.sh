#!/usr/bin/env bash
# The CUDA check, run ON the GPU machine from the repo root (python3 = the device's python):
#   OUT=/some/folder bash bench/gpu_check.sh
# Needs .gpu/ from bench/gpu_prep.sh (git-ignored: name it in the device tool's carry, e.g.
# run(command="bash bench/gpu_check.sh", carry=[".gpu"], timeout_s=560)). Every step runs in its own
# process with its own timeout and the whole run stays within GPU_CHECK_BUDGET_S (470 s), so one
# failure or hang never stops the rest. Prints one JSON line per step and, last, a summary JSON;
# writes $OUT/gpu_check.jsonl, $OUT/log.txt (all output), $OUT/summary.json, and the admin
# snapshot $OUT/admin.json + $OUT/admin.html (screenshot it here with
# `python bench/admin_snapshot.py --render admin.html admin.png`).
# Figures come from a random-weight SmolLM2-135M (bench/random_model.py): same shapes and
# speed as the real model with EOS ignored; label them "random weights".
# GPU_CHECK_SMOKE=1 runs every step on this machine's CPU at toy sizes (no larger shapes): a
# rehearsal that each step's command works, before the GPU's few minutes are spent on it.
set -u
cd "$(dirname "$0")/.." || exit 1
OUT=${OUT:-/tmp/gpu-check-out}
mkdir -p "$OUT"
BUDGET=${GPU_CHECK_BUDGET_S:-470}
T0=$(date +%s)
PY=${PYTHON:-python3}
if [ "${GPU_CHECK_SMOKE:-0}" = 1 ]; then
  DEV=cpu USERS=1,2 EAGER_USERS=1,2 HTTP_USERS=1,2 BATCH=2 NEW=8 SHAPES="" LENGTHS=200
  MIXED=(--short-users 2 --new-tokens 24 --long-tokens 300 --long-new-tokens 4 --alone-seconds 2)
else
  DEV=cuda USERS=1,8,32,64,128 EAGER_USERS=1,8,32,64,128 HTTP_USERS=1,32 BATCH=32 NEW=64
  SHAPES="llama-3.2-1b llama-3.1-8b" LENGTHS=500,2000 MIXED=()
fi
SITE=${GPU_CHECK_SITE:-/tmp/crowdchat-site}
DATA=/tmp/crowdchat-gpu-data
MODEL=${CROWDCHAT_CUDA_MODEL:-/tmp/crowdchat-random-smollm2}
JSONL=$OUT/gpu_check.jsonl
LOG=$OUT/log.txt
: >"$JSONL"
: >"$LOG"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error CROWDCHAT_CUDA_MODEL=$MODEL

left() { echo $((BUDGET - ($(date +%s) - T0))); }

# record NAME RC SECONDS FILE: one JSON line with the step's last JSON object, or its pytest
# tally, or the tail of its output.
record() {
  "$PY" - "$@" <<'PY' | tee -a "$JSONL"
import json, re, sys
name, rc, secs, path = sys.argv[1:5]
try:
    lines = open(path, errors="replace").read().splitlines()
except OSError:
    lines = []
row = {"step": name, "rc": int(rc) if rc.lstrip("-").isdigit() else rc, "seconds": int(secs)}
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

# step NAME LIMIT_S CMD...: run CMD with min(LIMIT_S, what the budget has left) seconds.
step() {
  local name=$1 limit=$2
  shift 2
  local rem=$(($(left) - 10))
  if [ "$rem" -lt 20 ]; then
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
  record "$name" "$rc" $(($(date +%s) - s)) "$f"
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
s["steps"] = {r["step"]: r.get("rc") for r in rows if "step" in r}
s["failed"] = [r["step"] for r in rows if "step" in r and not r.get("ok")]
for r in rows:
    res, name = r.get("result") or {}, r.get("step")
    if "cuda" in r:
        s["cuda"] = r["cuda"]
    if name == "env":
        s["cuda"] = res.get("cuda", False)
        s["env"] = res
    elif name == "nvidia_smi":
        s["gpu"] = (r.get("tail") or [""])[0]
    elif name == "tests":
        s["tests"] = r.get("pytest", {})
        s["test_failures"] = r.get("failures", [])
    elif res:
        s[name] = res


def ratio(a, b):
    return round(a / b, 2) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


tp, eager = s.get("throughput", {}), s.get("throughput_eager", {})
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
# regex only where the python's own is older than transformers wants (its wheel is cp312)
old_regex=$("$PY" -c 'import importlib.metadata as m, sys
from packaging.version import Version as V
try:
    old = V(m.version("regex")) < V("2025.10.22")
except Exception:
    old = True
print(int(old and sys.version_info[:2] == (3, 12)))' 2>/dev/null)
if [ "$DEV" = cuda ]; then  # a smoke run uses this machine's own packages
  for w in .gpu/wheels/*.whl; do
    case $w in */regex-*) [ "$old_regex" = 1 ] || continue ;; esac
    [ -f "$w" ] && "$PY" -m zipfile -e "$w" "$SITE" >>"$LOG" 2>&1
  done
  [ -d .gpu/site ] && cp -r .gpu/site/. "$SITE"/
fi
export PYTHONPATH=$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}

step env 90 "$PY" -c '
import json, importlib.metadata as md, torch
row = {"python": __import__("sys").version.split()[0], "torch": torch.__version__,
       "cuda": torch.cuda.is_available()}
if row["cuda"]:
    row["gpu"] = torch.cuda.get_device_name(0)
    row["vram_mb"] = torch.cuda.mem_get_info()[1] >> 20
for name in ("transformers", "bitsandbytes", "sqlite-utils", "safetensors", "tokenizers",
             "huggingface-hub", "accelerate", "prometheus-client"):
    try:
        row[name] = md.version(name)
    except md.PackageNotFoundError:
        row[name] = None
import transformers, sqlite_utils, sessions, engine  # the imports the steps need
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

[ "$DEV" = cuda ] && step nvidia_smi 20 nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version \
  --format=csv,noheader
step random_model 90 "$PY" bench/random_model.py "$MODEL"
step tests 150 "$PY" -m pytest -q -p no:cacheprovider -rfE tests/test_cuda.py \
  tests/test_triton_attention.py tests/test_triton_layer.py tests/test_sampler.py
step throughput 120 "$PY" bench/throughput.py --device $DEV --model "$MODEL" --data-dir "$DATA" \
  --users $USERS --new-tokens $NEW --sequential-requests 2
# the same with every step eager (no CUDA graphs: vLLM's --enforce-eager)
step throughput_eager 100 "$PY" bench/throughput.py --device $DEV --model "$MODEL" \
  --data-dir "$DATA" --users $EAGER_USERS --new-tokens $NEW --sequential-requests 1 \
  --cuda-graph-rows 0
# users over HTTP: the API server (no Gradio on the GPU box), streamed chats of 2 turns
step http 120 "$PY" bench/load.py --users $HTTP_USERS --turns 2 --new-tokens $NEW \
  --server-args "--ui off --device $DEV --model $MODEL"
step admin 75 "$PY" bench/admin_snapshot.py --device $DEV --model "$MODEL" --data-dir "$DATA" \
  --out "$OUT"
step restore 100 "$PY" bench/restore.py --device $DEV --model "$MODEL" --data-dir "$DATA" \
  --lengths $LENGTHS --repeats 1
step mixed 100 "$PY" bench/mixed.py --model "$MODEL" --device $DEV --data-dir "$DATA" \
  ${MIXED[@]+"${MIXED[@]}"}
# transformers' own: generate with a static cache (compiled by transformers: the slowest
# start here, hence after the quick steps) and generate_batch
step hf_generate 150 "$PY" bench/hf_generate.py --device $DEV --model "$MODEL" \
  --data-dir "$DATA" --batch $BATCH --new-tokens $NEW
# the decode attention gathered for SDPA (the path before the Triton kernel)
step throughput_gather 90 "$PY" bench/throughput.py --device $DEV --model "$MODEL" \
  --data-dir "$DATA" --users 1,32 --new-tokens $NEW --sequential-requests 1 \
  --cuda-attention gather
step throughput_bf16 60 "$PY" bench/throughput.py --device $DEV --model "$MODEL" \
  --data-dir "$DATA" --quant none --users 1,32 --new-tokens $NEW --sequential-requests 1
# larger Llama shapes (random weights over SmolLM2's tokenizer: bench/random_model.py), nf4,
# drawn on the GPU; contexts capped at 8,192 as a serving config would
for shape in $SHAPES; do
  dir=/tmp/crowdchat-random-$shape
  step "random_$shape" 150 "$PY" bench/random_model.py "$dir" --shape "$shape" --device cuda
  step "throughput_$shape" 150 "$PY" bench/throughput.py --device cuda --model "$dir" \
    --data-dir "$DATA" --max-model-len 8192 --users 1,32,64 --sequential-requests 1
done
[ -n "$SHAPES" ] && step restore_llama-3.1-8b 120 "$PY" bench/restore.py --device cuda \
  --model /tmp/crowdchat-random-llama-3.1-8b --data-dir "$DATA" --lengths 2000 --repeats 1
finish
