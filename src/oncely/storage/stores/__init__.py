"""One store per table: every statement on a table goes through its store, which returns typed
rows (dataclasses). :mod:`.outbox` holds the outbox and the relay's tables beside it,
:mod:`.receipts` the effects' receipts, :mod:`.dead_lettered` the records effects dead-lettered;
the tasks' store is :mod:`oncely.tasks.store` and the idempotency keys'
:mod:`oncely.producer.idempotency`, beside the rules they apply.
"""
