"""An agent away loses nothing (contract §11): parking, release on return, retention, replay."""
