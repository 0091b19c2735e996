"""Reconcile: broker and database kept in agreement (SPEC 7), and the operator's queue view."""
