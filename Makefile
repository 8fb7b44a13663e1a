# The two commands a new user runs (see README). Both are idempotent.
.PHONY: setup setup-runtime demo test test-fast test-integration lint format clean-demo

# setup: everything (runtime + test extras, SLURM and munge for the tests); setup-runtime: what the demo and a user's
# runs need, no test extras
setup:
	@bash scripts/setup.sh

setup-runtime:
	@bash scripts/setup.sh --runtime

demo: setup-runtime
	@bash scripts/demo.sh

# both tiers (tests/tiers.py): the fast in-process unit tests (about a minute), then the integration tests
test: setup
	@bash scripts/test.sh $(PYTEST_ARGS)

test-fast: setup
	@LEVIATHAN_TEST_TIER=fast bash scripts/test.sh $(PYTEST_ARGS)

test-integration: setup
	@LEVIATHAN_TEST_TIER=integration bash scripts/test.sh $(PYTEST_ARGS)

# ruff (pinned in requirements-test.txt; config in pyproject.toml): lint + formatting check, 120 columns
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

format: setup
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

clean-demo:
	rm -rf runs/demo
