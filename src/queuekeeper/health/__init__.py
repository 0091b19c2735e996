"""Liveness (`/healthz`) and readiness (`/readyz`)."""
