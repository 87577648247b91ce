"""Writing a plugin package from the templates in ``lmkit/scaffold/templates``.

The package has a ``pyproject.toml`` declaring the ``lmkit`` entry point, a plugin
module (``LMKIT_PLUGIN_API`` and the spec), a minimal real implementation of the kind,
a README, and ``tests/`` running lmkit's conformance suite for the kind. It installs
and passes its tests as generated.
"""

from __future__ import annotations

import re
from pathlib import Path

from lmkit.errors import ConfigError
from lmkit.plugin_host.registry import suggest
from lmkit.scaffold.kinds import SCAFFOLD_ALIASES, SCAFFOLD_KINDS, ScaffoldKind
from lmkit.version import PLUGIN_API_VERSION, __version__

TEMPLATES = Path(__file__).parent / "templates"
NAME_RE = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


def _layout(kind: ScaffoldKind, module: str) -> dict[str, str]:
    """Output path (relative to the package folder) -> template path."""
    return {
        "pyproject.toml": "common/pyproject.toml.jinja",
        "README.md": "common/README.md.jinja",
        f"{module}/__init__.py": "common/__init__.py.jinja",
        f"{module}/plugin.py": f"{kind.name}/plugin.py.jinja",
        f"{module}/{kind.impl_module}.py": f"{kind.name}/impl.py.jinja",
        f"tests/test_{module}.py": f"{kind.name}/test.py.jinja",
    }


def _check_unregistered(name: str, kind: ScaffoldKind) -> None:
    """Refuse a name an installed plugin already registers for the kind (the new
    plugin would be rejected as a duplicate when loaded)."""
    from lmkit.plugin_host.manager import PluginHost

    host = PluginHost.load()
    for reg in host.registry.all(kind.name):
        if name == reg.name or name in reg.spec.aliases:
            raise ConfigError(f"{kind.label} {name!r} is already "
                              f"registered by plugin {reg.origin}; choose another name")


def new_plugin(name: str, kind: str, directory: Path | str = ".") -> Path:
    """Write the package for plugin ``name`` of ``kind`` into ``directory/name``.

    :raises ConfigError: an invalid name, an unknown kind, or an existing folder.
    :return: the package folder.
    """
    import jinja2

    if not NAME_RE.match(name):
        raise ConfigError(f"plugin name {name!r} must be lowercase letters, digits and single "
                          "dashes, starting with a letter (e.g. 'my-attention')")
    if kind not in SCAFFOLD_KINDS:
        hint = (f" ({kind!r} is now called {SCAFFOLD_ALIASES[kind]!r})"
                if kind in SCAFFOLD_ALIASES else suggest(kind, SCAFFOLD_KINDS))
        raise ConfigError(f"unknown plugin kind {kind!r}; choose one of: "
                          f"{', '.join(SCAFFOLD_KINDS)}.{hint}")
    spec = SCAFFOLD_KINDS[kind]
    _check_unregistered(name, spec)
    root = Path(directory) / name
    if root.exists():
        raise ConfigError(f"{root} already exists; choose another name or --dir")
    module = name.replace("-", "_")
    major = PLUGIN_API_VERSION.split(".")[0]
    context = {
        "name": name, "module": module, "kind": spec,
        "class_name": "".join(p.capitalize() for p in name.split("-")) + spec.class_suffix,
        "api_range": f">={PLUGIN_API_VERSION},<{int(major) + 1}",
        "lmkit_version": __version__,
    }
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined, autoescape=False)
    files = {out: env.get_template(tpl).render(**context)
             for out, tpl in _layout(spec, module).items()}
    for out, text in files.items():
        path = root / out
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root
