# The two set-up commands are `make run` and `make test`; everything else builds on the same .venv.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=

COMPAT_VENV := .venv-compat
COMPAT_STAMP := $(COMPAT_VENV)/.installed

.PHONY: run sweep test check test-compat test-realwidth bench fixtures lint ui lock clean

$(STAMP): requirements/worker.txt requirements/local.txt requirements/dev.txt requirements/lock.txt pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements/dev.txt -c requirements/lock.txt
	@# The checkout itself, editable: `ddtree-orch` and `python -m orchestrator` then run from any folder.
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	@touch $(STAMP)

## run: the main job on the embedded default (local host, tiny hybrid model, local MLflow store)
run: $(STAMP)
	$(PY) -m orchestrator $(ARGS)

## sweep: a Hydra multirun over the grid conf/sweep/default.yaml, as one MLflow parent run with a child per job
sweep: $(STAMP)
	$(PY) -m orchestrator --multirun sweep=default $(ARGS)

# Test processes at once: one per core, at most four (each test may start a worker, an MLflow server, an sshd).
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 2); echo $$(( n < 4 ? n : 4 )))

## test: the whole test suite, its independent tests in parallel (TEST_WORKERS=1 for one at a time); it ends on
## its 25 slowest tests and the time of each test module
test: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal --durations=25 $(ARGS)

# The inner loop's answer in about two minutes: the lifecycle on a fake transport and tracking, validation,
# redaction, the layers, the event path, host failures, the job's summary, the tree and cache math, the
# published layouts and their twins against the models' own forward in float64, the fixed-shape rounds, the
# paper's sets and table, prompt text of every kind; one MLflow server (resume's forged-run check), no sshd or
# orchestrator process. The lossless decodes (tiny models and twins) are `make test`'s.
CHECK_TESTS = tests/test_architecture.py tests/test_lifecycle.py tests/test_validation.py tests/test_redaction.py \
	tests/test_events.py tests/test_mirror.py tests/test_sink.py tests/test_gdn_math.py \
	tests/test_target_and_trees.py tests/test_twins.py tests/test_host_failures.py tests/test_job_summary.py tests/test_layout.py \
	tests/test_fixed_round.py tests/test_slurm_logic.py tests/test_bootstrap.py tests/test_budget_page.py tests/test_trust.py \
	tests/test_paper_datasets.py tests/test_paper_table.py tests/test_resume_and_plan.py tests/test_prompt_text.py \
	tests/test_home_paths.py

## check: the fast in-process tests (about 2 minutes on 2 cores): `make check` while working, `make test` before a commit
check: $(STAMP)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal -m "not slow" -k "not (twins and (float32 or lossless))" \
		$(CHECK_TESTS) $(ARGS)

## test-compat: the tests that touch transformers (marked compat) under the oldest supported release (5.6.x)
$(COMPAT_STAMP): requirements/worker-compat.txt requirements/worker-compat.lock
	@test -x $(COMPAT_VENV)/bin/python || $(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/python -m pip install --quiet --disable-pip-version-check \
		-r requirements/worker-compat.txt -c requirements/worker-compat.lock
	@touch $(COMPAT_STAMP)

# What differs between transformers releases: the tests marked `compat` (loading, configs, transformers' own
# forwards and the twins against them, the fixed-shape rounds over its layers, one whole worker run). They are
# all in modules marked `worker`, which need only the worker's dependencies; the rest of the suite runs once,
# under the pinned release, in `make test`.
COMPAT_TESTS = $(shell grep -l "pytest.mark.compat" tests/test_*.py)

test-compat: $(COMPAT_STAMP)
	$(COMPAT_VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist worksteal -m "worker and compat" -p no:cacheprovider \
		--durations=10 $(COMPAT_TESTS) $(ARGS)

## test-realwidth: one period of Qwen3.6-27B at its real widths, float32 and bfloat16 (about 2 minutes, 7 GB)
test-realwidth: $(STAMP)
	$(PY) -m pytest -m realwidth -s tests/test_real_width.py $(ARGS)

## bench: the worker's benchmark (JSON and a Markdown table in bench/results/)
bench: $(STAMP)
	$(PY) -m bench.run $(ARGS)

## fixtures: train the tiny trained pairs again (about 25 minutes on 2 CPU cores) into remote_worker/fixtures/
fixtures: $(STAMP)
	$(PY) -m training $(ARGS)

## lint: ruff over the whole tree
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

## ui: the MLflow UI on the local store, at http://127.0.0.1:5000
ui: $(STAMP)
	@echo "runs and charts: http://127.0.0.1:5000/#/experiments?workflowType=machine_learning (MLflow 3 opens its GenAI view otherwise)"
	$(VENV)/bin/mlflow ui --backend-store-uri sqlite:///$(CURDIR)/mlruns.db --host 127.0.0.1 --port 5000

## lock: re-pin every transitive dependency from the current .venv
lock: $(STAMP)
	@{ echo "# Every transitive dependency, pinned: used as pip constraints by the Makefile. Regenerate with 'make lock'."; \
	   $(PY) -m pip freeze --exclude-editable | sed 's/^torch==\([0-9.]*\)+cpu$$/torch==\1/'; } > requirements/lock.txt

clean:
	rm -rf .work .orchestrator outputs multirun
