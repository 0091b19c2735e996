"""Dead letters: per-vhost counts, redrive to the original queue, given-up records (contract §7)."""
