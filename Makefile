# Everything a fresh machine needs: `make train` runs the example on 2 CPU processes, `make test` the suite.
# Both create .venv (torch==2.13.0 CPU wheel + accel built with its native extension) when it is missing.
PYTHON ?= python3
VENV ?= .venv
PURE_VENV ?= .venv-pure
TORCH ?= torch==2.13.0
BUILD_TOOLS = ninja "setuptools>=64" wheel
# Same lists as pyproject.toml's dependencies and [test] extra; the pure venv installs them by name so
# that accel itself is installed exactly once, without its extension.
RUNTIME_DEPS = pyyaml numpy packaging "safetensors>=0.4"
# The libraries built on HF Accelerate are pinned: tests/integrations run them against HF Accelerate, and
# tests/conformance freezes the accelerate names these releases use (README: "Using Trainer, TRL, PEFT").
TEST_DEPS = pytest pytest-timeout psutil pytest-benchmark "hypothesis>=6" \
	"tensorboard>=2.10" "matplotlib>=3.5" "wandb>=0.17" "mlflow-skinny>=2.10" "torchdata>=0.8" "accelerate==1.15.0" \
	"transformers==5.25.0" "trl==1.16.0" "peft==0.21.2" "datasets==5.2.0" "deepspeed==0.19.8" "ray[train]==2.60.0"
PYTEST_ARGS ?= -q -p no:cacheprovider --durations=15
# pytest-benchmark's flags for every benchmark target: timings only, medians with their spread.
BENCH_ARGS = --benchmark-only -p no:cacheprovider -q --benchmark-columns=median,iqr,rounds

.PHONY: setup train lint test test-native test-fallback test-pure bench bench-docs bench-gather bench-unscale bench-checkpoint bench-big-model bench-process-group bench-hosts bench-hf-stack bench-fsdp2 bench-deepspeed cuda-check shm-check gpu-check gpu-docs ci clean

$(VENV)/.installed: pyproject.toml setup.py $(shell find csrc -type f)
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q $(TORCH) $(BUILD_TOOLS)
	ACCEL_BUILD_NATIVE=1 $(VENV)/bin/pip install -q --no-build-isolation -e ".[test]"
	touch $@

setup: $(VENV)/.installed

train: setup
	$(VENV)/bin/accel launch --cpu --num_processes 2 examples/train.py

# The suite three ways: native kernels (and they must load), forced fallbacks, a pure-Python install.
test: test-native test-fallback test-pure

test-native: setup
	ACCEL_EXPECT_NATIVE=1 $(VENV)/bin/pytest $(PYTEST_ARGS)

# The integration tests (real Trainer / TRL / PEFT jobs against HF Accelerate, minutes of 2-process runs; a Ray Train
# job, ~30 s) run once, in test-native: the other two modes change only accel's kernels, which the rest of the suite
# checks in each.
test-fallback: setup
	ACCEL_DISABLE_NATIVE=1 ACCEL_EXPECT_NATIVE=0 $(VENV)/bin/pytest $(PYTEST_ARGS) -m "not integration"

# A non-editable install without the extension; pytest's console script keeps the source tree off sys.path.
$(PURE_VENV)/.installed: pyproject.toml setup.py $(shell find accel -name '*.py')
	test -x $(PURE_VENV)/bin/python || $(PYTHON) -m venv $(PURE_VENV)
	$(PURE_VENV)/bin/pip install -q $(TORCH) $(BUILD_TOOLS)
	$(PURE_VENV)/bin/pip install -q --no-build-isolation $(RUNTIME_DEPS) $(TEST_DEPS)  # deepspeed: an sdist
	rm -rf build  # pip builds in-tree: leave no earlier build's files for this wheel to pick up
	ACCEL_BUILD_NATIVE=0 $(PURE_VENV)/bin/pip install -q --no-build-isolation --force-reinstall --no-deps .
	touch $@

# Every test but the slow ones (jobs launched through the CLI, whose Python paths are test-fallback's, run there):
# this stage checks the installed package without the extension, and CI's whole run has to stay well within an hour.
test-pure: $(PURE_VENV)/.installed
	ACCEL_EXPECT_NATIVE=0 ACCEL_EXPECT_PURE_INSTALL=1 $(PURE_VENV)/bin/pytest $(PYTEST_ARGS) -m "not integration and not slow"

bench: setup
	$(VENV)/bin/pytest benchmarks/bench_*.py $(BENCH_ARGS)

# Every public-path benchmark against HF Accelerate, one after another (run it on a quiet machine): regenerates every
# table and plot under docs/benchmarks/.
bench-docs: bench-gather bench-unscale bench-checkpoint bench-big-model bench-process-group bench-hosts bench-hf-stack \
	bench-fsdp2 bench-deepspeed

