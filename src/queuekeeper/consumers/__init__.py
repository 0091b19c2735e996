"""Unified event consumers (contract §9): one queue per agent identity or integration."""
