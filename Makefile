# cascade build. `make` builds build/libcascade.a, build/libcascade.so and
# build/cascade; `make test` builds and runs every tests/test_*.c; `make asan`
# does the same with AddressSanitizer and UndefinedBehaviorSanitizer in
# build-asan/. `make CUDA=1` adds the CUDA backend (src/cuda, nvcc).
# `make install PREFIX=... [DESTDIR=...]` installs the command, both libraries
# (the shared one with a versioned soname), the public headers and cascade.pc
# for pkg-config; `make uninstall` removes them (see the install section).
#
# Sources are found by wildcard: every src/<layer>/*.c goes into the library
# (src/tools/*.c into the command), every tests/test_*.c is one test program.
# Files named *_avx2.c, *_avx512.c, *_avx512vnni.c (AVX-512 + VNNI), *_amx.c
# (AVX-512 + AMX-INT8) and *_avx512bf16.c (AVX-512 BF16 + AMX-BF16) are
# compiled with those instruction sets; the code calling them checks the CPU
# at run time.

BUILD   ?= build
CC      ?= cc
NVCC    ?= nvcc
PYTHON  ?= python3

WARN    := -Wall -Wextra -Wpedantic -Wshadow -Wstrict-prototypes -Wmissing-prototypes \
           -Wno-unused-parameter -Wvla -Wformat=2
OPT     ?= -O2
CFLAGS  ?=
BASEFLAGS := -std=c11 $(OPT) -g -fPIC -fopenmp -ffp-contract=fast -D_GNU_SOURCE $(WARN) -MMD -MP
LDLIBS  := -fopenmp -lm -lpthread
# libraries used by higher layers, linked when present on the machine
PKGS    := $(shell for p in libpcre2-8 libxxhash jansson libmicrohttpd; do pkg-config --exists $$p 2>/dev/null && echo $$p; done)
ifneq ($(strip $(PKGS)),)
BASEFLAGS += $(shell pkg-config --cflags $(PKGS))
LDLIBS    += $(shell pkg-config --libs $(PKGS))
endif

ALL_FLAGS = $(BASEFLAGS) $(CFLAGS)

