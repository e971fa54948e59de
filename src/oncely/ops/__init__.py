"""Operating oncely's processes: metrics, the health endpoint, structured logs."""
