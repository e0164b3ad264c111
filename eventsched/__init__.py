"""eventsched: a GPU job scheduler for a shared machine, built on an event log."""

__version__ = "0.1.0"
