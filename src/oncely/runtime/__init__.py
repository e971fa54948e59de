"""What every oncely process runs on: metrics, the health endpoint, failpoints, structured logs."""
