"""Notebook support: ``%load_ext eventsched.jupyter`` registers the magics
(``magics``); ``widgets`` is the live panel, ``handle`` the job handle."""

from __future__ import annotations

from typing import Any

__all__ = ["load_ipython_extension", "unload_ipython_extension"]


def load_ipython_extension(ipython: Any) -> None:
    from eventsched.jupyter.magics import EventschedMagics

    # an instance, with the shell as its parent: %config and ipython_config.py apply
    ipython.register_magics(EventschedMagics(shell=ipython))


def unload_ipython_extension(ipython: Any) -> None:
    from eventsched.jupyter.widgets import _watchers

    for watcher in list(_watchers.values()):
        watcher.stop()
