"""oncely's tables, migrations and named SQL statements (PostgreSQL).

Run ``oncely db upgrade``, or apply the same migrations from your Alembic revisions
(:mod:`oncely.alembic`).
"""

from oncely.storage.errors import (
    DuplicateEventError,
    DuplicateTaskKeyError,
    translate,
    translate_errors_of,
)
from oncely.storage.migrations import Migration, migrations, upgrade, upgrade_sql
from oncely.storage.queries import query
from oncely.storage.tables import (
    build_metadata,
    idempotency_keys,
    metadata,
    outbox,
    receipts,
    tasks,
    validate_schema_name,
)

__all__ = [
    "DuplicateEventError",
    "DuplicateTaskKeyError",
    "Migration",
    "build_metadata",
    "idempotency_keys",
    "metadata",
    "migrations",
    "outbox",
    "query",
    "receipts",
    "tasks",
    "translate",
    "translate_errors_of",
    "upgrade",
    "upgrade_sql",
    "validate_schema_name",
]
