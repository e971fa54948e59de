"""S7: latency, connection resets and a blackhole between the processes and the broker.

A broker of the test's own advertises a second listener at the address of a TCP proxy
(tests/chaos/proxy.py), so the relay and the consumer reach it only through the proxy, the
metadata's broker address included, while the ledger checker reads the broker directly. Events
are written at a steady pace while the proxy cycles through its faults; after each fault the
test waits until every event committed so far was applied: that wait is the fault's recovery
time, and the worst one is reported as ``recovery``. Then the ledger checker proves 0 lost,
0 duplicate effects and per-key order.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic

from oncely.devstack import KafkaNode
from tests.apps.ledger import build, create_tables
from tests.chaos.harness import Pipeline, pipeline, unique_prefix
from tests.chaos.ledger import check
from tests.chaos.proxy import FaultyProxy

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(600)]

#: Longer than the consumer's session timeout (6 s) and the relay's delivery timeout (5 s).
BLACKHOLE_SECONDS = 8.0
CYCLES = 2


def _create_topic(bootstrap: str, topic: str) -> None:
    # A local client: one kept alive in a failed test's traceback would log for ever.
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=3)])[topic].result(30)


def _caught_up(chaos: Pipeline, timeout: float = 180) -> float:
    """Seconds until every event committed so far has its effect."""
    return chaos.wait_applied(chaos.staged(), timeout=timeout)


def _peer_ports(pid: int) -> set[int]:
    """Remote ports of the process's established IPv4 TCP connections (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            target = str(fd.readlink())
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    ports = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "01" and fields[9] in inodes:  # 01: ESTABLISHED
            ports.add(int(fields[2].rsplit(":", 1)[1], 16))
    return ports


def _faults(proxy: FaultyProxy) -> list[tuple[str, Callable[[], None]]]:
    def latency() -> None:
        proxy.add_latency(0.3, jitter=0.2)
        time.sleep(8)
        proxy.heal()

    def resets() -> None:
        for _ in range(3):
            proxy.reset(refuse_seconds=1.0)
            time.sleep(2)
        proxy.heal()

    def blackhole() -> None:
        proxy.blackhole()
        time.sleep(BLACKHOLE_SECONDS)
        proxy.heal()  # connections that lost bytes are reset

    def half_open() -> None:
        proxy.blackhole()
        time.sleep(BLACKHOLE_SECONDS)
        proxy.heal(keep_broken=True)  # only the clients' own timeouts end them

    cycle = [("latency", latency), ("resets", resets), ("blackhole", blackhole)]
    # The half-open connections last until the consumer's fetch times out (librdkafka's
    # socket.timeout.ms, 60 s): once is enough.
    return cycle * CYCLES + [("half_open", half_open)]


def test_s7_latency_resets_and_a_blackhole_between_processes_and_broker(
    database_url: str, tmp_path: Path
) -> None:
    proxy = FaultyProxy()
    broker = KafkaNode(data_dir=tmp_path / "kafka", proxied_by=proxy.address)
    engine = sa.create_engine(database_url, pool_size=5)
    try:
        broker.start()
        assert broker.proxied_listener is not None
        proxy.start(upstream=broker.proxied_listener)
        create_tables(engine)
        prefix = unique_prefix()
        app = build(prefix, group_prefix=prefix)
        _create_topic(broker.bootstrap_servers, app.topic)
        with pipeline(engine, database_url, broker.bootstrap_servers, app, tmp_path) as chaos:
            through_proxy = {"ONCELY_KAFKA_BOOTSTRAP_SERVERS": proxy.address}
            relay = chaos.relay().start(**through_proxy)
            consumer = chaos.consumer().start(**through_proxy)
            stop = threading.Event()
            writer = chaos.write_until(stop)
            recoveries: dict[str, list[float]] = {}
            try:
                chaos.wait_applied(50)  # both processes run and reach the broker
                direct, proxied = (
                    int(address.rsplit(":", 1)[1])
                    for address in (broker.bootstrap_servers, proxy.address)
                )
                for proc in (relay, consumer):
                    assert proc.proc is not None
                    peers = _peer_ports(proc.proc.pid)
                    assert proxied in peers and direct not in peers, (proc.log.name, peers)
                for name, fault in _faults(proxy):
                    fault()
                    recoveries.setdefault(name, []).append(_caught_up(chaos))
            finally:
                stop.set()
                writer.join(60)
            _caught_up(chaos, timeout=300)
            recovery = max(max(times) for times in recoveries.values())
            assert relay.alive() and consumer.alive(), chaos.logs()
            relay_mb, consumer_mb = relay.peak_rss_mb(), consumer.peak_rss_mb()
            report = check(engine, broker.bootstrap_servers, topics=[app.topic], effects=["ledger"])
            per_fault = " ".join(
                f"{name}_recovery={'/'.join(f'{s:.1f}' for s in times)}s"
                for name, times in recoveries.items()
            )
            print(
                f"S7 events={report.committed} recovery={recovery:.1f}s {per_fault} "
                f"relay_peak_rss_mb={relay_mb:.0f} consumer_peak_rss_mb={consumer_mb:.0f} "
                f"{proxy.stats.summary()} {report.summary()}"
            )
            assert proxy.stats.resets > 0 and proxy.stats.dropped_bytes > 0, proxy.stats
            assert report.ok, f"{report.summary()}\n{chaos.logs()}"
    finally:
        proxy.close()
        broker.stop()
        engine.dispose()
