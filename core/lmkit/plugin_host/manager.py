"""Finding, loading and checking plugins; collecting their registrations.

Order: the ``lmkit`` distribution's own entry points (the built-ins), then every other
distribution's entry points in the ``lmkit`` group, then plugins named with ``-p``.
``-p no:NAME`` blocks a plugin; ``LMKIT_PLUGINS`` (comma-separated) is an allow-list for
third-party entry points; ``LMKIT_DISABLE_PLUGIN_AUTOLOAD=1`` turns third-party discovery
off. A plugin asked for by name that fails is fatal; an auto-loaded one that fails is
recorded in :attr:`PluginHost.plugins` and shown by ``lmkit plugins list``.
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

from lmkit.errors import PluginAPIVersionError, PluginError, PluginLoadError
from lmkit.plugin_host import hookspecs
from lmkit.plugin_host.kinds import REGISTER_HOOKS
from lmkit.plugin_host.registry import Registration, Registry, suggest
from lmkit.plugin_host.spec import Needs
from lmkit.version import PLUGIN_API_VERSION, __version__

ENTRY_POINT_GROUP = "lmkit"
CORE_DIST = "lmkit"
API_ATTR = "LMKIT_PLUGIN_API"


@dataclass
class PluginInfo:
    """What ``lmkit plugins list`` shows for one plugin.

    ``source`` is how it was found: ``builtin`` (an entry point of the lmkit
    distribution), ``entrypoint`` (another distribution's), ``cli`` (``-p NAME``) or
    ``object`` (passed in-process). ``status`` is ``loaded``, ``failed`` (``error`` says
    why, ``detail`` holds the end of the traceback), ``blocked`` (``-p no:NAME``),
    ``not allowed`` (left out by ``LMKIT_PLUGINS``) or ``not loaded``
    (``LMKIT_DISABLE_PLUGIN_AUTOLOAD``). ``api`` is the declared
    ``LMKIT_PLUGIN_API`` range.
    """

    name: str
    source: str
    module: str = ""
    dist: str | None = None
    version: str | None = None
    status: str = "loaded"  # "loaded" | "failed" | "blocked" | "not allowed" | "not loaded"
    error: str | None = None
    detail: str | None = None
    api: str | None = None
    hooks: list[str] = field(default_factory=list)

    @property
    def origin(self) -> str:
        """``name (dist version)``, or just the name for a plugin outside a distribution."""
        return f"{self.name} ({self.dist} {self.version})" if self.dist else self.name


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def check_api_version(name: str, declared: Any, origin: str | None = None) -> None:
    """Raise PluginAPIVersionError unless ``declared`` admits :data:`PLUGIN_API_VERSION`.

    :param name: the plugin's name; ``origin`` (``name (dist version)``) is shown if given.
    """
    name = origin or repr(name)
    if declared is None:
        raise PluginAPIVersionError(
            f"plugin {name} does not declare the plugin API versions it supports; "
            f'add {API_ATTR} = ">=1.0,<2" to the plugin module (lmkit\'s is {PLUGIN_API_VERSION}).'
        )
    if not str(declared).strip():
        raise PluginAPIVersionError(
            f"plugin {name} declares an empty {API_ATTR}, which would claim every plugin API "
            f'version; declare the versions it supports, e.g. {API_ATTR} = ">=1.0,<2".')
    try:
        spec = SpecifierSet(str(declared))
    except InvalidSpecifier as e:
        raise PluginAPIVersionError(
            f"plugin {name} declares {API_ATTR} = {declared!r}, which is not a version "
            f'specifier like ">=1.0,<2".'
        ) from e
    if Version(PLUGIN_API_VERSION) not in spec:
        raise PluginAPIVersionError(
            f"plugin {name} supports lmkit plugin API {declared}, but this lmkit "
            f"({__version__}) provides plugin API {PLUGIN_API_VERSION}. Upgrade the plugin, "
            "install an lmkit it supports, or block it with -p no:NAME."
        )


class PluginHost:
    """A pluggy manager plus the registry built from it. One per process."""

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.registry = Registry()
        self.plugins: dict[str, PluginInfo] = {}
        self._blocked: set[str] = set()

    # ---------------------------------------------------------------- loading

    @classmethod
    def load(
        cls,
        plugins: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        extra: Sequence[tuple[str, object]] = (),
    ) -> PluginHost:
        """Build a host: built-ins, entry points, then ``plugins`` (``-p`` values).

        ``extra`` registers in-process plugin objects (``(name, module_or_object)``),
        as tests and embedding applications do.
        """
        env = os.environ if env is None else env
        host = cls()
        wanted = [p for p in plugins if not p.startswith("no:")]
        host._blocked = {p[3:] for p in plugins if p.startswith("no:")}
        allow_raw = env.get("LMKIT_PLUGINS")
        allow = {s.strip() for s in allow_raw.split(",") if s.strip()} if allow_raw else None
        autoload = not _truthy(env.get("LMKIT_DISABLE_PLUGIN_AUTOLOAD"))

        eps = sorted(md.entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name)
        by_name = {ep.name: ep for ep in eps}
        builtin = [ep for ep in eps if _dist_name(ep) == CORE_DIST]
        third = [ep for ep in eps if _dist_name(ep) != CORE_DIST]
        for ep in builtin:
            host._load_entry_point(ep, "builtin", fatal=False)
        for ep in third:
            dist = _dist_name(ep)
            named = allow is not None and (ep.name in allow or dist in allow)
            if ep.name in wanted:
                continue  # loaded below as a named plugin
            if allow is not None and not named:
                host._record(ep.name, "entrypoint", ep.value, ep, status="not allowed")
                continue
            if not autoload and not named:
                host._record(ep.name, "entrypoint", ep.value, ep, status="not loaded",
                             error="LMKIT_DISABLE_PLUGIN_AUTOLOAD is set; load it with -p NAME")
                continue
            host._load_entry_point(ep, "entrypoint", fatal=named)
        for name, obj in extra:
            host.register(obj, name, source="object", fatal=True)
        for name in wanted:
            if name in host.plugins and host.plugins[name].status == "loaded":
                continue
            if name in by_name:
                host._load_entry_point(by_name[name], "cli", fatal=True)
            else:
                host._load_module(name)
        if allow:
            missing = sorted(allow - set(host.plugins) - {_dist_name(e) for e in third})
            if missing:
                raise PluginLoadError(
                    f"LMKIT_PLUGINS names {', '.join(map(repr, missing))}, which no installed "
                    f"distribution provides; installed: {', '.join(e.name for e in third) or 'none'}."
                )
        host.collect()
        return host

    def _record(self, name: str, source: str, module: str, ep: Any = None,
                key: str | None = None, **kw: Any) -> PluginInfo:
        info = PluginInfo(name=name, source=source, module=module,
                          dist=_dist_name(ep) if ep else None,
                          version=_dist_version(ep) if ep else None, **kw)
        self.plugins[key or name] = info
        return info

    def _register_checked(self, obj: object, name: str) -> None:
        """``pm.register``, with a hook implementation whose parameters the hook does not
        provide reported as such (pluggy's own message shows the whole plugin object)."""
        try:
            self.pm.register(obj, name=name)
        except pluggy.PluginValidationError as e:
            raise PluginError(f"plugin {name!r}: {hook_signature_problem(obj, e)}") from None

    def _load_entry_point(self, ep: md.EntryPoint, source: str, fatal: bool) -> None:
        if ep.name in self._blocked or ep.value in self._blocked:
            self._record(ep.name, source, ep.value, ep, status="blocked")
            return
        try:
            obj = ep.load()
        except (Exception, SystemExit) as e:  # a broken plugin must not take the process down
            reason = f"{type(e).__name__}: {e}"
            if fatal:
                raise PluginLoadError(
                    f"plugin {ep.name!r} ({ep.value}) failed to import: {reason}"
                ) from e
            self._record(ep.name, source, ep.value, ep, status="failed", error=reason,
                         detail=traceback.format_exc(limit=-3))
            return
        self.register(obj, ep.name, source=source, fatal=fatal, ep=ep)

    def _load_module(self, name: str) -> None:
        if name in self._blocked:
            return
        try:
            obj = importlib.import_module(name)
        except ImportError as e:
            known = [ep.name for ep in md.entry_points(group=ENTRY_POINT_GROUP)]
            raise PluginLoadError(
                f"plugin {name!r} not found: it is neither an installed lmkit entry point "
                f"nor an importable module ({e}). Installed plugins: {', '.join(known) or 'none'}."
                + suggest(name, known)
            ) from e
        except (Exception, SystemExit) as e:
            raise PluginLoadError(
                f"plugin {name!r} failed to import: {type(e).__name__}: {e}"
            ) from e
        self.register(obj, name, source="cli", fatal=True)

    def register(self, obj: object, name: str, *, source: str = "object", fatal: bool = True,
                 ep: md.EntryPoint | None = None) -> None:
        """Register one plugin object after checking its API version and hook names.

        ``fatal=False`` (auto-loaded plugins) records a failure in :attr:`plugins`
        instead of raising.
        """
        module = getattr(obj, "__name__", type(obj).__name__)
        declared = getattr(obj, API_ATTR, None)
        taken = self.plugins.get(name) if self.pm.has_plugin(name) else None
        key = name if taken is None else f"{name} [{_dist_name(ep) or module}]"
        info = self._record(name, source, ep.value if ep else module, ep,
                            api=None if declared is None else str(declared), key=key)
        try:
            if taken is not None:
                raise PluginLoadError(
                    f"plugin {info.origin} ({info.module}) cannot be registered: the plugin "
                    f"name {name!r} is already taken by plugin {taken.origin} "
                    f"({taken.module}); rename its entry point.")
            check_api_version(name, declared, info.origin if info.dist else None)
            self._register_checked(obj, name)
            unknown = [hc.name for hc in self.pm.get_hookcallers(obj) or [] if not hc.has_spec()]
            if unknown:
                self.pm.unregister(obj)
                known = [h for h in dir(hookspecs) if not h.startswith("_")]
                hints = "".join(suggest(h, known) for h in unknown)
                raise PluginError(
                    f"plugin {name!r} implements unknown hook(s) {', '.join(unknown)}.{hints}"
                )
        except PluginError as e:
            if fatal:
                raise
            info.status, info.error = "failed", str(e)
            return
        except Exception as e:
            if fatal:
                raise PluginLoadError(f"plugin {name!r} could not be registered: {e}") from e
            info.status, info.error = "failed", f"{type(e).__name__}: {e}"
            info.detail = traceback.format_exc(limit=-3)
            return
        info.hooks = sorted(hc.name for hc in self.pm.get_hookcallers(obj) or [])

    # ---------------------------------------------------------------- registrations

    def collect(self) -> None:
        """Run every ``register_*`` hook, attributing each spec to its plugin.

        A plugin that fails here (an exception, an invalid or duplicate spec) is fatal if
        it was asked for by name; an auto-loaded one is marked failed, its registrations
        are withdrawn and it is unregistered, so that nothing half-registered remains.
        """
        self.pm.check_pending()
        for kind, hook_name in REGISTER_HOOKS.items():

            def register_for(plugin: str, _kind: str = kind) -> Any:
                info = self.plugins.get(plugin)

                def register(spec: Any) -> None:
                    self.registry.add(_kind, spec, plugin, info.dist if info else None,
                                      info.version if info else None)

                return register

            self.call_each(hook_name, lambda plugin: {"register": register_for(plugin)},
                           returns_none=True)

    def add_commands(self, app: Any) -> None:
        """Let every plugin add CLI sub-commands to ``app`` (``register_commands``)."""
        self.call_each("register_commands", lambda plugin: {"app": app})

    def call_each(self, hook_name: str, kwargs_for: Callable[[str], dict[str, Any]],
                  returns_none: bool = False) -> None:
        """Call each implementation of ``hook_name`` separately, in registration order, so
        that one failing plugin is attributed and handled (see :meth:`collect`) without
        stopping the others. ``kwargs_for(plugin_name)`` gives the hook's arguments;
        ``returns_none``: an implementation that returns a value is a failure (a
        ``register_*`` hook that returns its spec instead of calling ``register``)."""
        # get_hookimpls() is in registration order (pluggy *calls* them in reverse)
        for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
            kwargs = kwargs_for(impl.plugin_name)
            try:
                result = impl.function(*[kwargs[a] for a in impl.argnames])
                if returns_none and result is not None:
                    raise PluginError(
                        f"plugin {impl.plugin_name!r}: {hook_name} returned "
                        f"{type(result).__name__}, which is ignored; call register(spec) once "
                        "per implementation and return None.")
            except (Exception, SystemExit) as e:
                self._fail(impl.plugin_name, hook_name, e)

    def _fail(self, plugin: str, hook_name: str, error: BaseException) -> None:
        info = self.plugins.get(plugin)
        if isinstance(error, PluginError):
            msg = str(error)
        else:
            msg = f"plugin {plugin!r} failed in {hook_name}: {type(error).__name__}: {error}"
        if info is None or info.source in ("cli", "object"):
            if isinstance(error, PluginError):
                raise error
            raise PluginError(msg) from error
        info.status, info.error = "failed", msg
        info.detail = "".join(traceback.format_exception(error, limit=-3))
        info.hooks = []
        self.registry.remove_plugin(plugin)
        if self.pm.has_plugin(plugin):
            self.pm.unregister(name=plugin)

    # ---------------------------------------------------------------- selection

    def select(self, kind: str, choice: str, needs: Needs | None = None) -> Registration:
        """Select an implementation of ``kind`` (see :meth:`Registry.select`); under
        ``auto`` the ``choose_implementation`` hook is consulted."""

        return self.registry.select(kind, choice, needs or Needs(), self._decide)

    def _decide(self, kind: str, candidates: Sequence[Registration], needs: Needs) -> str | None:
        """The first non-``None`` answer of the ``choose_implementation`` hooks (last
        registered first, as pluggy calls them), each checked and its errors attributed.
        With a wrapper among them, pluggy runs the call (a wrapper drives the others)."""
        impls = self.pm.hook.choose_implementation.get_hookimpls()
        args = {"kind": kind, "candidates": list(candidates), "needs": needs}
        if any(impl.wrapper or impl.hookwrapper for impl in impls):
            answer = self.pm.hook.choose_implementation(**args)
            return None if answer is None else str(answer)
        for impl in reversed(impls):
            try:
                answer = impl.function(*[args[a] for a in impl.argnames])
            except Exception as e:
                raise PluginError(
                    f"plugin {impl.plugin_name!r} failed in choose_implementation for "
                    f"{kind}: {type(e).__name__}: {e}") from e
            if answer is None:
                continue
            if not isinstance(answer, str):
                raise PluginError(
                    f"plugin {impl.plugin_name!r}: choose_implementation returned "
                    f"{type(answer).__name__} for {kind}; return the chosen candidate's "
                    f"name (one of {', '.join(r.name for r in candidates)}) or None.")
            return answer
        return None

    @property
    def hook(self) -> Any:
        """The pluggy hook relay: ``host.hook.engine_started(engine=...)``."""
        return self.pm.hook

    def failures(self) -> list[PluginInfo]:
        """The plugins that failed to load or register (auto-loaded ones only; a named
        plugin that fails raises instead)."""
        return [p for p in self.plugins.values() if p.status == "failed"]


def _dist_name(ep: Any) -> str | None:
    dist = getattr(ep, "dist", None)
    return dist.metadata["Name"] if dist is not None else None


def _dist_version(ep: Any) -> str | None:
    dist = getattr(ep, "dist", None)
    return dist.version if dist is not None else None


def hook_signature_problem(obj: object, error: Exception) -> str:
    """What is wrong with a hook implementation pluggy refused (``error``), on one line:
    the parameters the hook does not provide and the hook's own signature."""
    import inspect
    import re

    found = re.search(r"for hook '(\w+)'", str(error))
    hook = found.group(1) if found else ""
    spec, impl = getattr(hookspecs, hook, None), getattr(obj, hook, None)
    if not hook or spec is None or impl is None:
        return " ".join(line.strip() for line in str(error).splitlines())
    wanted = list(inspect.signature(spec).parameters)
    got = list(inspect.signature(impl).parameters)
    extra = [a for a in got if a not in wanted]
    return (f"its {hook}({', '.join(got)}) takes {', '.join(map(repr, extra))}, which the "
            f"hook does not provide; the hook is {hook}({', '.join(wanted)}) (an "
            "implementation takes some or all of these, by name).")
