"""The ``fcfs`` scheduler: first come, first served."""

from __future__ import annotations

from lmkit.api import PagedScheduler


class FCFSScheduler(PagedScheduler):
    """First come, first served (the default scheduler).

    Admits waiting requests in arrival order, a preempted request ahead of all others;
    when the KV pool runs out, preempts the running request that arrived last. Nothing
    starves: the earliest running request is never the victim while another runs, and
    a preempted request is the next admitted. This is :class:`PagedScheduler`'s
    default policy, named here so that it is selectable as a plugin.
    """
