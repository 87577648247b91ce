"""Naming the plugin behind a fault at run time.

When a plugin object the engine calls every step (a scheduler, a proposer, a grammar, a
logits processor) raises or returns something its contract forbids, the error a user
sees must say which plugin it was and what it did, not only the exception that surfaced
somewhere inside lmkit. :func:`plugin_label` names the plugin as the registry knows it;
:func:`raised_in` turns an exception the plugin raised into one line that says where in
the plugin's code it came from.
"""

from __future__ import annotations

import os
import traceback
from typing import TYPE_CHECKING

from lmkit.plugin_host.kinds import kind_label

if TYPE_CHECKING:
    from types import FrameType

    from lmkit.plugin_host.registry import Registration

# lmkit's own code: frames here are the engine calling the plugin, not the plugin
_CORE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


class BrokenContract(Exception):
    """Raised by lmkit itself when a plugin's answer breaks its contract (a wrong type,
    shape or value); :func:`raised_in` words it as the plugin's fault, not lmkit's."""


def plugin_label(kind: str, name: str, origin: str | None = None) -> str:
    """A plugin in prose: ``speculative proposer 'ngram'``, with ``(plugin ORIGIN)``
    when the plugin that registered it is known and named differently. ``kind`` is a
    plugin kind or the noun to use (``structured-output backend``)."""
    where = f" (plugin {origin})" if origin and origin != name else ""
    return f"{kind_label(kind)} {name!r}{where}"


def registration_label(reg: Registration) -> str:
    """:func:`plugin_label` of a registry entry."""
    return plugin_label(reg.kind, reg.name, reg.origin)


def raised_in(label: str, error: BaseException, doing: str = "") -> str:
    """``<label> raised <Type> in <Class.method> (<file>:<line>)[ while <doing>]:
    <message>``: the error of a plugin call, naming the plugin's function the exception
    came from (the first frame outside lmkit's core after the caller's own). A
    :class:`BrokenContract` reads ``<label>[ while <doing>]: <message>``."""
    while_ = f" while {doing}" if doing else ""
    if isinstance(error, BrokenContract):
        return f"{label} broke its contract{while_}: {error}"
    site = _plugin_site(error)
    return f"{label} raised {type(error).__name__}{site}{while_}: {error}"


def _plugin_site(error: BaseException) -> str:
    frames: list[tuple[FrameType, int]] = list(traceback.walk_tb(error.__traceback__))
    callees = frames[1:]  # frames[0] is the engine's call site
    if not callees:
        return ""
    frame, line = next(((f, n) for f, n in callees
                        if not os.path.abspath(f.f_code.co_filename).startswith(_CORE_DIR)),
                       callees[0])
    code = frame.f_code
    return f" in {code.co_qualname} ({os.path.basename(code.co_filename)}:{line})"
