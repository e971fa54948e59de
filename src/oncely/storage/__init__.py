"""oncely's tables, migrations and named SQL statements (PostgreSQL).

Import :data:`metadata` into your Alembic environment, or run ``oncely db upgrade``.
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