LAYERS  := core attn model gpu kv sched engine server
LIB_SRC := $(foreach l,$(LAYERS),$(wildcard src/$(l)/*.c))
TOOL_SRC := $(wildcard src/tools/*.c)
TEST_SRC := $(wildcard tests/test_*.c)
TEST_SUPPORT := $(filter-out tests/test_%,$(wildcard tests/*.c))

LIB_OBJ := $(patsubst %.c,$(BUILD)/%.o,$(LIB_SRC))
TOOL_OBJ := $(patsubst %.c,$(BUILD)/%.o,$(TOOL_SRC))
TEST_BIN := $(patsubst tests/%.c,$(BUILD)/tests/%,$(TEST_SRC))
TEST_SUPPORT_OBJ := $(patsubst %.c,$(BUILD)/%.o,$(TEST_SUPPORT))

ifeq ($(CUDA),1)
CUDA_SRC := $(wildcard src/cuda/*.cu src/gpu/*.cu)
CUDA_OBJ := $(patsubst %.cu,$(BUILD)/%.o,$(CUDA_SRC))
CUDA_ARCH ?= -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_80,code=compute_80
NVCCFLAGS ?= -O3 -std=c++17 $(CUDA_ARCH) -Xcompiler -fPIC -lineinfo
CUDA_HOME ?= $(patsubst %/bin/nvcc,%,$(shell which $(NVCC)))
LIB_OBJ += $(CUDA_OBJ) $(patsubst %.c,$(BUILD)/%.o,$(wildcard src/cuda/*.c))
LDLIBS += -L$(CUDA_HOME)/lib64 -L$(CUDA_HOME)/targets/x86_64-linux/lib -Wl,-rpath,$(CUDA_HOME)/lib64 \
          -lcudart -lcublasLt -lcublas -lnccl -lstdc++
BASEFLAGS += -DCAS_WITH_CUDA=1 -isystem $(CUDA_HOME)/include
endif

.PHONY: all test asan clean model reference bench fuzz test-cuda cuda-build-check cuda-bench soak
all: $(BUILD)/libcascade.a $(BUILD)/libcascade.so $(BUILD)/cascade

$(BUILD)/libcascade.a: $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

# Linked with the soname it is installed under (CAS_SONAME, see the install
# section); the link named by the soname lets programs linked against
# build/libcascade.so run from the build tree (LD_LIBRARY_PATH=build). It
# depends on the Makefile so that a build tree from before the soname is
# relinked rather than installed without one.
$(BUILD)/libcascade.so: $(LIB_OBJ) Makefile
	@mkdir -p $(dir $@)
	$(CC) -shared -Wl,-soname,$(CAS_SONAME) -o $@ $(LIB_OBJ) $(LDLIBS) $(LDFLAGS)
	ln -sf libcascade.so $(BUILD)/$(CAS_SONAME)

$(BUILD)/cascade: $(TOOL_OBJ) $(BUILD)/libcascade.a
	$(CC) $(ALL_FLAGS) -o $@ $(TOOL_OBJ) $(BUILD)/libcascade.a $(LDLIBS) $(LDFLAGS)

$(BUILD)/%_avx2.o: %_avx2.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_FLAGS) -mavx2 -mfma -mf16c -c $< -o $@

$(BUILD)/%_avx512.o: %_avx512.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_FLAGS) -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c -c $< -o $@

$(BUILD)/%_amx.o: %_amx.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_FLAGS) -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c -mamx-tile -mamx-int8 -c $< -o $@

$(BUILD)/%_avx512vnni.o: %_avx512vnni.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_FLAGS) -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx2 -mfma -mf16c -c $< -o $@

$(BUILD)/%_avx512bf16.o: %_avx512bf16.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_FLAGS) -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mamx-tile -mamx-bf16 -mfma -mf16c -c $< -o $@

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(ALL_FLAGS) -c $< -o $@

# nvcc's output is kept in $@.log too: cuda-build-check reads ptxas's infos there
$(BUILD)/%.o: %.cu
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -MMD -MP -c $< -o $@ > $@.log 2>&1; rc=$$?; cat $@.log; exit $$rc

$(BUILD)/tests/%: tests/%.c $(TEST_SUPPORT_OBJ) $(BUILD)/libcascade.a
	@mkdir -p $(dir $@)
	$(CC) $(ALL_FLAGS) -Itests -o $@ $< $(TEST_SUPPORT_OBJ) $(BUILD)/libcascade.a $(LDLIBS) $(LDFLAGS)

# Runs every test program; each prints "N passed, N failed"; the runner sums.
# Python checks (tests/check_*.py) compare our outputs with independent
# implementations (NumPy) and print the same summary line; so does
# tests/install/check_install.sh (`make install` into a scratch prefix, then
# a program built against it through pkg-config).
TEST_SCRIPTS := $(wildcard tests/check_*.py) tests/install/check_install.sh

test: all $(TEST_BIN)
	@BUILD=$(BUILD) bash tests/run_all.sh $(TEST_BIN) $(TEST_SCRIPTS)

# A bounded soak of `cascade serve` (about 2.5 minutes; not part of `make test`):
# 256 streaming clients with cuts and bad requests, then no request, KV page or
# memory may be left behind. `make soak SOAK_SECONDS=20` for a short one.
soak: all
	BUILD=$(BUILD) python3 tests/soak_server.py $(if $(SOAK_SECONDS),--seconds $(SOAK_SECONDS))

asan:
	$(MAKE) BUILD=build-asan OPT=-O1 \
	  CFLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined" \
	  LDFLAGS="-fsanitize=address,undefined" test

model:
	bash tools/get_model.sh

# Remakes the reference fixtures from llama.cpp (tests/fixtures/: the default
# model's logits, the tiny models of every architecture with theirs, and a
# tiny model quantized by llama.cpp's llama-quantize to each type with
# theirs; and the default model requantized to each type in models/quants/):
# builds llama.cpp from the llama-cpp-python sdist on PyPI, ~15 minutes on 2
# cores (WHAT=smollm2, arch or quants for one part). The tests read the
# committed fixtures; they need neither.
reference:
	bash tools/make_reference_logits.sh

clean:
	rm -rf build build-asan

# ---- CUDA backend: tests and benchmark (need CUDA=1) ----------------------
# `make CUDA=1 test-cuda` builds and runs tests/cuda/test_cuda_attn.c on the
# GPU (against the float64 reference) and the planner's CPU test
# (tests/cuda/test_cuda_plan.c); `make CUDA=1 cuda-build-check` compiles the
# backend, its tests and its benchmark and runs the planner's test and the
# check that ptxas serialized no kernel's wgmma (check_wgmma_serial.sh; works
# without a GPU: CI);
# `make CUDA=1 cuda-bench` builds bench/cuda/attn_bench_cuda; `make CUDA=1`
# builds `cascade` with `attn-bench --backend cuda` (cuda-build-check compiles
# that command's object too, which needs none of the higher layers' libraries).
# tools/sass_diff.py compares the kernels' machine code of two builds.
CUDA_TEST_BIN := $(BUILD)/tests/cuda/test_cuda_attn
# the GPU forward against the CPU's (src/gpu; links the whole library); also
# in test-cuda: the engine's tests on the GPU (tests/cuda/engine_on_gpu.sh)
# and the comparison with transformers (tests/cuda/check_gpu_transformers.py,
# needs torch, transformers and gguf)
GPU_MODEL_TEST := $(BUILD)/tests/cuda/test_gpu_model
# tensor parallelism on the synthetic Llama-3-8B shape against the same
# weights on one device (tests/cuda/test_gpu_tp.c; needs ~40 GB of GPU memory)
GPU_TP_TEST := $(BUILD)/tests/cuda/test_gpu_tp
CUDA_BENCH_BIN := $(BUILD)/bench/cuda/attn_bench_cuda
# The attention backend's own archive (core + attn + cuda): its test and
# benchmark need nothing of the higher layers (and their libraries).
ATTN_OBJ := $(filter $(BUILD)/src/core/% $(BUILD)/src/attn/% $(BUILD)/src/cuda/%,$(LIB_OBJ))
$(BUILD)/libcascade_attn.a: $(ATTN_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(CUDA_TEST_BIN): tests/cuda/test_cuda_attn.c $(TEST_SUPPORT_OBJ) $(BUILD)/libcascade_attn.a
	@mkdir -p $(dir $@)
	$(CC) $(ALL_FLAGS) -Itests -o $@ $< $(TEST_SUPPORT_OBJ) $(BUILD)/libcascade_attn.a $(LDLIBS) $(LDFLAGS)

# The planner's test: the backend's host code on the CPU against the runtime
# stand-ins of tests/cuda/cuda_stub.c (no libcudart, no kernels, no GPU)
CUDA_PLAN_TEST := $(BUILD)/tests/cuda/test_cuda_plan
PLAN_TEST_OBJ := $(filter $(BUILD)/src/core/% $(BUILD)/src/attn/%,$(LIB_OBJ)) $(BUILD)/src/cuda/cuda_attn.o $(BUILD)/src/cuda/cuda_attn_plan.o
$(CUDA_PLAN_TEST): tests/cuda/test_cuda_plan.c tests/cuda/cuda_stub.c tests/cuda/cuda_rt_stub.c tests/cuda/cuda_stub.h $(PLAN_TEST_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_FLAGS) -Itests -o $@ tests/cuda/test_cuda_plan.c tests/cuda/cuda_stub.c tests/cuda/cuda_rt_stub.c $(PLAN_TEST_OBJ) -fopenmp -lm -lpthread $(LDFLAGS)

# The GPU forward's host code (src/gpu/gpu_model.c) and the engine's CUDA
# path on the CPU, against stand-ins of the runtime, cuBLASLt, the kernels and
# the CUDA attention (tests/cuda/gpu_stub.c, cuda_rt_stub.c): test_gpu_model
# and test_engine --device cuda on the default model cut to 4 layers
# (tools/truncate_gguf.py). No GPU: CI runs them in cuda-build-check.
STUB_OBJ := $(filter $(BUILD)/src/core/% $(BUILD)/src/attn/% $(BUILD)/src/model/% $(BUILD)/src/kv/% \
              $(BUILD)/src/sched/% $(BUILD)/src/engine/%,$(LIB_OBJ)) $(BUILD)/src/gpu/gpu_model.o
STUB_SRC := tests/cuda/gpu_stub.c tests/cuda/cuda_rt_stub.c tests/cuda/nccl_stub.c
STUB_LIBS := -fopenmp -lm -lpthread $(if $(strip $(PKGS)),$(shell pkg-config --libs $(PKGS)))
STUB_MODEL := $(BUILD)/stub-model.gguf
STUB_TESTS := $(BUILD)/tests/cuda/stub_test_gpu_model $(BUILD)/tests/cuda/stub_test_engine
$(BUILD)/tests/cuda/stub_test_gpu_model: tests/cuda/test_gpu_model.c $(STUB_SRC) $(STUB_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_FLAGS) -Itests -o $@ $< $(STUB_SRC) $(STUB_OBJ) $(STUB_LIBS) $(LDFLAGS)
$(BUILD)/tests/cuda/stub_test_engine: tests/test_engine.c $(STUB_SRC) $(STUB_OBJ)
	@mkdir -p $(dir $@)
	$(CC) $(ALL_FLAGS) -Itests -o $@ $< $(STUB_SRC) $(STUB_OBJ) $(STUB_LIBS) $(LDFLAGS)
$(STUB_MODEL): tools/truncate_gguf.py
	$(PYTHON) tools/truncate_gguf.py models/SmolLM2-135M-Instruct.Q4_1.gguf $@ --layers 4

$(CUDA_BENCH_BIN): bench/cuda/attn_bench_cuda.c $(BUILD)/libcascade_attn.a
	@mkdir -p $(dir $@)
	$(CC) $(ALL_FLAGS) -o $@ $< $(BUILD)/libcascade_attn.a $(LDLIBS) $(LDFLAGS)

ifeq ($(CUDA),1)
# The GPU timeline recorder (tools/cuda_trace.c, loaded through
# CUDA_INJECTION64_PATH; tools/cuda_idle.py reads its CSV). It needs CUPTI,
# which not every toolkit install has: cuda-build-check compiles it when the
# header and library are there.
CUDA_TRACE_LIB := $(BUILD)/libcas_cuda_trace.so
ifneq ($(and $(wildcard $(CUDA_HOME)/include/cupti.h),$(wildcard $(CUDA_HOME)/lib64/libcupti.so*)),)
CUDA_TRACE_CHECK := $(CUDA_TRACE_LIB)
endif
$(CUDA_TRACE_LIB): tools/cuda_trace.c
	@mkdir -p $(dir $@)
	$(CC) -shared -fPIC -O2 -Wall -Wextra -isystem $(CUDA_HOME)/include $< -o $@ \
	  -L$(CUDA_HOME)/lib64 -lcupti -Wl,-rpath,$(CUDA_HOME)/lib64
test-cuda: $(CUDA_TEST_BIN) $(CUDA_PLAN_TEST) $(GPU_MODEL_TEST) $(GPU_TP_TEST) $(BUILD)/tests/cuda/gpu_logits $(BUILD)/tests/test_engine
	@BUILD=$(BUILD) bash tests/run_all.sh $(CUDA_TEST_BIN) $(CUDA_PLAN_TEST) $(GPU_MODEL_TEST) $(GPU_TP_TEST) \
	  tests/cuda/engine_on_gpu.sh tests/cuda/check_gpu_transformers.py
cuda-build-check: $(CUDA_TRACE_CHECK) $(BUILD)/libcascade_attn.a $(CUDA_TEST_BIN) $(CUDA_BENCH_BIN) $(BUILD)/src/tools/cmd_attn_bench.o $(CUDA_PLAN_TEST) $(GPU_MODEL_TEST) $(GPU_TP_TEST) $(STUB_TESTS) $(STUB_MODEL)
	@BUILD=$(BUILD) STUB_MODEL=$(STUB_MODEL) bash tests/run_all.sh $(CUDA_PLAN_TEST) tests/cuda/on_stubs.sh
	@bash tests/cuda/check_wgmma_serial.sh $(CUDA_OBJ:=.log)
	@echo "CUDA backend, test, benchmark and attn-bench --backend cuda compiled; the planner's and the stand-ins' tests ran"
cuda-bench: $(CUDA_BENCH_BIN)
else
test-cuda cuda-build-check cuda-bench:
	@echo "$@ needs CUDA=1" && false
endif

-include $(LIB_OBJ:.o=.d) $(TOOL_OBJ:.o=.d)

# ---- installing the library -------------------------------------------------
# `make install` copies what `make` built into PREFIX (default /usr/local),
# every path prefixed with DESTDIR (default empty) for staged installs:
#   $(BINDIR)/cascade             the command
#   $(LIBDIR)/libcascade.a        the static library
#   $(LIBDIR)/libcascade.so.0.1.0 the shared library, soname libcascade.so.0
#   $(LIBDIR)/libcascade.so.0     a link to it, the name the loader looks for
#   $(LIBDIR)/libcascade.so       a link to that, the name -lcascade finds
#   $(INCLUDEDIR)/cascade/*.h     the public headers: #include <cascade/engine.h>
#   $(PKGCONFIGDIR)/cascade.pc    pkg-config --cflags --libs [--static] cascade
# (0.1.0 and 0 are CAS_VERSION and CAS_SOVERSION below.)
# BINDIR, LIBDIR, INCLUDEDIR, PKGCONFIGDIR are PREFIX/bin, /lib, /include
# and LIBDIR/pkgconfig unless given on the command line (e.g.
# LIBDIR=/usr/lib/x86_64-linux-gnu). `make uninstall` (same variables)
# removes exactly those files. Neither runs ldconfig: after a system-wide
# install, run it yourself (sudo ldconfig).
#
# The public headers are the layers' contracts a program needs to drive the
# engine or the model and attention layers directly; not the *_impl.h
# internals, not the server's header (cascade serve is the server). A CUDA=1
# library adds src/cuda/cuda_attn.h (the attention contract on the GPU), and
# cascade.pc then gives the CUDA toolkit's include path (the header includes
# cuda_runtime_api.h) and lists cudart and cuBLAS for static links. In the tree the headers
# include each other as "../core/core.h"; installed side by side they include
# "core.h", which sed rewrites on the way.
#
# The soname's number (CAS_SOVERSION) changes when the ABI breaks; the
# version names the release.
CAS_VERSION   := 0.1.0
# what `cascade serve` answers at /version
$(BUILD)/src/server/server_http.o: ALL_FLAGS += -DCAS_VERSION_STRING='"$(CAS_VERSION)"'
CAS_SOVERSION := 0
CAS_SONAME    := libcascade.so.$(CAS_SOVERSION)

PREFIX       ?= /usr/local
DESTDIR      ?=
BINDIR       := $(PREFIX)/bin
LIBDIR       := $(PREFIX)/lib
INCLUDEDIR   := $(PREFIX)/include
PKGCONFIGDIR  = $(LIBDIR)/pkgconfig
INSTALL      ?= install

PUBLIC_HEADERS := src/core/core.h src/attn/attn.h src/model/tensor.h src/model/model.h \
                  src/kv/kv.h src/sched/sched.h src/engine/engine.h
PC_CFLAGS := -I$${includedir}
ifeq ($(CUDA),1)
PUBLIC_HEADERS += src/cuda/cuda_attn.h
PC_CFLAGS += -I$(CUDA_HOME)/include
endif

# What the static library needs besides itself goes into cascade.pc's
# Libs.private: LDLIBS as the library was linked (OpenMP, libm, pthread, the
# packages PKGS found; CUDA's libraries with CUDA=1). Not Requires.private:
# with it `pkg-config --static` also lists those packages' own private
# libraries (libmicrohttpd: gnutls, unistring, ...) for a fully static link,
# which fails where their static archives are not installed, while the
# archive only needs the libraries themselves, linked dynamically.
#
# A path under PREFIX is written relative to ${prefix}, so the file can be moved.
pc_rel = $(patsubst $(PREFIX)/%,$${prefix}/%,$(patsubst $(PREFIX),$${prefix},$(1)))

.PHONY: install uninstall
install: all
	$(INSTALL) -d "$(DESTDIR)$(BINDIR)" "$(DESTDIR)$(LIBDIR)" "$(DESTDIR)$(INCLUDEDIR)/cascade" \
	  "$(DESTDIR)$(PKGCONFIGDIR)"
	$(INSTALL) -m 755 $(BUILD)/cascade "$(DESTDIR)$(BINDIR)/cascade"
	$(INSTALL) -m 644 $(BUILD)/libcascade.a "$(DESTDIR)$(LIBDIR)/libcascade.a"
	$(INSTALL) -m 755 $(BUILD)/libcascade.so "$(DESTDIR)$(LIBDIR)/libcascade.so.$(CAS_VERSION)"
	ln -sf libcascade.so.$(CAS_VERSION) "$(DESTDIR)$(LIBDIR)/$(CAS_SONAME)"
	ln -sf $(CAS_SONAME) "$(DESTDIR)$(LIBDIR)/libcascade.so"
	for h in $(PUBLIC_HEADERS); do \
	  sed -e 's|^#include "\.\./[a-z_]*/|#include "|' $$h > "$(DESTDIR)$(INCLUDEDIR)/cascade/$$(basename $$h)" && \
	  chmod 644 "$(DESTDIR)$(INCLUDEDIR)/cascade/$$(basename $$h)" || exit 1; \
	done
	printf '%s\n' 'prefix=$(PREFIX)' 'exec_prefix=$${prefix}' \
	  'libdir=$(call pc_rel,$(LIBDIR))' 'includedir=$(call pc_rel,$(INCLUDEDIR))' '' \
	  'Name: cascade' 'Description: LLM inference engine with cascade attention' \
	  'Version: $(CAS_VERSION)' 'Cflags: $(PC_CFLAGS)' 'Libs: -L$${libdir} -lcascade' \
	  'Libs.private: $(strip $(LDLIBS))' > "$(DESTDIR)$(PKGCONFIGDIR)/cascade.pc"
	chmod 644 "$(DESTDIR)$(PKGCONFIGDIR)/cascade.pc"

uninstall:
	rm -f "$(DESTDIR)$(BINDIR)/cascade" "$(DESTDIR)$(LIBDIR)/libcascade.a" \
	  "$(DESTDIR)$(LIBDIR)/libcascade.so.$(CAS_VERSION)" "$(DESTDIR)$(LIBDIR)/$(CAS_SONAME)" \
	  "$(DESTDIR)$(LIBDIR)/libcascade.so" "$(DESTDIR)$(PKGCONFIGDIR)/cascade.pc" \
	  $(foreach h,$(notdir $(PUBLIC_HEADERS)),"$(DESTDIR)$(INCLUDEDIR)/cascade/$(h)")
	rmdir "$(DESTDIR)$(INCLUDEDIR)/cascade" 2>/dev/null || true

# ---- fuzzing the GGUF reader ------------------------------------------------
# `make fuzz` builds fuzz/fuzz_gguf.c with clang's libFuzzer, ASan and UBSan
# in build-fuzz/, writes the seed corpus (fuzz/make_seeds.py) and fuzzes for
# FUZZ_TIME seconds. New inputs collect in build-fuzz/corpus, crashes in
# build-fuzz/crash-*. See fuzz/README.md.
FUZZ_CC   ?= clang
FUZZ_TIME ?= 120
FUZZ_SRC  := fuzz/fuzz_gguf.c src/core/core.c src/model/gguf.c src/model/tokenizer.c src/model/chat.c \
             src/model/jinja.c src/model/quant_k.c
FUZZ_FLAGS := -std=c11 -g -O1 -D_GNU_SOURCE -fopenmp -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined

# the K-quant kernels' AVX2 and AVX-512 files, with their instruction sets (the harness
# checks the CPU; it runs the matrix-vector kernels, which are AVX2)
build-fuzz/quant_k_avx2.o: src/model/quant_k_avx2.c src/model/quant_k.h src/model/tensor.h src/core/core.h
	@mkdir -p build-fuzz
	$(FUZZ_CC) $(subst fuzzer,fuzzer-no-link,$(FUZZ_FLAGS)) -mavx2 -mfma -mf16c -c $< -o $@

build-fuzz/quant_k_avx512vnni.o: src/model/quant_k_avx512vnni.c src/model/quant_k.h src/model/tensor.h src/core/core.h
	@mkdir -p build-fuzz
	$(FUZZ_CC) $(subst fuzzer,fuzzer-no-link,$(FUZZ_FLAGS)) -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni \
	  -mavx2 -mfma -mf16c -c $< -o $@

build-fuzz/fuzz_gguf: $(FUZZ_SRC) build-fuzz/quant_k_avx2.o build-fuzz/quant_k_avx512vnni.o src/model/model.h \
                      src/model/tensor.h src/model/quant_k.h src/core/core.h
	@mkdir -p build-fuzz
	$(FUZZ_CC) $(FUZZ_FLAGS) $$(pkg-config --cflags libpcre2-8) -o $@ $(FUZZ_SRC) build-fuzz/quant_k_avx2.o \
	  build-fuzz/quant_k_avx512vnni.o \
	  $$(pkg-config --libs libpcre2-8) -lm -lpthread

fuzz: build-fuzz/fuzz_gguf
	@mkdir -p build-fuzz/corpus
	$(PYTHON) fuzz/make_seeds.py build-fuzz/seeds
	build-fuzz/fuzz_gguf -max_total_time=$(FUZZ_TIME) -max_len=65536 -timeout=10 \
	  -rss_limit_mb=4096 -artifact_prefix=build-fuzz/ build-fuzz/corpus build-fuzz/seeds

# ---- fuzzing the Jinja interpreter -------------------------------------------
# `make fuzz-jinja` builds fuzz/fuzz_jinja.c (chat templates: compile and
# render under small limits) with libFuzzer, ASan and UBSan and fuzzes for
# FUZZ_TIME seconds from our test templates (tests/fixtures/jinja/), with
# fuzz/jinja.dict. Crashes land in build-fuzz/jinja-crash-*.
.PHONY: fuzz-jinja
FUZZ_JINJA_SRC := fuzz/fuzz_jinja.c src/model/jinja.c src/core/core.c

build-fuzz/fuzz_jinja: $(FUZZ_JINJA_SRC) src/model/model.h src/core/core.h
	@mkdir -p build-fuzz
	$(FUZZ_CC) $(FUZZ_FLAGS) -o $@ $(FUZZ_JINJA_SRC) -lm -lpthread

fuzz-jinja: build-fuzz/fuzz_jinja
	@mkdir -p build-fuzz/corpus-jinja
	build-fuzz/fuzz_jinja -max_total_time=$(FUZZ_TIME) -max_len=16384 -timeout=10 \
	  -rss_limit_mb=4096 -dict=fuzz/jinja.dict -artifact_prefix=build-fuzz/jinja- build-fuzz/corpus-jinja \
	  tests/fixtures/jinja

# ---- fuzzing the server's request handling ----------------------------------
# `make fuzz-server` builds fuzz/fuzz_server.c (cas_srv_parse: routing, API
# key, JSON validation; cas_srv_head_check: request heads; cas_srv_tools: tool
# calls in generated text) with libFuzzer, ASan and UBSan and fuzzes for
# FUZZ_TIME seconds from fuzz/server_seeds. Crashes land in
# build-fuzz/server-crash-*.
.PHONY: fuzz-server
FUZZ_SERVER_SRC := fuzz/fuzz_server.c src/server/server_parse.c src/server/server_gate.c src/server/server_tools.c \
                   src/core/core.c

build-fuzz/fuzz_server: $(FUZZ_SERVER_SRC) src/server/server_impl.h src/server/server.h src/engine/engine.h src/core/core.h
	@mkdir -p build-fuzz
	$(FUZZ_CC) -std=c11 -g -O1 -D_GNU_SOURCE -fsanitize=fuzzer,address,undefined \
	  -fno-sanitize-recover=undefined $$(pkg-config --cflags jansson) -o $@ $(FUZZ_SERVER_SRC) \
	  $$(pkg-config --libs jansson) -lm -lpthread

fuzz-server: build-fuzz/fuzz_server
	@mkdir -p build-fuzz/corpus-server
	build-fuzz/fuzz_server -max_total_time=$(FUZZ_TIME) -max_len=65536 -timeout=10 \
	  -rss_limit_mb=4096 -dict=fuzz/server.dict -artifact_prefix=build-fuzz/server- build-fuzz/corpus-server fuzz/server_seeds
