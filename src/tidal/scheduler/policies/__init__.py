"""Built-in policies; importing this package registers them by name."""

from tidal.scheduler.policies import backfill, edf, fifo, tiresias  # noqa: F401
