"""The registry of specs by kind, and selection of one implementation per kind."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from lmkit.errors import DuplicateSpecError, NoBackendError, UnknownBackendError
from lmkit.plugin_host.kinds import canonical_kind, kind_label
from lmkit.plugin_host.spec import Needs, Spec


@dataclass(frozen=True, slots=True)
class Registration:
    """A spec together with where it came from."""

    kind: str
    spec: Spec
    plugin: str
    dist: str | None = None
    version: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def origin(self) -> str:
        if self.dist:
            return f"{self.plugin} ({self.dist} {self.version})"
        return self.plugin


Decide = Callable[[str, Sequence[Registration], Needs], "str | None"]


def suggest(name: str, known: Iterable[str]) -> str:
    """`` Did you mean 'x'?`` for the closest known name, or ``""``."""
    match = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f" Did you mean {match[0]!r}?" if match else ""


def format_table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """A plain-text table (no colour codes), used in error messages."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths, strict=True))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(s.rstrip() for s in out)


class Registry:
    """Specs by kind and name, with the plugin and distribution that registered each."""

    def __init__(self) -> None:
        self._by_kind: dict[str, dict[str, Registration]] = {}

    def add(self, kind: str, spec: Spec, plugin: str, dist: str | None = None,
            version: str | None = None) -> Registration:
        if not isinstance(spec, Spec):
            hint = (" (call register once per spec)" if isinstance(spec, (list, tuple, set))
                    else "")
            raise TypeError(
                f"plugin {plugin!r} registered {type(spec).__name__} for {kind}; "
                f"expected lmkit.api.Spec{hint}"
            )
        table = self._by_kind.setdefault(kind, {})
        reg = Registration(kind, spec, plugin, dist, version)
        for key in (spec.name, *spec.aliases):
            other = table.get(key)
            if other is not None and other.plugin != plugin:
                raise DuplicateSpecError(
                    f"{kind} {key!r} is registered twice: by plugin {other.origin} "
                    f"and by plugin {reg.origin}. Block one with -p no:NAME."
                )
            if other is not None and other.spec != spec:
                raise DuplicateSpecError(
                    f"{kind} {key!r} is registered twice by plugin {plugin!r} with different specs."
                )
        for key in (spec.name, *spec.aliases):
            table[key] = reg
        return reg

    def remove_plugin(self, plugin: str) -> None:
        """Withdraw every registration ``plugin`` made (it failed part-way)."""
        for table in self._by_kind.values():
            for key in [k for k, r in table.items() if r.plugin == plugin]:
                del table[key]

    def kinds(self) -> list[str]:
        """The kinds that have at least one registration."""
        return sorted(k for k, table in self._by_kind.items() if table)

    def all(self, kind: str) -> list[Registration]:
        """Every registration of ``kind`` (aliases folded), highest priority first."""
        kind = canonical_kind(kind)
        unique = {id(r): r for r in self._by_kind.get(kind, {}).values()}.values()
        return sorted(unique, key=lambda r: (-r.spec.priority, r.name))

    def names(self, kind: str) -> list[str]:
        """Names of every registration of ``kind``, highest priority first."""
        return [r.name for r in self.all(kind)]

    def get(self, kind: str, name: str) -> Registration:
        """The registration called ``name``; raises UnknownBackendError listing the known ones."""
        kind = canonical_kind(kind)
        reg = self._by_kind.get(kind, {}).get(name)
        if reg is None:
            known = self.names(kind)
            listed = ", ".join(known) if known else "none (no plugin registers this kind)"
            raise UnknownBackendError(
                f"unknown {kind_label(kind)} {name!r}; known: {listed}.{suggest(name, known)}"
            )
        return reg

    def select(self, kind: str, choice: str, needs: Needs, decide: Decide | None = None
               ) -> Registration:
        """Choose the implementation of ``kind`` for ``choice`` (a name or ``"auto"``).

        An explicit name must fit ``needs``; ``auto`` keeps the candidates with no
        reasons against them, asks ``decide`` (the decision hook), else takes the
        highest priority. Raises :class:`NoBackendError` with a table of every candidate
        and why it was rejected.
        """
        kind = canonical_kind(kind)
        if choice != "auto":
            reg = self.get(kind, choice)
            reasons = reg.spec.why_not(needs)
            if reasons:
                raise NoBackendError(
                    f"{kind_label(kind)} {choice!r} (plugin {reg.origin}) cannot be used: "
                    + "; ".join(reasons) + f". Needed: {needs.describe()}."
                    + self._alternatives(kind, needs, exclude=reg.name)
                )
            return reg
        candidates = self.all(kind)
        fit = [r for r in candidates if not r.spec.why_not(needs)]
        if not fit:
            raise NoBackendError(self.explain(kind, needs))
        if decide is not None:
            chosen = decide(kind, fit, needs)
            if chosen is not None:
                for r in fit:
                    if r.name == chosen:
                        return r
                raise NoBackendError(
                    f"the choose_implementation hook picked {kind} {chosen!r}, which is not "
                    f"among the eligible candidates: {', '.join(r.name for r in fit)}"
                )
        return fit[0]

    def explain(self, kind: str, needs: Needs) -> str:
        """The no-fit error: every candidate, its plugin and version, and its reasons."""
        candidates = self.all(kind)
        if not candidates:
            return (f"no {kind_label(kind)} is registered by any plugin; install or load "
                    "(-p NAME) a plugin that provides one (`lmkit plugins list` shows what loaded).")
        rows = [
            (r.name, r.plugin, r.version or "-", "; ".join(r.spec.why_not(needs)) or "ok")
            for r in candidates
        ]
        table = format_table(rows, ("name", "plugin", "version", "why not"))
        return (
            f"no {kind_label(kind)} fits this configuration (needs: {needs.describe()}).\n"
            f"{table}"
        )

    def _alternatives(self, kind: str, needs: Needs, exclude: str) -> str:
        ok = [r.name for r in self.all(kind) if r.name != exclude and not r.spec.why_not(needs)]
        return f" Available instead: {', '.join(ok)}." if ok else ""
