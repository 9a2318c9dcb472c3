.PHONY: demo test lint bench

# The server on the embedded default (SQLite, no Redis) with a simulated 4-node x 8-GPU cluster.
demo:
	@bash scripts/bootstrap.sh
	.venv/bin/clusterdx demo $(ARGS)

# Everything: venv, services, ruff, the suite on SQLite and again on PostgreSQL + Redis.
test:
	bash scripts/test.sh $(ARGS)

lint:
	.venv/bin/ruff check .
