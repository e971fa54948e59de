"""What every oncely process runs on: the process shell (:mod:`.process`), its HTTP port for
metrics and health (:mod:`.http`, :mod:`.metrics`) and the container health check
(:mod:`.healthcheck`), logs (:mod:`.logs`), spans (:mod:`.tracing`), the one backoff
(:mod:`.retry`), the sync and async step drivers (:mod:`.steps`), ``LISTEN`` wake-ups
(:mod:`.wakeup`) and whether Kafka is reached (:mod:`.reach`)."""
