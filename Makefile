# Two commands from a fresh clone: `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export OMP_NUM_THREADS ?= 1
export MKL_NUM_THREADS ?= 1

.PHONY: demo test install browser clean peers

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first: 2.13.0 is a local CPU build on these machines; anything else pulls a CUDA build.
# examples/darcy: a third app in a package of its own (the plug-in contract's test installs it too).
$(STAMP): $(BIN)/python pyproject.toml examples/darcy/pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q -e examples/darcy
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/converge demo --out demo-output

# The report test renders the HTML in headless Chromium; as root with apt, install Debian's
# (without it that one test skips and says so).
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && (apt-get install -y -qq chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null 2>&1)) \
	  || echo "chromium not installed: the report render test will skip"; }

# Two pytest workers (pytest-xdist), a test file each at a time (--dist loadfile: a module's fixtures are built
# once): 6:52 -> 4:14 on a 2-core machine. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: $(STAMP) browser
	$(BIN)/python -m pytest -q -m "not slow and not gpu" -n $(TEST_WORKERS) --dist loadfile --durations=15

# The serving peers' environments (Triton from Debian's /usr/bin/python3.11, MLServer, LitServe), made once
# under runs/peer-envs before `converge bench serve RUN --peers triton,mlserver,litserve` needs them.
peers: $(STAMP)
	$(BIN)/python -m converge.bench.peer_envs triton mlserver litserve

clean:
	rm -rf $(VENV) demo-output

# A single-node Slurm cluster on this machine (docs/cluster.md): installs slurm-wlm and munge with apt
# if missing (as root), keeps its files under CONVERGE_SLURM_DIR. tests/slurm start one themselves if
# none is running (and stop it after); one started here is used and left running.
CONVERGE_SLURM_DIR ?= /tmp/converge-slurm
.PHONY: slurm slurm-stop

slurm:
	bash scripts/slurm/localhost-cluster.sh start $(CONVERGE_SLURM_DIR)

slurm-stop:
	bash scripts/slurm/localhost-cluster.sh stop $(CONVERGE_SLURM_DIR)
