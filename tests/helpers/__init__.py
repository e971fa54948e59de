"""Test helpers shared by the integration, acceptance and chaos tests, one module a purpose;
tests import them from here.

- :mod:`~tests.helpers.cli`: the command line in this process (``oncely_cli``);
- :mod:`~tests.helpers.processes`: the command line as a process (``oncely_process``,
  ``start_oncely``), any command run with its output captured (``run_captured``);
- :mod:`~tests.helpers.outbox`: outbox rows written straight to the table, what a relay records
  of them;
- :mod:`~tests.helpers.database`: a statement run, one value, row or all rows of a query,
  statements sent, replication, schema;
- :mod:`~tests.helpers.kafka`: topics read back, events produced, topics created and deleted,
  topic settings;
- :mod:`~tests.helpers.running`: a relay and consumers in this process, with quick settings, a
  relay run until rows are published;
- :mod:`~tests.helpers.partitions`: the tables converted to minute partitions, the last ones
  created;
- :mod:`~tests.helpers.probes`: waiting for a condition, a process's health and metrics;
- :mod:`~tests.helpers.status`: what ``oncely status`` reports, as a test expects it.
"""

from tests.helpers.cli import CliResult, oncely_cli
from tests.helpers.database import (
    SlotReader,
    StatementSpy,
    execute,
    query_all,
    query_one,
    scalar,
    schema_catalog,
)
from tests.helpers.kafka import (
    Record,
    create_topic,
    delete_existing,
    delete_topics,
    publish_events,
    read_committed,
    read_topics,
    set_topic_config,
    wait_listed,
)
from tests.helpers.outbox import (
    acknowledge_all,
    count_published,
    insert_rows,
    outbox_row,
    outbox_rows,
    park,
    staged_rows,
    uuid7_at,
)
from tests.helpers.partitions import partitioned_by_minute
from tests.helpers.probes import http_get, metric, wait_ready, wait_until
from tests.helpers.processes import (
    oncely_process,
    process_environment,
    run_captured,
    start_oncely,
)
from tests.helpers.running import (
    fast_settings,
    publish_all,
    running_consumers,
    running_relay,
    signals_of,
)
from tests.helpers.status import effect_status

__all__ = [
    "CliResult",
    "Record",
    "SlotReader",
    "StatementSpy",
    "acknowledge_all",
    "count_published",
    "create_topic",
    "delete_existing",
    "delete_topics",
    "effect_status",
    "execute",
    "fast_settings",
    "http_get",
    "insert_rows",
    "metric",
    "oncely_cli",
    "oncely_process",
    "outbox_row",
    "outbox_rows",
    "park",
    "partitioned_by_minute",
    "process_environment",
    "publish_all",
    "publish_events",
    "query_all",
    "query_one",
    "read_committed",
    "read_topics",
    "run_captured",
    "running_consumers",
    "running_relay",
    "scalar",
    "schema_catalog",
    "set_topic_config",
    "signals_of",
    "staged_rows",
    "start_oncely",
    "uuid7_at",
    "wait_listed",
    "wait_ready",
    "wait_until",
]
