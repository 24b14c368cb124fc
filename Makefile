.PHONY: test lint
test:
	bash scripts/test.sh
lint:
	.venv/bin/ruff check .
