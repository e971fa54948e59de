"""Every benchmark cell: its id, a readable slug, what it measures, its figures' targets, its
estimated time, and the group that runs it.

The ids (R1, R-QUIET, S-MANY, ...) are those docs/performance.md and earlier result files use;
``python -m bench`` accepts an id or a slug, in any case. A cell's *figures* are the lines it
writes to the result (R-QUIET writes "R-QUIET p50" and "R-QUIET p99"), each with its target.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from bench import runners
from bench.runners import OwnRunner, SharedRunner


@dataclass(frozen=True)
class Spec:
    """One cell of the registry."""

    id: str
    slug: str
    #: What the cell measures, in one sentence.
    measures: str
    #: The cell's figures (result lines) and each one's target ("reported" or "(context)": none).
    figures: Mapping[str, str]
    #: Estimated minutes at BENCH_SCALE=1 on 2 cores, of the group's run (cells of one group
    #: run together: asking for one of them costs the group's time).
    minutes: float
    #: The function that runs this cell's group.
    run: SharedRunner | OwnRunner
    #: Whether ``python -m bench`` with no cells (``make bench``) runs it.
    default: bool = True
    #: The group starts its own services (no devstack needed).
    own_services: bool = False

    @property
    def target(self) -> str:
        """The figures' targets in one line (the target alone when there is one figure)."""
        if len(self.figures) == 1:
            return next(iter(self.figures.values()))
        return "; ".join(
            f"{name.removeprefix(self.id).strip() or name} {t}" for name, t in self.figures.items()
        )


