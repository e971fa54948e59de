"""oncely: transactional outbox to Kafka to effects, with no lost events and no double effects."""

from importlib.metadata import version as _version

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
from oncely.schemas.errors import DecodeError, DecodeFailure, EncodeError
from oncely.security import KafkaAuthenticationError
from oncely.settings import StageLimits
from oncely.storage import DuplicateEventError, DuplicateTaskKeyError
from oncely.tasks import LeaseLostError, Task, Tasks, TaskWorker, enqueue_task

#: The installed distribution's version.
__version__ = _version("oncely")

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
