"""Test helpers shared by the integration, acceptance and chaos tests, one module a purpose;
tests import them from here.

- :mod:`~tests.helpers.cli`: the command line in this process (``oncely_cli``);
- :mod:`~tests.helpers.processes`: the command line as a process (``oncely_process``,
  ``start_oncely``);
- :mod:`~tests.helpers.outbox`: outbox rows written straight to the table;
- :mod:`~tests.helpers.database`: one value of a query, statements sent, replication, schema;
- :mod:`~tests.helpers.kafka`: topics read back, events produced, topic settings;
- :mod:`~tests.helpers.running`: a relay and consumers in this process, with quick settings;
- :mod:`~tests.helpers.probes`: waiting for a condition, a process's health and metrics.
"""

from tests.helpers.cli import CliResult, oncely_cli
from tests.helpers.database import SlotReader, StatementSpy, scalar, schema_catalog
from tests.helpers.kafka import Record, publish_events, read_topics, set_topic_config
from tests.helpers.outbox import count_published, insert_rows, outbox_row, outbox_rows
from tests.helpers.probes import http_get, metric, wait_until
from tests.helpers.processes import oncely_process, process_environment, start_oncely
from tests.helpers.running import fast_settings, running_consumers, running_relay

__all__ = [
    "CliResult",
    "Record",
    "SlotReader",
    "StatementSpy",
    "count_published",
    "fast_settings",
    "http_get",
    "insert_rows",
    "metric",
    "oncely_cli",
    "oncely_process",
    "outbox_row",
    "outbox_rows",
    "process_environment",
    "publish_events",
    "read_topics",
    "running_consumers",
    "running_relay",
    "scalar",
    "schema_catalog",
    "set_topic_config",
    "start_oncely",
    "wait_until",
]
