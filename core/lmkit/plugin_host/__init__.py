"""The plugin machinery: hookspecs, specs and capabilities, the registry, loading and
whole-stack resolution. Plugin authors use it through :mod:`lmkit.api`."""
