"""``import lmkit``, ``lmkit.api``, loading the plugins and building the CLI import no
heavy library: ``lmkit --help`` and ``lmkit plugins list`` must stay fast on any machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HEAVY = ("torch", "triton", "flashinfer", "flash_attn", "xgrammar", "ray", "fastapi",
         "uvicorn", "transformers")

PROBE = """
import json, sys
import lmkit, lmkit.api
from lmkit.api import PluginHost, Spec, Caps, Needs, hookimpl
host = PluginHost.load()
from lmkit.cli.main import build_app
build_app()
from lmkit.plugin_host.report import host_report
host_report(host)
print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
"""


def test_core_api_plugins_and_cli_import_no_heavy_library() -> None:
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("LMKIT_")}
    env["LMKIT_DISABLE_PLUGIN_AUTOLOAD"] = "1"  # lmkit and its built-in plugins only
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                            text=True, timeout=60, check=True)
    loaded = set(json.loads(result.stdout))
    assert "lmkit_plugins" in loaded  # the built-in plugin modules were imported ...
    assert sorted(loaded & set(HEAVY)) == []  # ... and none of them pulled in a heavy library
