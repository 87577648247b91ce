"""The configuration's JSON Schema, completed with the installed specs' options."""

from __future__ import annotations

import jsonschema
import pytest
from lmkit.api import Spec
from lmkit.config import LMKitConfig
from lmkit.config.json_schema import config_json_schema
from lmkit.plugin_host.manager import PluginHost
from pydantic import BaseModel, ConfigDict
from test_plugin_host import isolated_host, plugin, registering


class Inner(BaseModel):
    model_config = ConfigDict(extra="forbid")
    depth: int = 1


class TreeOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    width: int = 4
    inner: Inner = Inner()


def host_with_options() -> PluginHost:
    return isolated_host(("p", plugin(register_spec_proposers=registering(
        Spec(name="tree", target="x:T", options=TreeOptions),
        Spec(name="plain", target="x:P"),
    ))))


def test_the_bare_schema_validates_the_default_config() -> None:
    schema = config_json_schema()
    jsonschema.validate(LMKitConfig().model_dump(mode="json"), schema)
    with pytest.raises(jsonschema.ValidationError, match="'schedular' was unexpected"):
        jsonschema.validate({"schedular": {}}, schema)


def test_backend_names_and_per_backend_options_come_from_the_plugins() -> None:
    schema = config_json_schema(host_with_options())
    section = schema["$defs"]["SpeculativeConfig"]
    assert section["properties"]["backend"]["enum"] == ["none", "auto", "plain", "tree"]
    ok = {"speculative": {"backend": "tree", "options": {"width": 8, "inner": {"depth": 2}}}}
    jsonschema.validate(ok, schema)
    with pytest.raises(jsonschema.ValidationError, match="'widht' was unexpected"):
        jsonschema.validate({"speculative": {"backend": "tree", "options": {"widht": 8}}}, schema)
    with pytest.raises(jsonschema.ValidationError, match="'depht' was unexpected"):
        jsonschema.validate(
            {"speculative": {"backend": "tree", "options": {"inner": {"depht": 2}}}}, schema)
    with pytest.raises(jsonschema.ValidationError, match="'width' was unexpected"):
        jsonschema.validate({"speculative": {"backend": "plain", "options": {"width": 8}}}, schema)
    with pytest.raises(jsonschema.ValidationError, match="'tre' is not one of"):
        jsonschema.validate({"speculative": {"backend": "tre"}}, schema)
