"""Webhook consumers (contract §13): where a webhook may point, how a copy is signed and
delivered, and the consumers' registration."""
