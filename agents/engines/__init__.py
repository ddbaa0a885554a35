"""engines: the inference engines a sync agent drives, found by name in one registry.

ENGINES maps each engine type (what `[agent.engine] type` says) to "module:ConfigClass": the
engine's frozen keyword-only config dataclass, whose fields are the table's other keys and
whose `open()` starts the engine. A module is imported only when its type is first used, so
this registry (and `--help`, and loading an agent config) stays free of torch. Adding an engine
is one module here plus one line in ENGINES; the CLI's choices, config errors, docs checks and
the contract suite (tests/agents/engines/test_engines.py) all read the table.

    parse_engine_config(table)  the table checked into the engine's config (ConfigError naming
                                the key: an unknown type or option, a missing setting, a bad value)
    open_engine(table)          parse_engine_config(table).open(), checked against the Engine shape
    complete_from_store(table)  the table with what its engine takes from the agent's store when the
                                table leaves it out: a config class's `options_from_store` (the
                                reference engine's architecture, from the config.json a version carries)

Not here: the Engine protocol and the checks every engine shares (`base.py`), swap policies
(`swap_policy.py`), the agent that drives an engine (agents/sync.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from weightsync.errors import ConfigError
from weightsync.settings import build_table, check_known_keys, required_fields

if TYPE_CHECKING:
    from weightsync.agents.engines.base import Engine

__all__ = [
    "ENGINES",
    "complete_from_store",
    "engine_config_class",
    "engine_types",
    "open_engine",
    "parse_engine_config",
]

ENGINES: dict[str, str] = {
    "reference": "weightsync.agents.engines.reference_server:ReferenceServerConfig",
    "safetensors_dir": "weightsync.agents.engines.safetensors_dir:SafetensorsDirConfig",
    "sglang": "weightsync.agents.engines.sglang:SGLangEngineConfig",
    "vllm": "weightsync.agents.engines.vllm:VllmEngineConfig",
}

_SECTION = "[agent.engine]"


def engine_types() -> tuple[str, ...]:
    """The engine types this build knows (what `[agent.engine] type` may say), in ENGINES' order."""
    return tuple(ENGINES)


@functools.cache
def engine_config_class(type_name: str) -> type:
    """The config class of engine `type_name`, its module imported on first use.

    ConfigError on an unknown type, listing the known ones; TypeError when an ENGINES line names
    something that is not a config dataclass with an `open()`."""
    entry = ENGINES.get(type_name)
    if entry is None:
        close = difflib.get_close_matches(str(type_name), ENGINES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"{_SECTION} type {type_name!r} is not an engine type; {hint}known: {list(ENGINES)}")
    module, _, name = entry.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and callable(getattr(cls, "open", None))):
        raise TypeError(f"ENGINES[{type_name!r}] = {entry!r} is not an engine config dataclass with an open() method")
    return cls


def parse_engine_config(table: Mapping[str, Any], *, where: str = "engine settings") -> Any:
    """The engine config an `[agent.engine]` table describes ({"type": ..., options...}), every
    key checked; ConfigError naming the key and the fix."""
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: {_SECTION} must be a table with a type, got {table!r}")
    options = dict(table)
    if "type" not in options:
        raise ConfigError(f'{where}: {_SECTION} needs a type, e.g. type = "reference"; known: {list(ENGINES)}')
    type_name = options.pop("type")
    if not isinstance(type_name, str):
        raise ConfigError(f"{where}: {_SECTION} type must be a string, got {type_name!r}; known: {list(ENGINES)}")
    try:
        cls = engine_config_class(type_name)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
    howto = {key: f"the {type_name} engine needs it; add {key} = ... to {_SECTION}" for key in required_fields(cls)}
    return build_table(cls, options, where=where, section=_SECTION, howto=howto)


def complete_from_store(
    table: Mapping[str, Any], *, store: str, model: str, where: str = "engine settings"
) -> dict[str, Any]:
    """The `[agent.engine]` table with the options its engine's config class takes from the agent's
    `store` for `model` when the table leaves them out (`options_from_store(table, store=, model=,
    where=)`, a classmethod returning the options to add); the table as it is for an engine
    without one, or a table `parse_engine_config` will refuse anyway (no type, an unknown one)."""
    options = dict(table)
    try:
        cls = engine_config_class(options.get("type"))
    except ConfigError:
        return options
    from_store = getattr(cls, "options_from_store", None)
    if from_store is None:
        return options
    # A typo (model_dri) is reported as one, not answered by reading the store.
    known = {f.name for f in dataclasses.fields(cls)} | {"type"}
    check_known_keys(options, known, where=where, section=_SECTION)
    return {**options, **from_store(options, store=store, model=model, where=where)}


def open_engine(table: Mapping[str, Any], *, where: str = "engine settings") -> Engine:
    """The engine an `[agent.engine]` table describes, started (see parse_engine_config)."""
    from weightsync.agents.engines.base import check_engine  # torch: only once an engine opens

    engine = parse_engine_config(table, where=where).open()
    try:
        check_engine(engine)
    except TypeError:
        if callable(getattr(engine, "close", None)):
            engine.close()  # what it started must not outlive the refusal
        raise
    return engine
