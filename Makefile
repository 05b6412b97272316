# mmserve developer entry points. See README.md.
VENV ?= .venv
PY := $(VENV)/bin/python
# pytest-xdist's processes for the Python suite. CI's machine has 2 cores; a third process fills
# the time the others spend waiting on the processes and servers they start (the cores were 19%
# idle with two, 8% with three).
PYTEST_WORKERS ?= 3

.PHONY: help setup ext run test test-fast test-py test-rust test-sglang lint lint-py lint-rust format bench bench-check clean

## help: list these targets
help:
	@awk '/^## /{sub(/^## /, ""); i = index($$0, ": "); printf "  %-12s %s\n", substr($$0, 1, i - 1), substr($$0, i + 2)}' $(MAKEFILE_LIST)

## setup: install everything from nothing (Debian packages, Rust, Python env, the extension)
setup:
	@bash .ci/setup.sh

## ext: rebuild the Rust extension into the environment after Rust changes
ext:
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release --skip-install --quiet

## run: the aggregated deployment on the default tiny model (RUN_ARGS: the launch script's flags)
run:
	PATH=$(abspath $(VENV))/bin:$$PATH bash launch/agg.sh $(RUN_ARGS)

## test: the whole test suite (Python and Rust)
test: test-rust test-py

## test-fast: the developer loop: the Python tests not marked slow (tests/conftest.py), under 3 minutes on 2 cores
test-fast:
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

## test-py: the Python suite alone, on PYTEST_WORKERS processes (each file on one; the 25 slowest tests listed at the end, to keep CI's time in view)
test-py:
	$(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25

## test-rust: the Rust tests alone: the core without features, then with parallel and video (their own tests)
test-rust:
	cd rust/mmserve-mm && cargo test --no-default-features --quiet
	cd rust/mmserve-mm && cargo test --features parallel,video,audio --quiet

## test-sglang: the sglang engine's contract tests in SGLang's environment (.venv/sglang, made by setup; make test runs them too)
test-sglang:
	PYTHONWARNINGS=ignore $(VENV)/sglang/bin/python -m pytest -q -p no:cacheprovider -W ignore -o timeout=600 tests/engines/test_sglang_contract.py

## bench-check: mmserve's preprocessing against the transformers processors, same run; fails below bench/preprocess_check.py's RATIOS
bench-check:
	$(PY) -m bench.preprocess_check

## lint: ruff, ruff format, mypy, typos, shellcheck, rustfmt and clippy (what CI runs before the tests); the Python and Rust halves side by side
lint:
	@$(MAKE) --no-print-directory -j2 --output-sync=target lint-py lint-rust

## lint-py: ruff, ruff format, mypy, typos and shellcheck
lint-py:
	$(VENV)/bin/ruff check components tests bench
	$(VENV)/bin/ruff format --check components tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/typos
	$(VENV)/bin/shellcheck launch/*.sh .ci/run .ci/setup.sh .ci/extra_pin

## lint-rust: rustfmt, and clippy without features and with all of them
lint-rust:
	cd rust/mmserve-mm && cargo fmt --check && cargo clippy --all-targets --no-default-features -- -D warnings && cargo clippy --all-targets --features python,parallel,video,audio -- -D warnings

## format: rewrite what lint checks the layout of: ruff's fixes, ruff format, cargo fmt
format:
	$(VENV)/bin/ruff check --fix components tests bench
	$(VENV)/bin/ruff format components tests bench
	cd rust/mmserve-mm && cargo fmt

## bench: the benchmarks' quick runs (--quick: router, encode router, preprocessing, video), each printing its table
bench:
	$(PY) -m bench.router --quick
	$(PY) -m bench.encode_router --quick
	$(PY) -m bench.preprocess --quick
	$(PY) -m bench.video --quick

## clean: remove build outputs and tool caches (the environment and its installed extension stay)
clean:
	cd rust/mmserve-mm && cargo clean
	rm -rf .mypy_cache .ruff_cache .pytest_cache .hypothesis
	find components tests bench -name __pycache__ -type d -prune -exec rm -rf {} +
