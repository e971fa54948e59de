"""Rows oncely adds in its caller's transaction: one timing, and one rule for a key given twice.

``stage()`` (the outbox) and ``enqueue_task()`` (the tasks) both write through a
:class:`TransactionalTable`. With a ``Session`` or a ``Connection`` the rows are inserted at
once, in the caller's current transaction or savepoint, so a key an earlier transaction used
fails right at the call; with an ``AsyncSession`` they join the unit of work and are inserted at
its next flush, so the call does no I/O. Nothing here commits: the rows become durable when the
caller commits. A key given twice in one transaction is refused at the call, whatever the
target, with :class:`DuplicateInTransactionError`.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session, registry

from oncely.errors import OncelyError
from oncely.storage.errors import translate_errors_of

Transactional = Session | AsyncSession | sa.Connection
"""What oncely writes through: the caller's session or connection, inside its transaction."""

Insert = Callable[[sa.Connection, Sequence[Mapping[str, Any]]], None]
"""How a table's rows are inserted on a connection in the caller's transaction."""


class DuplicateInTransactionError(OncelyError):
    """The same key (an event's idempotency key, a task key) was given twice in one
    transaction."""


class _Row:
    def __init__(self, **columns: Any) -> None:
        self.__dict__.update(columns)


def transaction_of(target: Transactional) -> Any:
    """The caller's current (root) transaction, or ``None`` before one has begun."""
    sync = target.sync_session if isinstance(target, AsyncSession) else target
    return sync.get_transaction()


class TransactionalTable:
    """Adds rows of ``table`` in the caller's transaction (see the module).

    ``key`` is the column unique per transaction, ``what`` names it in the error and ``hint``
    says what to do instead; ``insert`` sends rows on a connection.
    """

    def __init__(self, table: sa.Table, *, key: str, what: str, hint: str, insert: Insert) -> None:
        self.table = table
        self._key, self._what, self._hint, self._insert = key, what, hint, insert
        # An ORM mapping so that an AsyncSession can add rows without I/O; eager_defaults=False:
        # its flush sends no RETURNING of the server defaults, which nothing reads.
        self._mapped: type[_Row] = type(f"_{table.name}_row", (_Row,), {})
        registry().map_imperatively(self._mapped, table, eager_defaults=False)
        self._keys: weakref.WeakKeyDictionary[Any, set[Any]] = weakref.WeakKeyDictionary()

    def add(self, target: Transactional, rows: Sequence[Mapping[str, Any]]) -> None:
        """Add ``rows`` (column -> value) in ``target``'s transaction.

        Raises:
            DuplicateInTransactionError: a row's key was given earlier in this transaction, or
                twice in ``rows``; nothing of ``rows`` was added.
            OncelyError: a unique constraint of oncely's refused a row (a key an earlier
                transaction used: now, or at flush or commit with an ``AsyncSession``).
        """
        if not rows:
            return
        keys = [row[self._key] for row in rows]
        before = transaction_of(target)
        seen = self._keys.get(before, set()) if before is not None else set()
        if len(keys) == 1:
            repeated = [keys[0]] if keys[0] in seen else []
        else:
            repeated = sorted({k for k, n in Counter(keys).items() if n > 1 or k in seen})
        if repeated:
            raise DuplicateInTransactionError(
                f"{self._what} {repeated[0]!r} is given twice in one transaction; {self._hint}"
            )
        if isinstance(target, AsyncSession):
            translate_errors_of(target)  # an earlier transaction's key: raised at flush/commit
            target.add_all([self._mapped(**row) for row in rows])
        else:
            if isinstance(target, sa.Connection):
                connection = target
                if not connection.in_transaction():
                    connection.begin()  # what execute() would do: the caller's commit() ends it
            else:
                connection = target.connection(bind_arguments={"clause": self.table})
            self._insert(connection, rows)
        # Adding or inserting begins the transaction if none had begun: remember the keys there.
        self._keys.setdefault(transaction_of(target), set()).update(keys)
