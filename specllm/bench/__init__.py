"""The benchmark: workloads (prompt sets) and the harness that runs strategies against `off`."""