REGISTRY: tuple[Spec, ...] = (
    Spec(
        "R-DBZ",
        "relay-vs-debezium-drain",
        "Drain rate over 1,000 keys, the relay / Debezium's Outbox Event Router in Kafka Connect.",
        {"R-DBZ": ">= 1.5"},
        10,
        runners.debezium,
    ),
    Spec(
        "R-DBZ-HOT",
        "relay-vs-debezium-hot-key",
        "The same drain with every row on one key.",
        {"R-DBZ-HOT": ">= 1.5"},
        10,
        runners.debezium,
    ),
    Spec(
        "R-DBZ-p99",
        "relay-vs-debezium-p99",
        "Commit-to-Kafka p99 at 50% of the slower drain rate, the relay / Debezium.",
        {"R-DBZ p99": "<= 1.0"},
        10,
        runners.debezium,
    ),
    Spec(
        "R1",
        "relay-vs-raw-producer",
        "Drain rate, the relay / a raw producer sending a page and waiting for it.",
        {"R1": ">= 0.5"},
        3,
        runners.relay,
    ),
    Spec(
        "R2",
        "relay-vs-own-sql",
        "Drain rate, the relay / its own read and progress SQL alone.",
        {"R2": ">= 0.9"},
        3,
        runners.relay,
    ),
    Spec(
        "R2-xmin",
        "relay-long-transaction",
        "Drain rate with a REPEATABLE READ transaction held open / without.",
        {"R2-xmin": ">= 0.8"},
        3,
        runners.relay,
    ),
    Spec(
        "R-HOT",
        "relay-one-key",
        "Drain rate on one key / over 1,000 keys.",
        {"R-HOT": ">= 0.8"},
        3,
        runners.relay,
    ),
    Spec(
        "R7",
        "two-relays",
        "Drain rate of two relay processes / one.",
        {"R7": ">= 1.0"},
        3,
        runners.relay,
    ),
    Spec(
        "R5",
        "stage-in-transaction",
        "A business transaction's rate with stage() / without (one statement, five, 8 writers).",
        {
            "R5 one statement": ">= 0.8",
            "R5 five statements": ">= 0.9",
            "R5 8 writers": ">= 0.85",
            "R5 NOTIFY (context)": "(context: why staging notifies only a sleeping relay)",
        },
        2,
        runners.staging,
    ),
    Spec(
        "S-CPU",
        "stage-client-cpu",
        "Client CPU per event, stage() / a raw psycopg INSERT of the same row.",
        {"S-CPU": "<= 1.5"},
        1,
        runners.staging_client,
    ),
    Spec(
        "S-MANY",
        "stage-many",
        "Events/s, stage_many() of 100 events / one raw 100-row INSERT.",
        {"S-MANY": ">= 0.8"},
        1,
        runners.staging_client,
    ),
    Spec(
        "R-QUIET",
        "quiet-commit-to-kafka",
        "Commit-to-Kafka p50 and p99 at 200 events/s, the relay / a raw producer after each "
        "commit.",
        {"R-QUIET p50": "<= 1.2", "R-QUIET p99": "<= 1.5"},
        4,
        runners.quiet,
    ),
    Spec(
        "R-EOS",
        "eos-drain",
        "Drain rate to records visible to a read_committed consumer, exactly once / at least once.",
        {"R-EOS": ">= 0.85"},
        11,
        runners.exactly_once,
    ),
    Spec(
        "R-EOS-QUIET",
        "eos-quiet-latency",
        "Commit to visible p50 and p99 at 200 events/s, exactly once / at least once.",
        {"R-EOS-QUIET p50": "reported", "R-EOS-QUIET": "<= 2.0"},
        11,
        runners.exactly_once,
    ),
    Spec(
        "R-EOS-RECOVER",
        "eos-recovery",
        "Seconds from a SIGKILL mid-drain to a new relay process's first visible record.",
        {"R-EOS-RECOVER": "reported"},
        11,
        runners.exactly_once,
    ),
    Spec(
        "R-EOS-OPEN",
        "eos-open-transactions",
        "A plain producer's append-to-visible p50 and p99 while an exactly-once relay drains.",
        {"R-EOS-OPEN p50": "reported", "R-EOS-OPEN p99": "reported"},
        11,
        runners.exactly_once,
    ),
    Spec(
        "R-QUIET-CPU",
        "quiet-cpu-vs-debezium",
        "CPU per event at 200 events/s above idle, relay + PostgreSQL / Debezium + PostgreSQL.",
        {"R-QUIET-CPU": "<= 1.5"},
        6,
        runners.quiet_cpu,
    ),
    Spec(
        "R-IDLE",
        "idle-relay",
        "An idle relay's cores (relay + PostgreSQL) and statements per second, nothing staged.",
        {"R-IDLE cores": "<= 0.01", "R-IDLE queries": "<= 1"},
        4,
        runners.idle_relay,
    ),
    Spec(
        "R-CIDLE",
        "idle-consumer",
        "An idle consumer process's cores, assigned and caught up.",
        {"R-CIDLE": "<= 0.01"},
        4,
        runners.idle_consumer,
    ),
    Spec(
        "R3",
        "consumer-vs-raw",
        "Records/s, the consumer with receipts / a raw consumer with an empty transaction a batch.",
        {"R3": ">= 0.3"},
        2,
        runners.consumer,
    ),
    Spec(
        "R3-fair",
        "consumer-vs-psycopg",
        "Records/s, the consumer / one writing the same rows with plain psycopg.",
        {"R3-fair": ">= 0.9"},
        2,
        runners.consumer,
    ),
    Spec(
        "R3-dup",
        "consumer-replay",
        "Records/s, a replay of applied records / their first application.",
        {"R3-dup": ">= 3"},
        2,
        runners.consumer,
    ),
    Spec(
        "R-LANES",
        "consumer-lanes",
        "Records/s of a handler waiting 2 ms per record, 8 lanes / 1.",
        {"R-LANES": ">= 6"},
        1.5,
        runners.lanes,
    ),
    Spec(
        "R4",
        "commit-to-effect",
        "Commit-to-effect p99 (absolute ms) at 50% of the pipeline's drain rate.",
        {"R4": "< 40", "R4 raw Kafka": "(context)"},
        5,
        runners.commit_to_effect,
    ),
    Spec(
        "R4-quiet",
        "commit-to-effect-quiet",
        "Commit-to-effect p99 (absolute ms) at 10% of the pipeline's drain rate.",
        {"R4-quiet": "< 15"},
        5,
        runners.commit_to_effect,
    ),
    Spec(
        "R-RSS",
        "consumer-rss",
        "A consumer process's RSS while it applies a 1,000,000-record backlog.",
        {"R-RSS": "reported, flat"},
        1.5,
        runners.rss,
    ),
    Spec(
        "R-START",
        "start-up",
        "oncely --help and relay run --help / their imports alone; a relay's spawn to its first "
        "record.",
        {
            "R-START help": "<= 1.5",
            "R-START relay help": "<= 1.5",
            "R-START first record": "<= 1.0",
        },
        1,
        runners.start_up,
    ),
    Spec(
        "R-RETAIN",
        "retention-soak",
        "A soak with retention on, partitioned by minute / unpartitioned, then drain and R5.",
        {
            "R-RETAIN soak": "flat, n_dead_tup near 0",
            "R-RETAIN drain": ">= 0.95",
            "R-RETAIN R5 one statement": ">= 0.95",
            "R-RETAIN R5 8 writers": ">= 0.95",
        },
        12,
        runners.retention,
    ),
    Spec(
        "R-MISSING-TOPIC",
        "missing-topic",
        "Commit-to-Kafka of a topic that exists while another topic's rows wait for their topic.",
        {"R-MISSING-TOPIC p99": "reported"},
        2,
        runners.missing,
        default=False,
    ),
    Spec(
        "R-CLUSTER",
        "cluster-scaling",
        "On a 3-broker cluster, 3 consumers / 1 and 2 relays / 1.",
        {
            "R-CLUSTER consumers": "(context: bounded by cores)",
            "R-CLUSTER relays": "(context: bounded by cores)",
        },
        6,
        runners.cluster,
        default=False,
        own_services=True,
    ),
    Spec(
        "R-COMPLETENESS",
        "completeness-check",
        "Wall time of one completeness check over a 10,000,000-row outbox window.",
        {"R-COMPLETENESS": "reported"},
        4,
        runners.completeness_check,
        default=False,
        own_services=True,
    ),
)

