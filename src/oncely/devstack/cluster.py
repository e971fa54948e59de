"""A Kafka cluster on one machine: several combined broker+controller nodes, one KRaft quorum.

Every node is a :class:`~oncely.devstack.kafka.KafkaNode` on 127.0.0.1 with ports of its own,
a data folder of its own and a small heap. All nodes are voters of one *dynamic* quorum: each
storage is formatted with the same cluster id and ``--initial-controllers
1@127.0.0.1:<cport>:<directory-id>,...`` (Kafka 4's KIP-853 way, which keeps
``controller.quorum.voters`` unset and lets a node be replaced later with ``kafka-metadata-quorum
add-controller``). With three nodes the quorum survives one node down; so do the partitions
(replication factor 3, ``min.insync.replicas`` 2 by default). Two nodes down stops the quorum
too: writes then wait (time out) rather than fail with ``NOT_ENOUGH_REPLICAS``.

Nodes are named by their ``node.id``, 1 to ``size``: the id Kafka reports as a partition's
leader, so ``cluster.kill(leader)`` is the crash of that leader.
"""

from __future__ import annotations

import signal
import time
from collections import Counter
from pathlib import Path

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from oncely.devstack._process import StoppedOnExit, free_ports
from oncely.devstack.kafka import DEFAULT_KAFKA_VERSION, KafkaNode, KafkaQuorum, new_cluster_id
from oncely.errors import DevstackError


def active_controller(bootstrap_servers: str, *, timeout: float = 5.0) -> int | None:
    """The node id of the active controller the cluster reports, or ``None`` if none answers."""
    admin = AdminClient({"bootstrap.servers": bootstrap_servers, "log_level": 0})
    try:
        future = admin.describe_cluster(
            include_authorized_operations=False, request_timeout=timeout
        )
        controller = future.result(timeout + 1).controller
    except (KafkaException, TimeoutError):
        return None
    return int(controller.id) if controller is not None else None