# The padded all-gather on 2 and 4 real ranks against HF Accelerate (installed into the venv for the comparison);
# regenerates docs/benchmarks/gather.md and gather.png.
BENCH_OUT ?= docs/benchmarks
bench-gather: setup
	$(VENV)/bin/pip install -q accelerate==1.15.0 matplotlib
	mkdir -p build
	for n in 2 4; do \
	  $(VENV)/bin/accel launch --cpu --num_processes $$n benchmarks/ranked_pytest.py benchmarks/bench_gather.py \
	    $(BENCH_ARGS) --benchmark-json=build/bench-gather-$$n.json \
	    || exit 1; \
	done
	$(VENV)/bin/python benchmarks/report/gather.py $(BENCH_OUT) build/bench-gather-2.json build/bench-gather-4.json

# accelerator.clip_grad_norm_ after backward under fp16, against HF Accelerate 1.15 (installed into the venv), the
# kernels alone and the streaming limit;
# regenerates docs/benchmarks/unscale.md and unscale.png.
bench-unscale: setup
	$(VENV)/bin/pip install -q accelerate==1.15.0 matplotlib
	mkdir -p build
	$(VENV)/bin/pytest benchmarks/bench_unscale.py $(BENCH_ARGS) --benchmark-json=build/bench-unscale.json
	$(VENV)/bin/python benchmarks/report/unscale.py $(BENCH_OUT) build/bench-unscale.json

# Saving and loading 256 MiB / 1 GiB of weights against HF Accelerate (installed into the venv), torch and the
# disk; regenerates docs/benchmarks/checkpoint.md and checkpoint.png.
bench-checkpoint: setup
	$(VENV)/bin/pip install -q accelerate==1.15.0 matplotlib
	mkdir -p build
	$(VENV)/bin/pytest benchmarks/bench_checkpoint.py $(BENCH_ARGS) --benchmark-json=build/bench-checkpoint.json
	$(VENV)/bin/python benchmarks/report/checkpoint.py $(BENCH_OUT) build/bench-checkpoint.json

# load_checkpoint_and_dispatch of 1 GiB against HF Accelerate (installed into the venv): time and peak memory;
# writes docs/benchmarks/big_model.md.
bench-big-model: setup
	$(VENV)/bin/pip install -q accelerate==1.15.0
	mkdir -p build
	$(VENV)/bin/pytest benchmarks/bench_big_model.py $(BENCH_ARGS) --benchmark-json=build/bench-big-model.json
	$(VENV)/bin/python benchmarks/report/big_model.py $(BENCH_OUT) build/bench-big-model.json

# all_reduce on 2 and 4 real ranks, accel's shared-memory process group against gloo and the memcpy limit, then
# training steps per second on 2 processes against HF Accelerate 1.15 (installed into the venv) and FSDP2 against
# gloo; regenerates docs/benchmarks/process_group.md and process_group.png.
bench-process-group: setup
	$(VENV)/bin/pip install -q accelerate==1.15.0 matplotlib
	mkdir -p build
	for n in 2 4; do \
	  $(VENV)/bin/accel launch --cpu --num_processes $$n benchmarks/ranked_pytest.py benchmarks/bench_allreduce.py \
	    $(BENCH_ARGS) --benchmark-json=build/bench-allreduce-$$n.json \
	    || exit 1; \
	done
	$(VENV)/bin/pytest benchmarks/bench_training.py $(BENCH_ARGS) --benchmark-json=build/bench-training.json
	$(VENV)/bin/python benchmarks/report/process_group.py $(BENCH_OUT) build/bench-allreduce-2.json \
	  build/bench-allreduce-4.json build/bench-training.json

# all_reduce on 2 simulated hosts x 2 ranks: two launchers of this machine (machine ranks 0 and 1, meeting at
# 127.0.0.2), each launcher's ranks one host (ACCEL_TEST_HOST_ID); accel's per-host shared memory with gloo among
# the hosts' leaders against flat gloo over the same 4 ranks; then the tiny GPT-2's DDP training steps on the same
# layout, and inside Ray Train's TorchTrainer on 2 CPU workers (pinned to loopback), against HF Accelerate 1.15
# (installed into the venv); regenerates docs/benchmarks/hosts.md and hosts.png.
HOSTS_PORT ?= 29533
bench-hosts: setup
	$(VENV)/bin/pip install -q accelerate==1.15.0 transformers==5.25.0 matplotlib
	mkdir -p build
	pids=""; for m in 0 1; do \
	  ACCEL_TEST_HOST_ID=host$$m ACCEL_BENCH_PAYLOADS=64B,64KiB,4MiB,32MiB $(VENV)/bin/accel launch --cpu \
	    --num_machines 2 --machine_rank $$m --num_processes 4 --main_process_ip 127.0.0.2 \
	    --main_process_port $(HOSTS_PORT) benchmarks/ranked_pytest.py benchmarks/bench_allreduce.py $(BENCH_ARGS) \
	    --benchmark-json=build/bench-hosts.json & pids="$$pids $$!"; \
	done; for p in $$pids; do wait $$p || exit 1; done
	ACCEL_BENCH_HOSTS=2 $(VENV)/bin/pytest benchmarks/bench_training.py -k gpt2 $(BENCH_ARGS) \
	  --benchmark-json=build/bench-hosts-training.json
	ACCEL_BENCH_RAY=1 $(VENV)/bin/pytest benchmarks/bench_training.py -k gpt2 $(BENCH_ARGS) \
	  --benchmark-json=build/bench-ray-training.json
	$(VENV)/bin/python benchmarks/report/hosts.py $(BENCH_OUT) build/bench-hosts.json build/bench-hosts-training.json \
	  build/bench-ray-training.json

