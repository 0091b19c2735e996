"""Unified event consumers (SPEC 9): one queue per agent identity or integration."""
