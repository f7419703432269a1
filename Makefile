# The two commands a newcomer needs: `make run` and `make test`. Both set up what they need
# first (system packages via apt when missing, then .venv), one line per step: `make run` the
# runtime set only (requirements-runtime.txt), `make test` everything (requirements.txt: Spark,
# lint and test tools; mosquitto, PostgreSQL, librocksdb and Java from apt).
VENV    ?= .venv
PYTHON  ?= python3
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
RUNTIME := $(VENV)/.runtime
ARGS    ?=
# Two workers: the suite's tests wait on subprocesses, brokers and databases about half the time,
# so two share 2 cores well; more multiply the brokers and clusters started (one per worker).
TEST_WORKERS ?= 2

.PHONY: run test demo check lint typecheck proto bench clean

$(RUNTIME): requirements-runtime.txt setup.cfg pyproject.toml scripts/bootstrap
	PYTHON=$(PYTHON) VENV=$(VENV) scripts/bootstrap runtime
	touch $@

$(STAMP): requirements.txt requirements-runtime.txt setup.cfg pyproject.toml scripts/bootstrap
	PYTHON=$(PYTHON) VENV=$(VENV) scripts/bootstrap dev
	touch $(RUNTIME) $@

## run: start the server on 127.0.0.1:9000 (metrics 127.0.0.1:9100) with data in ./var/lmdb; installs the runtime set only (ARGS="--listen 0.0.0.0:9000 ..." to change)
run: $(RUNTIME)
	$(BIN)/sdv-fanout serve $(ARGS)

## test: the whole test suite (what CI runs), on TEST_WORKERS pytest-xdist workers (TEST_WORKERS=0: one process)
test: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(ARGS)

## demo: the product end to end in ~30 s: EMQX if a release is found (else mosquitto + simulated ExHook), the server, 200 vehicles (ARGS="--processes 4 --broker sim" to change; see demo/README.md)
demo: $(STAMP)
	$(BIN)/python -m demo.run $(ARGS)

## check: lint, format and type checks (also part of `make test`)
check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check exhook_server storage spark
	$(BIN)/mypy exhook_server storage spark
	$(BIN)/mypy -p testkit

## proto: regenerate exhook_server/_proto from proto/
proto: $(STAMP)
	$(BIN)/python -m exhook_server.protogen

## bench: every benchmark in bench/ (~6 min on 2 cores), writes docs/BENCHMARKS.md and docs/bench_*.png (not part of `make test`)
bench: $(STAMP)
	$(BIN)/python -m bench.run_all

clean:
	rm -rf $(VENV) build *.egg-info var
