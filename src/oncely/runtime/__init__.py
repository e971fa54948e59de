"""What every oncely process runs on: the process shell, metrics, the health endpoint, logs."""
