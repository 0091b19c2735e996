"""Reconcile: broker and database kept in agreement (contract §7), and the operator's queue view."""