# transformers' Trainer and TRL's SFTTrainer on 2 CPU processes, accel (`accel launch --as_accelerate`) against HF
# Accelerate 1.15 (torchrun), with a raw torch DDP loop of the same model over accel's shared-memory group and over
# plain gloo as the limit; regenerates docs/benchmarks/hf_stack.md and hf_stack.png (about 10 minutes on 2 cores).
bench-hf-stack: setup
	$(VENV)/bin/pip install -q accelerate==1.15.0 transformers==5.25.0 trl==1.16.0 datasets==5.2.0 matplotlib
	mkdir -p build
	$(VENV)/bin/pytest benchmarks/bench_hf_stack.py $(BENCH_ARGS) --benchmark-json=build/bench-hf-stack.json
	$(VENV)/bin/python benchmarks/report/hf_stack.py $(BENCH_OUT) build/bench-hf-stack.json

# FSDP2 on 2 CPU processes: a 3.4 M-parameter GPT-2 through accel's Accelerator (accel launch --use_fsdp) against
# torch's fully_shard by hand over gloo and over accel's shared-memory group and against accel's DDP (steps/s, memory
# per rank, loss parity), and sharded save_state against dcp.save; regenerates docs/benchmarks/fsdp2.md and fsdp2.png
# (about 20 minutes on 2 cores).
bench-fsdp2: setup
	$(VENV)/bin/pip install -q transformers==5.25.0 matplotlib
	mkdir -p build
	$(VENV)/bin/pytest benchmarks/bench_fsdp2.py $(BENCH_ARGS) --benchmark-json=build/bench-fsdp2.json
	$(VENV)/bin/python benchmarks/report/fsdp2.py $(BENCH_OUT) build/bench-fsdp2.json

# DeepSpeed ZeRO 1/2/3 under accel against DeepSpeed used directly over gloo, and accel's DDP and FSDP2, on 2 CPU
# processes; regenerates docs/benchmarks/deepspeed.md and deepspeed.png.
bench-deepspeed: setup
	mkdir -p build
	$(VENV)/bin/pytest benchmarks/bench_deepspeed.py $(BENCH_ARGS) --benchmark-json=build/bench-deepspeed.json
	$(VENV)/bin/python benchmarks/report/deepspeed.py $(BENCH_OUT) build/bench-deepspeed.json

# ruff (pyproject.toml's [tool.ruff]: line length 120): lint, and the formatter's check (`ruff format` formats).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

cuda-check:
	tools/cuda_compile_check.sh

# The torch-free native core (csrc/shm) built by CMake (cmake/) and its C++ tests (tests/cpp) run by ctest, once per
# preset of cmake/CMakePresets.json: plain, ThreadSanitizer, AddressSanitizer + UBSan. Build trees in build/shm/.
shm-check:
	@start=$$(date +%s); cd cmake && for preset in plain thread address; do \
	  echo "== shm core: $$preset ==" && cmake --workflow --preset $$preset || exit 1; \
	done; echo "shm core: all presets passed in $$(( $$(date +%s) - start )) s"

# On a machine with a GPU and a CUDA build of torch (in PYTHON, default python3): builds the CUDA kernels in place,
# runs the GPU-marked tests, the GPU benchmarks against HF Accelerate and the many-rank CPU benchmarks, each step
# under its own timeout (GPU_CHECK_STEPS picks steps); results in the folder OUT names (default build/gpu); fails if a
# step failed. Not part of `ci` (CI machines have no GPU). tools/gpu_check_device.md: running it on a lent machine.
gpu-check:
	PYTHON=$(PYTHON) tools/gpu_check.sh

# docs/benchmarks/gpu.md from a gpu-check run: GPU_RESULTS = its results.tar.gz unpacked (a rerun's folder after it).
gpu-docs:
	$(PYTHON) benchmarks/report/gpu.py $(BENCH_OUT) $(GPU_RESULTS)

ci: lint test cuda-check shm-check

clean:
	rm -rf $(VENV) $(PURE_VENV) build *.egg-info accel/_C*.so accel/_build_info.json