DEFAULT: tuple[Spec, ...] = tuple(spec for spec in REGISTRY if spec.default)


class UnknownCellError(ValueError):
    """No cell has this id or slug."""


def resolve(names: Iterable[str]) -> list[Spec]:
    """The cells named by id or slug (any case; "R-DBZ p99" for R-DBZ-p99), in registry order.

    Raises :class:`UnknownCellError` naming every name that matches no cell.
    """
    known = {key.lower(): spec for spec in REGISTRY for key in (spec.id, spec.slug)}
    wanted = [known.get(name.lower().replace(" ", "-")) for name in names]
    unknown = [name for name, spec in zip(names, wanted, strict=True) if spec is None]
    if unknown:
        raise UnknownCellError(f"unknown cells: {', '.join(unknown)} (python -m bench --list)")
    return [spec for spec in REGISTRY if spec in wanted]


def owner(figure: str) -> Spec | None:
    """The cell that writes a result line of this name, or of a figure it extends with a
    suffix ("R-MISSING-TOPIC p99 (before)"); None: no cell writes it any more."""
    exact = next((spec for spec in REGISTRY if figure in spec.figures), None)
    return exact or next(
        (s for s in REGISTRY for name in s.figures if figure.startswith(f"{name} ")), None
    )


def listing() -> str:
    """``python -m bench --list``: every cell with its slug, time, targets and what it measures."""
    lines = []
    for spec in REGISTRY:
        extra = "" if spec.default else "  [not in the default run]"
        lines.append(f"{spec.id:<16}{spec.slug:<27}~{spec.minutes:g} min{extra}")
        lines.append(f"{'':16}{spec.measures}")
        lines.append(f"{'':16}target: {spec.target}")
    groups: dict[object, list[str]] = {}
    for spec in REGISTRY:
        groups.setdefault(spec.run, []).append(spec.id)
    shared = [" ".join(ids) for ids in groups.values() if len(ids) > 1]
    lines.append("")
    lines.append("Run together (one measurement, one time): " + "; ".join(shared) + ".")
    lines.append(
        f"Default run (make bench): {len(DEFAULT)} cells, about "
        f"{sum({spec.run: spec.minutes for spec in DEFAULT}.values()):g} min at BENCH_SCALE=1."
    )
    return "\n".join(lines)
