"""JSON-ready descriptions of loaded plugins and registered specs, with each spec's
availability on this machine. Shared by ``lmkit plugins`` and the server's
introspection endpoint; computing them imports no implementation."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from lmkit.platform import cuda_device_count
from lmkit.plugin_host.kinds import KINDS
from lmkit.plugin_host.registry import Registration
from lmkit.plugin_host.spec import Needs, choose_variant

if TYPE_CHECKING:
    from lmkit.plugin_host.manager import PluginHost


def machine_device() -> str:
    """``"cuda"`` when a CUDA device is visible, else ``"cpu"``."""
    return "cuda" if cuda_device_count() > 0 else "cpu"


def availability(reg: Registration, device: str | None = None) -> list[str]:
    """Why ``reg`` cannot run on this machine at all: missing modules, no CUDA device, a
    device its caps exclude. Empty when it is available."""
    needs = Needs(values={"device": device or machine_device()})
    return reg.spec.unavailable_reasons() + reg.spec.caps.why_not(needs)


def spec_report(reg: Registration, device: str | None = None,
                with_schema: bool = False) -> dict[str, Any]:
    """Everything known about one registration without importing it."""
    spec = reg.spec
    target = spec.target if isinstance(spec.target, str) else getattr(
        spec.target, "__qualname__", repr(spec.target))
    out: dict[str, Any] = {
        "kind": reg.kind,
        "name": reg.name,
        "aliases": list(spec.aliases),
        "plugin": reg.plugin,
        "dist": reg.dist,
        "version": reg.version,
        "description": spec.description,
        "target": target,
        "priority": spec.priority,
        "requires": list(spec.requires),
        "needs_cuda": spec.needs_cuda,
        "caps": {
            "features": sorted(spec.caps.features),
            "values": {k: sorted(map(str, v)) for k, v in sorted(spec.caps.values.items())},
        },
        "stack_needs": {
            kind: {"features": sorted(n.features), "values": dict(n.values)}
            for kind, n in sorted(spec.stack_needs.items())
        },
        "options": spec.options.__name__,
    }
    if spec.variants:
        chosen, why = choose_variant(spec.variants)
        out["variant"] = chosen.name if chosen is not None else None
        out["variants"] = [
            {"name": v.name, "description": v.description, "requires": list(v.requires),
             "compute_capability": sorted(v.compute_capability),
             "available": not why[v.name], "reasons": why[v.name]}
            for v in spec.variants
        ]
    reasons = availability(reg, device)
    out["available"] = not reasons
    out["reasons"] = reasons
    if with_schema:
        out["options_schema"] = spec.options.model_json_schema()
    return out


def variant_line(report: dict[str, Any]) -> str | None:
    """One line saying which variant of a spec would run here and why the others would
    not (``None`` for a spec without variants)."""
    variants = report.get("variants")
    if not variants:
        return None
    parts = []
    for v in variants:
        if v["name"] == report.get("variant"):
            parts.append(f"{v['name']} would run ({v['description'] or 'available'})")
        elif v["available"]:
            parts.append(f"{v['name']}: available, not preferred")
        else:
            parts.append(f"{v['name']}: " + ", ".join(v["reasons"]))
    head = "" if report.get("variant") else "none would run: "
    return f"{report['name']}: {head}" + "; ".join(parts)


def host_report(host: PluginHost) -> dict[str, Any]:
    """Every plugin (loaded or not, with its status) and every spec by kind."""
    device = machine_device()
    return {
        "device": device,
        "plugins": [
            {k: v for k, v in dataclasses.asdict(info).items() if k != "detail"}
            for info in host.plugins.values()
        ],
        "specs": {
            kind: [spec_report(r, device) for r in host.registry.all(kind)]
            for kind in KINDS
        },
    }
