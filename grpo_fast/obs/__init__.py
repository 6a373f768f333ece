"""Observability: metrics, health checks, memory measurement, run reports and sweeps."""
