# The two commands a new user runs (see README). Both are idempotent.
.PHONY: setup demo test lint format clean-demo

setup:
	@bash scripts/setup.sh

demo: setup
	@bash scripts/demo.sh

test: setup
	@bash scripts/test.sh $(PYTEST_ARGS)

# ruff (pinned in requirements-test.txt; config in pyproject.toml): lint + formatting check, 120 columns
lint: setup
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

format: setup
	.venv/bin/ruff check --fix .
	.venv/bin/ruff format .

clean-demo:
	rm -rf runs/demo
