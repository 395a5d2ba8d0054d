# The two commands of the README: `make demo` (the main job) and `make test`.
PY := .venv/bin/python

.PHONY: demo test bench clean

.venv/.installed: pyproject.toml constraints.txt scripts/bootstrap.sh
	bash scripts/bootstrap.sh

.venv/.installed-training: pyproject.toml constraints.txt scripts/bootstrap.sh
	bash scripts/bootstrap.sh --training

demo: .venv/.installed
	.venv/bin/slurm-mig demo

# The Slurm tests run beside the others (scripts/run_tests.py says why)
test: .venv/.installed-training
	$(PY) scripts/run_tests.py

bench: .venv/.installed
	.venv/bin/slurm-mig bench

# Stop what runs from .run before deleting it: daemons whose state dir is gone can no longer be found.
clean:
	-.venv/bin/slurm-mig cluster down
	-$(PY) -c 'from slurm_mig.democluster import DemoCluster; DemoCluster().stop_leftovers()'
	rm -rf .run
