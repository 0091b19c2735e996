"""This database's installation identity, and what the broker holds that it does not know."""