class KafkaCluster(StoppedOnExit):
    """``size`` combined broker+controller nodes forming one cluster under ``data_dir``.

    ``replication_factor`` (default ``min(3, size)``) is the brokers' ``default.replication
    .factor`` and the internal topics' (consumer offsets, transactions);
    ``min_insync_replicas`` (default one less, at least 1) is the brokers' default
    ``min.insync.replicas``. ``start()`` returns once every broker is registered and a
    controller is active. Raises :class:`DevstackError` for an impossible layout or a failed
    start. Usable as a context manager.
    """

    def __init__(
        self,
        *,
        data_dir: Path,
        size: int = 3,
        version: str = DEFAULT_KAFKA_VERSION,
        heap: str = "384m",
        replication_factor: int | None = None,
        min_insync_replicas: int | None = None,
    ) -> None:
        replicas = replication_factor or min(3, size)
        min_isr = min_insync_replicas or max(1, replicas - 1)
        if not 1 <= replicas <= size or not 1 <= min_isr <= replicas:
            raise DevstackError(
                f"a {size}-node cluster cannot have replication factor {replicas} and "
                f"min.insync.replicas {min_isr} (need 1 <= min.insync.replicas <= "
                "replication factor <= nodes)"
            )
        self.data_dir = data_dir
        ports = free_ports(2 * size)
        ids = range(1, size + 1)
        controllers = {i: ports[size + i - 1] for i in ids}
        directories = {i: new_cluster_id() for i in ids}  # a directory id is a Kafka Uuid too
        self.quorum = KafkaQuorum(
            cluster_id=new_cluster_id(),
            bootstrap_servers=",".join(f"127.0.0.1:{controllers[i]}" for i in ids),
            initial_controllers=",".join(
                f"{i}@127.0.0.1:{controllers[i]}:{directories[i]}" for i in ids
            ),
            replication_factor=replicas,
            min_insync_replicas=min_isr,
        )
        self._nodes = {
            i: KafkaNode(
                data_dir=data_dir / f"node-{i}",
                version=version,
                port=ports[i - 1],
                controller_port=controllers[i],
                heap=heap,
                node_id=i,
                quorum=self.quorum,
            )
            for i in ids
        }

    @property
    def node_ids(self) -> list[int]:
        return list(self._nodes)

    @property
    def bootstrap_servers(self) -> str:
        """Every node's PLAINTEXT listener, comma-separated (clients need only one to answer)."""
        return ",".join(node.bootstrap_servers for node in self._nodes.values())

    def node(self, node_id: int) -> KafkaNode:
        """The node whose ``node.id`` is ``node_id`` (1 to ``size``)."""
        try:
            return self._nodes[node_id]
        except KeyError:
            raise DevstackError(
                f"no node {node_id}: node ids are {', '.join(map(str, self._nodes))}"
            ) from None

    def start(self, *, timeout: float = 120.0) -> None:
        """Start every node, then wait until all brokers are registered and a controller leads.

        On failure every node is stopped and :class:`DevstackError` is raised.
        """
        deadline = time.monotonic() + timeout
        try:
            # A node cannot answer before a majority of the voters runs: launch all, then wait.
            # (Launched from this thread: a child's parent-death signal fires when the thread
            # that started it ends, so no worker threads here.)
            for node in self._nodes.values():
                node.start(wait=False)
            for node in self._nodes.values():
                node.wait_ready(timeout=max(1.0, deadline - time.monotonic()))
            self.wait_healthy(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.stop()
            raise

    def wait_healthy(self, *, timeout: float = 60.0) -> None:
        """Wait until the metadata lists every node as a broker and a controller is active."""
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0})
        deadline = time.monotonic() + timeout
        while True:
            try:
                brokers = len(admin.list_topics(timeout=2).brokers)
            except KafkaException:
                brokers = 0
            if brokers == len(self._nodes) and active_controller(self.bootstrap_servers):
                return
            if time.monotonic() > deadline:
                raise DevstackError(
                    f"the Kafka cluster did not become healthy within {timeout:.0f} s "
                    f"({brokers} of {len(self._nodes)} brokers registered); logs: "
                    + ", ".join(str(node.log_file) for node in self._nodes.values())
                )
            time.sleep(0.3)

    def stop(self, *, timeout: float = 30.0) -> None:
        """Stop every node (resumed first if paused); idempotent.

        All nodes get SIGTERM at once, so none waits for a controller that already left.
        """
        for node in self._nodes.values():
            node.send_signal(signal.SIGCONT)
            node.send_signal(signal.SIGTERM)
        for node in self._nodes.values():
            node.stop(timeout=timeout)

    def kill(self, node_id: int) -> None:
        """SIGKILL one node (broker and controller crash together); :meth:`restart` revives it."""
        self.node(node_id).kill()

    def restart(self, node_id: int, *, timeout: float = 90.0) -> None:
        """Stop the node if it runs (SIGTERM), start it again on its data and wait for it."""
        node = self.node(node_id)
        node.send_signal(signal.SIGCONT)
        node.stop()
        node.start(timeout=timeout)

    def pause(self, node_id: int) -> None:
        """SIGSTOP one node: it holds its sockets open but answers nothing (a hung machine)."""
        self.node(node_id).send_signal(signal.SIGSTOP)

    def resume(self, node_id: int) -> None:
        """SIGCONT a paused node."""
        self.node(node_id).send_signal(signal.SIGCONT)

    def partition_leaders(self, topic: str, *, timeout: float = 10.0) -> Counter[int]:
        """How many partitions of ``topic`` each node leads (node id -> count)."""
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0})
        metadata = admin.list_topics(topic, timeout=timeout)
        partitions = metadata.topics[topic].partitions.values()
        return Counter(p.leader for p in partitions if p.leader >= 0)

    def wait_in_sync(self, topic: str, *, timeout: float = 60.0) -> float:
        """Wait until every partition of ``topic`` has all its replicas in sync; return seconds.

        Raises :class:`DevstackError` after ``timeout`` seconds.
        """
        admin = AdminClient({"bootstrap.servers": self.bootstrap_servers, "log_level": 0})
        started = time.monotonic()
        while True:
            try:
                partitions = admin.list_topics(topic, timeout=5).topics[topic].partitions
                if partitions and all(
                    sorted(p.isrs) == sorted(p.replicas) for p in partitions.values()
                ):
                    return time.monotonic() - started
            except KafkaException:
                pass
            if time.monotonic() - started > timeout:
                raise DevstackError(f"{topic} not fully in sync within {timeout:.0f} s")
            time.sleep(0.3)

    def __enter__(self) -> KafkaCluster:
        self.start()
        return self
