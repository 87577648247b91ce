"""lmkit-fair-scheduler: per-tenant fair-share scheduling for lmkit."""

__version__ = "0.1.0"
