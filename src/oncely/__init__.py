"""oncely: transactional outbox to Kafka to effects, with no lost events and no double effects.

The names below are imported on first use, so ``import oncely`` (and the ``oncely`` command)
starts without loading every part of the package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    __version__: str
    from oncely.app import App, AppError
    from oncely.consumers.effects import (
        AsyncEffectContext,
        EffectContext,
        EffectDeclarationError,
        Effects,
        FailurePolicy,
    )
    from oncely.consumers.writes import WriteError
    from oncely.errors import ConfigurationError, OncelyError
    from oncely.events import EventType, Registry, RegistryError, UnknownEventTypeError
    from oncely.producer import (
        AsyncIdempotencyKeys,
        Claim,
        ClaimLostError,
        DuplicateInTransactionError,
        IdempotencyBusyError,
        IdempotencyError,
        IdempotencyKeys,
        IdempotencyMismatchError,
        InvalidIdempotencyKeyError,
        StagedEvent,
        stage,
        stage_many,
    )
    from oncely.producer.commands import (
        AsyncDurableCommand,
        DurableCommand,
        PostCommitResult,
        PostCommitTask,
        PostCommitTaskError,
    )
    from oncely.producer.staging import (
        HeadersTooLargeError,
        KeyTooLongError,
        PayloadTooLargeError,
        StageLimitError,
    )
    from oncely.schemas.catalog import SchemaCatalog
    from oncely.schemas.codec import Codec
    from oncely.schemas.compatibility import CompatibilityMode
    from oncely.schemas.errors import (
        DecodeError,
        DecodeFailure,
        EncodeError,
        SchemaIdNotLoadedError,
        SchemaNotRegisteredError,
    )
    from oncely.security import KafkaAuthenticationError
    from oncely.settings import StageLimits
    from oncely.storage import DuplicateEventError, DuplicateTaskKeyError
    from oncely.tasks import LeaseLostError, Task, Tasks, TaskWorker, enqueue_task

#: Each public name -> the module that defines it.
_EXPORTS = {
    "App": "oncely.app",
    "AppError": "oncely.app",
    "AsyncDurableCommand": "oncely.producer.commands",
    "AsyncEffectContext": "oncely.consumers.effects",
    "AsyncIdempotencyKeys": "oncely.producer",
    "Claim": "oncely.producer",
    "ClaimLostError": "oncely.producer",
    "Codec": "oncely.schemas.codec",
    "CompatibilityMode": "oncely.schemas.compatibility",
    "ConfigurationError": "oncely.errors",
    "DecodeError": "oncely.schemas.errors",
    "DecodeFailure": "oncely.schemas.errors",
    "DuplicateEventError": "oncely.storage",
    "DuplicateInTransactionError": "oncely.producer",
    "DuplicateTaskKeyError": "oncely.storage",
    "DurableCommand": "oncely.producer.commands",
    "EffectContext": "oncely.consumers.effects",
    "EffectDeclarationError": "oncely.consumers.effects",
    "Effects": "oncely.consumers.effects",
    "EncodeError": "oncely.schemas.errors",
    "enqueue_task": "oncely.tasks",
    "EventType": "oncely.events",
    "FailurePolicy": "oncely.consumers.effects",
    "HeadersTooLargeError": "oncely.producer.staging",
    "IdempotencyBusyError": "oncely.producer",
    "IdempotencyError": "oncely.producer",
    "IdempotencyKeys": "oncely.producer",
    "IdempotencyMismatchError": "oncely.producer",
    "InvalidIdempotencyKeyError": "oncely.producer",
    "KafkaAuthenticationError": "oncely.security",
    "KeyTooLongError": "oncely.producer.staging",
    "LeaseLostError": "oncely.tasks",
    "OncelyError": "oncely.errors",
    "PayloadTooLargeError": "oncely.producer.staging",
    "PostCommitResult": "oncely.producer.commands",
    "PostCommitTask": "oncely.producer.commands",
    "PostCommitTaskError": "oncely.producer.commands",
    "Registry": "oncely.events",
    "RegistryError": "oncely.events",
    "SchemaCatalog": "oncely.schemas.catalog",
    "SchemaIdNotLoadedError": "oncely.schemas.errors",
    "SchemaNotRegisteredError": "oncely.schemas.errors",
    "stage": "oncely.producer",
    "stage_many": "oncely.producer",
    "StagedEvent": "oncely.producer",
    "StageLimitError": "oncely.producer.staging",
    "StageLimits": "oncely.settings",
    "Task": "oncely.tasks",
    "Tasks": "oncely.tasks",
    "TaskWorker": "oncely.tasks",
    "UnknownEventTypeError": "oncely.events",
    "WriteError": "oncely.consumers.writes",
}


def __getattr__(name: str) -> Any:
    if name == "__version__":  # the installed distribution's version
        from importlib.metadata import version

        value: Any = version("oncely")
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'oncely' has no attribute {name!r}")
    globals()[name] = value
    return value


__all__ = [
    "App",
    "AppError",
    "AsyncDurableCommand",
    "AsyncEffectContext",
    "AsyncIdempotencyKeys",
    "Claim",
    "ClaimLostError",
    "Codec",
    "CompatibilityMode",
    "ConfigurationError",
    "DecodeError",
    "DecodeFailure",
    "DuplicateEventError",
    "DuplicateInTransactionError",
    "DuplicateTaskKeyError",
    "DurableCommand",
    "EffectContext",
    "EffectDeclarationError",
    "Effects",
    "EncodeError",
    "EventType",
    "FailurePolicy",
    "HeadersTooLargeError",
    "IdempotencyBusyError",
    "IdempotencyError",
    "IdempotencyKeys",
    "IdempotencyMismatchError",
    "InvalidIdempotencyKeyError",
    "KafkaAuthenticationError",
    "KeyTooLongError",
    "LeaseLostError",
    "OncelyError",
    "PayloadTooLargeError",
    "PostCommitResult",
    "PostCommitTask",
    "PostCommitTaskError",
    "Registry",
    "RegistryError",
    "SchemaCatalog",
    "SchemaIdNotLoadedError",
    "SchemaNotRegisteredError",
    "StageLimitError",
    "StageLimits",
    "StagedEvent",
    "Task",
    "TaskWorker",
    "Tasks",
    "UnknownEventTypeError",
    "WriteError",
    "__version__",
    "enqueue_task",
    "stage",
    "stage_many",
]
