# The two commands a newcomer needs: `make run` and `make test`. Both set up
# everything first (system packages via apt when missing, then .venv).
VENV    ?= .venv
PYTHON  ?= python3
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
ARGS    ?=

.PHONY: run test demo check lint typecheck proto bench clean

$(STAMP): requirements.txt setup.cfg pyproject.toml scripts/bootstrap
	PYTHON=$(PYTHON) VENV=$(VENV) scripts/bootstrap
	touch $@

## run: start the server on 0.0.0.0:9000 with data in ./var/lmdb (ARGS="--listen ..." to change)
run: $(STAMP)
	$(BIN)/sdv-fanout serve $(ARGS)

## test: the whole test suite (what CI runs)
test: $(STAMP)
	$(BIN)/python -m pytest $(ARGS)

## demo: the product end to end in ~30 s: EMQX if a release is found (else mosquitto + simulated ExHook), the server, 200 vehicles (ARGS="--processes 4 --broker sim" to change; see demo/README.md)
demo: $(STAMP)
	$(BIN)/python -m demo.run $(ARGS)

## check: lint, format and type checks (also part of `make test`)
check: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check exhook_server storage
	$(BIN)/mypy exhook_server storage

## proto: regenerate exhook_server/_proto from proto/
proto: $(STAMP)
	$(BIN)/python -m exhook_server.protogen

## bench: every benchmark in bench/ (~6 min on 2 cores), writes docs/BENCHMARKS.md and docs/bench_*.png (not part of `make test`)
bench: $(STAMP)
	$(BIN)/python bench/run_all.py

clean:
	rm -rf $(VENV) build *.egg-info var
