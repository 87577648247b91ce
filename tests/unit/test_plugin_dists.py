"""Plugin discovery and loading controls against real installed distributions.

The packages under tests/fixtures/dists are installed once per session with
``pip install --no-deps --no-build-isolation --target DIR`` (real wheels with
dist-info and entry points), then made visible by putting DIR on ``sys.path`` for
in-process tests or on ``PYTHONPATH`` for subprocess tests (test_cli_dists.py imports
the fixtures from here).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from lmkit.errors import (
    DuplicateSpecError,
    PluginAPIVersionError,
    PluginLoadError,
)
from lmkit.platform import cuda_device_count
from lmkit.plugin_host.manager import PluginHost
from lmkit.plugin_host.report import availability
from lmkit.version import PLUGIN_API_VERSION

DISTS = Path(__file__).resolve().parents[1] / "fixtures" / "dists"
ALL_TEST_PLUGINS = ("broken-test", "dup-test", "good-test", "oldapi-test", "typo-test")
NO_ENV: dict[str, str] = {}


_INSTALLED: dict[str, Path] = {}


def install_test_dists(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Install the test distributions with pip into a fresh folder, once per test
    session (cached here because test_cli_dists.py uses them too); return the folder."""
    if "site" not in _INSTALLED:
        src = tmp_path_factory.mktemp("dist-src")
        target = tmp_path_factory.mktemp("dist-site")
        # build from copies so that the source tree gets no build/ or egg-info
        copies = [shutil.copytree(dist, src / dist.name)
                  for dist in sorted(DISTS.iterdir()) if (dist / "pyproject.toml").exists()]
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
             "--no-build-isolation", "--no-index", "--disable-pip-version-check",
             "--target", str(target), *map(str, copies)],
            check=True, capture_output=True, text=True,
        )
        _INSTALLED["site"] = target
    return _INSTALLED["site"]


