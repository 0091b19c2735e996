"""Scheduled jobs: the scheduler, the advisory locks, and the run records every job shares."""
