# The two commands a new user runs (see README). Both are idempotent.
.PHONY: setup demo test clean-demo

setup:
	@bash scripts/setup.sh

demo: setup
	@bash scripts/demo.sh

test: setup
	@bash scripts/test.sh $(PYTEST_ARGS)

clean-demo:
	rm -rf runs/demo
