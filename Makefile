# The developer loop. `make demo` and `make test` work on a fresh clone: they create .venv,
# install oncely with its test and dev extras, and start real Kafka and PostgreSQL themselves.
# They need Python 3.11+, Maven and Java: Java 17+ runs the Kafka broker (java on PATH), and
# make test also needs Java 21+ for the Apicurio schema registry of its schema-registry tests
# (JAVA_HOME, java on PATH or a JDK in /usr/lib/jvm).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: install test-tools lint format check test test-partitioned test-floors chaos demo bench clean image container-tools test-container

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || \
	  { echo "oncely needs Python 3.11+ ($(PYTHON) is $$($(PYTHON) --version))"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

lint: install kubernetes-tools
	$(BIN)/ruff check src tests examples bench tools
	$(BIN)/ruff format --check src tests examples bench tools
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	$(BIN)/oncely schemas check --registry examples.payments.events:registry --dir schemas
	$(BIN)/oncely asyncapi --app examples.payments.app:app --title 'oncely payments example' \
	  --output docs/asyncapi/payments.json --check
	$(BIN)/mkdocs build --strict --site-dir $(VENV)/site
	kubectl kustomize deploy/kubernetes > $(VENV)/kubernetes.yaml
	@# kubernetes-validate only warns about a kind it has no schema for (a misspelt kind): fail.
	$(BIN)/kubernetes-validate --kubernetes-version $(KUBERNETES_VERSION) --strict --quiet \
	  $(VENV)/kubernetes.yaml deploy/kubernetes/secrets.example.yaml >$(VENV)/kubernetes.log 2>&1; \
	  status=$$?; cat $(VENV)/kubernetes.log; test $$status -eq 0 && ! grep -q WARN $(VENV)/kubernetes.log

# The fast loop (about a minute): ruff on the Python files changed since the branch left main
# (or, on main, since the last commit), mypy, the import contracts, and the unit tests that
# neither start processes nor wait (marker slow). `pytest --lf` and `--sw` work on any suite.
BASE ?= $(shell git merge-base HEAD main 2>/dev/null || echo HEAD)
check: install
	@files=$$( { git diff --name-only --diff-filter=d $(BASE) -- '*.py'; \
	  git ls-files --others --exclude-standard -- '*.py'; } | sort -u); \
	  if [ -n "$$files" ]; then echo "ruff: $$(echo $$files | wc -w) changed file(s)"; \
	  $(BIN)/ruff check $$files && $(BIN)/ruff format --check $$files; fi
	$(BIN)/mypy
	$(BIN)/lint-imports --no-cache
	$(BIN)/pytest -q -m "unit and not slow" tests/unit

format: install
	$(BIN)/ruff format src tests examples bench tools
	$(BIN)/ruff check --fix src tests examples bench tools

# What the tests run that PyPI does not serve: promtool and a Prometheus server, from Debian's
# prometheus package (RUNLEVEL=1: the package installs without starting its service), and the
# headless Chromium the console's browser tests drive (Debian's chromium; Playwright never
# downloads a browser of its own).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
APT  := $(SUDO) env DEBIAN_FRONTEND=noninteractive RUNLEVEL=1 apt-get
test-tools:
	@command -v promtool >/dev/null && command -v prometheus >/dev/null || { \
	  echo "installing Debian's prometheus package (promtool and a server, for the rules' tests)"; \
	  $(APT) install -y -qq --no-install-recommends prometheus >/dev/null || \
	  { $(APT) update -qq && $(APT) install -y -qq --no-install-recommends prometheus >/dev/null; }; }
	@command -v chromium >/dev/null || { \
	  echo "installing Debian's chromium package (the console's browser tests)"; \
	  $(APT) install -y -qq --no-install-recommends chromium >/dev/null || \
	  { $(APT) update -qq && $(APT) install -y -qq --no-install-recommends chromium >/dev/null; }; }

# kubectl, whose `kubectl kustomize` renders deploy/kubernetes for make lint and the unit tests:
# the one on PATH, else Debian's kubernetes-client package. make lint validates the rendered
# manifests offline against this Kubernetes version's schemas (kubernetes-validate bundles them).
KUBERNETES_VERSION := 1.30.0
.PHONY: kubernetes-tools
kubernetes-tools:
	@command -v kubectl >/dev/null || { \
	  echo "installing Debian's kubernetes-client package (kubectl, to render deploy/kubernetes)"; \
	  $(APT) install -y -qq --no-install-recommends kubernetes-client >/dev/null || \
	  { $(APT) update -qq && $(APT) install -y -qq --no-install-recommends kubernetes-client >/dev/null; }; }
	@kubectl kustomize --help >/dev/null 2>&1 || \
	  { echo "error: $$(command -v kubectl) cannot run 'kubectl kustomize': install kubectl 1.14 or later"; exit 1; }

# The 30 slowest tests close the output; the JUnit report stays in .oncely/junit/.
REPORT = --durations=30 --junitxml=.oncely/junit/$@.xml
# make test and make test-partitioned run pytest on TEST_WORKERS pytest-xdist workers (0: one
# process), a module at a time to a worker (a module's fixtures stay in one process). Each
# worker starts its own Kafka and PostgreSQL. Two workers on 2 cores: most tests wait on
# processes, brokers and timeouts, so the suite takes 13 minutes instead of 22 (measured here,
# each once, on the same commit).
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadfile
# lint and the floors' run share no file (each has its own venv, mypy cache and site folder)
# and each keeps one core busy, so they run side by side; -O prints each one's output whole.
test: install kubernetes-tools test-tools
	$(MAKE) --no-print-directory -j2 -O lint test-floors
	$(BIN)/pytest $(XDIST) $(REPORT)

# The integration modules whose statements read or write the outbox or the receipts in a way of
# their own, again on test databases converted by `oncely db upgrade --partition-every 1m` (the
# plugin's --oncely-partitioned). Partitions are made 30 min ahead, several times this run's
# length, so rows land in range partitions (a test crossing a minute boundary spans two); more
# partitions ahead only make every test database and every connection's first read slower.
#   test_relay            the relay's reads (every partition, in seq order, by snapshot) and
#                         the release of parked keys (their rows by id)
#   test_stage            staging: seq from a sequence, the idempotency-key guard and the wake-up
#                         NOTIFY, both triggers of the partitioned outbox
#   test_storage          a duplicate key, raised by the key guard, under the constraint's name
#   test_least_privilege  the writer's grants on the partitions, the sequence and the keys table
#   test_republish, test_verify, test_status  their reads of the outbox and the receipts
#   test_console          the console's lookups: an event by id, a key's rows and the rows an
#                         event caused by ranges of ids
#   test_debezium_parity, test_debezium_maintenance  publication via the partition root; purges
#                         that delete across partitions; the first snapshot
# Left out: the modules of the unpartitioned schema itself (migrations, Alembic, the conversion
# in test_partitions.py, retention's, which convert their own databases), and those that reach
# the outbox and the receipts only through statements already run on partitioned tables, by the
# modules above or by make test's fault scenarios (tests/chaos/test_process_faults.py: every
# pipeline of tests/chaos/harness.py has minute partitions): test_relay_isolation (held and
# blocked keys live in unpartitioned tables), test_relay_wakeup (the pace of reads; the wake-up
# trigger is test_stage's), test_consumers and test_effect_writes (a receipt is inserted one at
# a time or a run in one statement, and a duplicate found, by S4's consumers of four ways of
# writing, crashed at each failpoint; the rest is Kafka's side or the effects' own tables).
# Left out of those modules: the tests of Kafka's side, whose statements the modules' other tests
# run (27 s): test_the_relay_rides_out_a_broker_outage (its reads and records after the outage
# are those of a relay resuming where it recorded), and the status command with Kafka down, with
# a broker that never answers, and --watch (the same reads as the module's other tests).
PARTITIONED_TESTS := $(addprefix tests/integration/,test_relay.py test_stage.py \
  test_storage.py test_least_privilege.py test_republish.py test_verify.py test_status.py \
  test_console.py \
  test_debezium_parity.py test_debezium_maintenance.py)
PARTITIONED_KAFKA_SIDE := \
  test_relay.py::test_the_relay_rides_out_a_broker_outage \
  test_status.py::test_with_kafka_down_everything_the_database_knows_is_shown_and_one_line_says_so \
  test_status.py::test_a_broker_that_never_answers_costs_the_status_its_kafka_budget_only \
  test_status.py::test_status_watch_refreshes_until_ctrl_c
test-partitioned: install
	$(BIN)/pytest $(XDIST) $(REPORT) --oncely-partitioned=1m --oncely-partitioned-horizon=30m \
	  $(PARTITIONED_TESTS) $(addprefix --deselect tests/integration/,$(PARTITIONED_KAFKA_SIDE))

# The declared floors hold: the unit tests run against the lowest version of every direct
# dependency that pyproject.toml allows (uv's lowest-direct resolution), in a venv of their own,
# and the documentation site builds with the lowest mkdocs and mkdocstrings. Their mypy (the
# effect typing test) keeps its cache apart: another mypy version's cache is thrown away whole,
# and make test's own run of that test would then start cold (9-17 s here instead of 0.5 s).
# Two unit tests run in make test's venv only; what they check is no dependency's:
#   test_hermetic's stack test  the suite's own environment (tests/conftest.py): it runs
#                               test_cli_errors again in a pytest process, and the floors run
#                               that module itself (28 s on the floors' venv)
#   the unreachable broker's 10 s  the bound is oncely's own REACH_SECONDS; the floor client's
#                               failure to reach a broker is the module's other unreachable
#                               broker tests', which the floors run (8 s)
FLOORS := .venv-floors
FLOORS_OWN_VENV_ONLY := \
  tests/unit/test_hermetic.py::test_a_stack_running_in_the_default_folder_changes_no_test \
  tests/unit/test_cli_errors.py::test_an_unreachable_broker_is_reported_within_10_s
test-floors: install kubernetes-tools
	$(BIN)/pip install --quiet uv
	$(BIN)/uv venv --quiet --allow-existing --python $(BIN)/python $(FLOORS)
	$(BIN)/uv pip compile --quiet --resolution lowest-direct --extra dev \
	  --python $(FLOORS)/bin/python pyproject.toml -o $(FLOORS)/floors.txt
	$(BIN)/uv pip sync --quiet --python $(FLOORS)/bin/python $(FLOORS)/floors.txt
	$(BIN)/uv pip install --quiet --no-deps --python $(FLOORS)/bin/python -e .
	MYPY_CACHE_DIR=$(FLOORS)/mypy-cache $(FLOORS)/bin/pytest -q --durations=10 tests/unit \
	  $(addprefix --deselect ,$(FLOORS_OWN_VENV_ONLY))
	$(FLOORS)/bin/mkdocs build --strict --site-dir $(FLOORS)/site

chaos: install
	$(BIN)/pytest -m "chaos or not chaos" tests/chaos

demo: install
	$(BIN)/oncely demo

clean:
	rm -rf $(VENV) $(FLOORS) .mypy_cache .ruff_cache

# The default cells of bench/registry.py (`.venv/bin/python -m bench --list` lists every cell,
# its target and estimated time; their sum is about an hour on 2 cores); BENCH_SCALE=0.05 for a
# smoke run, CELLS="R1 R-QUIET" for some cells. Writes bench/results/<date>-<time>-<cells>.json
# (with the commit measured), .md (the table) and .png, and regenerates bench/results/INDEX.md
# and the current figures of docs/performance.md.
CELLS ?=
bench: install
	$(BIN)/pip install --quiet matplotlib
	$(BIN)/python -m bench $(CELLS)

# The container image (oncely:dev, IMAGE=... for another tag), built with podman on a Debian base
# made here by debootstrap (cached in ~/.cache/oncely/images and podman's store; no registry is
# needed). Docker users: `docker build -t oncely:dev --build-arg EXTRAS=confluent .`.
IMAGE ?= oncely:dev
export CONTAINERS_CONF ?= $(CURDIR)/deploy/podman/containers.conf
CONTAINER_PACKAGES := podman runc debootstrap golang-github-containernetworking-plugin-dnsname
image: install container-tools
	$(BIN)/python -m tools.images oncely --tag $(IMAGE)

# What the container tests and `make image` need beyond make test's: podman with runc (and
# CNI's DNS plugin, for compose's service names), debootstrap, and podman-compose (PyPI).
container-tools: install
	@command -v podman >/dev/null && command -v runc >/dev/null && command -v debootstrap >/dev/null \
	  && [ -e /usr/lib/cni/dnsname ] || { \
	  echo "installing Debian's podman, runc, debootstrap and the CNI dnsname plugin"; \
	  $(APT) install -y -qq --no-install-recommends $(CONTAINER_PACKAGES) >/dev/null || \
	  { $(APT) update -qq && $(APT) install -y -qq --no-install-recommends $(CONTAINER_PACKAGES) >/dev/null; }; }
	@$(BIN)/python -c 'import podman_compose' 2>/dev/null || $(BIN)/pip install --quiet 'podman-compose>=1.3'

# The image as containers (tests/container, marker `container`): the payments pipeline against
# the devstack, docker-compose.yml's pipeline and debezium profiles with podman-compose, and the
# pytest plugin's testcontainers path on podman's Docker API. Builds the images it runs first:
# oncely's (make image) and local Kafka, PostgreSQL and Kafka Connect images, none pulled.
test-container: image
	$(BIN)/python -m tools.images kafka
	$(BIN)/python -m tools.images postgres
	$(BIN)/python -m tools.images connect
	$(BIN)/pytest $(REPORT) -m container tests/container
