# mmserve developer entry points. See README.md.
VENV ?= .venv
PY := $(VENV)/bin/python
APT_PACKAGES := pkg-config libturbojpeg0-dev curl

.PHONY: setup ext run test test-py test-rust lint

## setup: install everything from nothing (Debian packages, Rust, Python env, the extension)
setup:
	@bash .ci/setup.sh

## ext: rebuild the Rust extension into the environment after Rust changes
ext:
	VIRTUAL_ENV=$(abspath $(VENV)) $(VENV)/bin/maturin develop --release --skip-install --quiet

## run: the aggregated deployment on the default tiny model
run:
	PATH=$(abspath $(VENV))/bin:$$PATH bash launch/agg.sh

## test: the whole test suite (Python and Rust)
test: test-rust test-py

test-py:
	$(PY) -m pytest -q -p no:cacheprovider

test-rust:
	cd rust/mmserve-mm && cargo test --no-default-features --quiet

lint:
	$(VENV)/bin/ruff check components tests bench
	$(VENV)/bin/ruff format --check components tests bench
	$(VENV)/bin/mypy
	cd rust/mmserve-mm && cargo fmt --check && cargo clippy --all-targets --no-default-features -- -D warnings && cargo clippy --all-targets --features python,parallel -- -D warnings