@pytest.fixture(scope="session")
def installed_dists(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the test distributions, installed by pip."""
    return install_test_dists(tmp_path_factory)


@pytest.fixture
def dists_on_path(installed_dists: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The installed test distributions, visible to this process for one test."""
    monkeypatch.syspath_prepend(str(installed_dists))
    return installed_dists


def test_pip_installed_real_distributions(installed_dists: Path) -> None:
    infos = sorted(p.name for p in installed_dists.glob("*.dist-info"))
    assert infos == [
        "lmkit_testplugin_broken-0.1.0.dist-info", "lmkit_testplugin_dup-0.2.0.dist-info",
        "lmkit_testplugin_good-1.2.3.dist-info", "lmkit_testplugin_logits-0.4.0.dist-info",
        "lmkit_testplugin_oldapi-0.9.0.dist-info",
        "lmkit_testplugin_typo-0.3.0.dist-info",
    ]
    assert not list(DISTS.glob("*/build")) and not list(DISTS.glob("*/*.egg-info"))


def test_entry_points_are_discovered_with_their_distribution(dists_on_path: Path) -> None:
    host = PluginHost.load(env=NO_ENV)
    good = host.plugins["good-test"]
    assert (good.status, good.source, good.dist, good.version) == (
        "loaded", "entrypoint", "lmkit-testplugin-good", "1.2.3")
    assert good.hooks == ["register_attention_backends", "register_commands",
                          "register_schedulers", "register_spec_proposers"]
    reg = host.registry.get("scheduler", "fair-test")
    assert (reg.plugin, reg.dist, reg.version) == ("good-test", "lmkit-testplugin-good", "1.2.3")
    # built-ins come from the lmkit distribution's own entry points
    assert host.plugins["lmkit.schedulers"].source == "builtin"
    assert host.registry.get("scheduler", "fcfs").plugin == "lmkit.schedulers"


def test_without_the_folder_on_the_path_nothing_is_found(installed_dists: Path) -> None:
    host = PluginHost.load(env=NO_ENV)
    assert not set(ALL_TEST_PLUGINS) & set(host.plugins)


def test_broken_autoloaded_plugins_are_recorded_and_the_rest_survives(dists_on_path: Path) -> None:
    host = PluginHost.load(env=NO_ENV)
    status = {name: host.plugins[name].status for name in ALL_TEST_PLUGINS}
    assert status == {"broken-test": "failed", "dup-test": "failed", "good-test": "loaded",
                      "oldapi-test": "failed", "typo-test": "failed"}
    broken = host.plugins["broken-test"]
    assert broken.error == (
        "RuntimeError: lmkit-testplugin-broken cannot start: its backend library is missing")
    assert "plugin.py" in (broken.detail or "")
    assert {f.name for f in host.failures()} == {"broken-test", "dup-test", "oldapi-test",
                                                 "typo-test"}


def test_broken_plugin_named_with_p_is_fatal_with_a_short_reason(dists_on_path: Path) -> None:
    with pytest.raises(PluginLoadError) as exc:
        PluginHost.load(plugins=["broken-test"], env=NO_ENV)
    assert str(exc.value) == (
        "plugin 'broken-test' (lmkit_testplugin_broken.plugin) failed to import: RuntimeError: "
        "lmkit-testplugin-broken cannot start: its backend library is missing")


def test_duplicate_name_is_rejected_naming_both_plugins(dists_on_path: Path) -> None:
    host = PluginHost.load(env=NO_ENV)
    dup = host.plugins["dup-test"]
    assert dup.error == (
        "scheduler 'fcfs' is registered twice: by plugin lmkit.schedulers (lmkit 0.1.0) and by "
        "plugin dup-test (lmkit-testplugin-dup 0.2.0). Block one with -p no:NAME.")
    # the built-in keeps the name; the rejected plugin's other registrations are withdrawn
    assert host.registry.get("scheduler", "fcfs").plugin == "lmkit.schedulers"
    assert "dup-only-test" not in host.registry.names("scheduler")
    with pytest.raises(DuplicateSpecError, match="by plugin lmkit.schedulers .* by plugin dup-test"):
        PluginHost.load(plugins=["dup-test"], env=NO_ENV)


def test_api_version_mismatch_names_plugin_and_both_versions(dists_on_path: Path) -> None:
    host = PluginHost.load(env=NO_ENV)
    error = host.plugins["oldapi-test"].error or ""
    assert error.startswith("plugin oldapi-test (lmkit-testplugin-oldapi 0.9.0) supports lmkit "
                            "plugin API <1.0, but this lmkit (0.1.0) provides plugin API "
                            f"{PLUGIN_API_VERSION}.")
    assert "old-test" not in host.registry.names("scheduler")
    with pytest.raises(PluginAPIVersionError, match=rf"oldapi-test .*<1\.0, .*provides "
                                                    rf"plugin API {re.escape(PLUGIN_API_VERSION)}"):
        PluginHost.load(plugins=["oldapi-test"], env=NO_ENV)


def test_misspelled_hook_is_caught_with_a_suggestion(dists_on_path: Path) -> None:
    host = PluginHost.load(env=NO_ENV)
    assert host.plugins["typo-test"].error == (
        "plugin 'typo-test' implements unknown hook(s) register_schedulerz. "
        "Did you mean 'register_schedulers'?")


def test_p_no_blocks_a_plugin(dists_on_path: Path) -> None:
    host = PluginHost.load(plugins=["no:good-test", "no:lmkit.attention"], env=NO_ENV)
    assert host.plugins["good-test"].status == "blocked"
    assert host.plugins["lmkit.attention"].status == "blocked"
    assert "fair-test" not in host.registry.names("scheduler")
    assert host.registry.names("attention") == []


def test_allow_list_loads_only_the_named_third_party_plugins(dists_on_path: Path) -> None:
    host = PluginHost.load(env={"LMKIT_PLUGINS": "good-test"})
    assert host.plugins["good-test"].status == "loaded"
    for name in ("broken-test", "dup-test", "oldapi-test", "typo-test"):
        assert host.plugins[name].status == "not allowed"
    assert host.plugins["lmkit.schedulers"].status == "loaded"  # built-ins always load
    # a distribution name works too, and an allowed plugin that fails is fatal
    host = PluginHost.load(env={"LMKIT_PLUGINS": "lmkit-testplugin-good"})
    assert host.plugins["good-test"].status == "loaded"
    with pytest.raises(PluginLoadError, match="broken-test"):
        PluginHost.load(env={"LMKIT_PLUGINS": "good-test,broken-test"})
    with pytest.raises(PluginLoadError, match="'good-tset', which no installed distribution"):
        PluginHost.load(env={"LMKIT_PLUGINS": "good-tset"})


def test_disable_autoload_skips_third_party_until_named(dists_on_path: Path) -> None:
    env = {"LMKIT_DISABLE_PLUGIN_AUTOLOAD": "1"}
    host = PluginHost.load(env=env)
    assert {host.plugins[n].status for n in ALL_TEST_PLUGINS} == {"not loaded"}
    assert host.plugins["lmkit.schedulers"].status == "loaded"
    host = PluginHost.load(plugins=["good-test"], env=env)
    assert (host.plugins["good-test"].status, host.plugins["good-test"].source) == ("loaded", "cli")
    assert "fair-test" in host.registry.names("scheduler")
    # -p also takes a module name
    host = PluginHost.load(plugins=["lmkit_testplugin_good.plugin"], env=env)
    assert host.registry.get("scheduler", "fair-test").plugin == "lmkit_testplugin_good.plugin"


def test_unknown_plugin_name_is_fatal_with_a_suggestion(dists_on_path: Path) -> None:
    with pytest.raises(PluginLoadError, match="plugin 'good-tst' not found.*Did you mean 'good-test'"):
        PluginHost.load(plugins=["good-tst"], env=NO_ENV)


def test_gpu_only_spec_is_unavailable_with_reasons(dists_on_path: Path) -> None:
    host = PluginHost.load(env=NO_ENV)
    reasons = availability(host.registry.get("attention", "gpu-only-test"))
    assert "missing module 'not_installed_mod'" in reasons
    if cuda_device_count() == 0:
        assert "no CUDA device" in reasons
        assert "device cpu not supported (supports: cuda)" in reasons
    assert availability(host.registry.get("scheduler", "fair-test")) == []


def test_registering_does_not_import_the_implementation(dists_on_path: Path) -> None:
    sys.modules.pop("lmkit_testplugin_good.backends", None)
    host = PluginHost.load(env=NO_ENV)
    spec = host.registry.get("scheduler", "fair-test").spec
    assert "lmkit_testplugin_good.backends" not in sys.modules
    cls = spec.load()
    assert cls.__name__ == "FairScheduler"
    assert "lmkit_testplugin_good.backends" in sys.modules
