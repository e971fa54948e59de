"""oncely's benchmarks: every figure is a ratio of two things measured side by side in one run."""
