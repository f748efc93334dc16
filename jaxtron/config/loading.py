"""Loading configs: dataclass defaults <- YAML preset or file <- dotted overrides (OmegaConf against the schema,
so unknown keys and wrong types are rejected with the field's dotted name); the config reference page."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional, Sequence

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from jaxtron.config.schema import CONFIG_DIR, Config, ConfigError, ParallelConfig
from jaxtron.config.validation import validate

def _omegaconf_error(err: OmegaConfBaseException, origin: str) -> ConfigError:
    key = getattr(err, "full_key", None) or "config"
    msg = str(getattr(err, "msg", None) or err).splitlines()[0]
    if "not in" in msg and "Key" in msg:
        msg = "unknown field"
    return ConfigError(key, f"{msg} (from {origin})")


def preset_path(name_or_path: str) -> str:
    """A preset name ('tiny', 'llama3_8b') or a path to a YAML file."""
    if os.path.exists(name_or_path):
        return name_or_path
    candidate = os.path.join(CONFIG_DIR, f"{name_or_path}.yaml")
    if os.path.exists(candidate):
        return candidate
    raise ConfigError("--config", f"no such file or preset: {name_or_path!r}")


def load(path: Optional[str] = None, overrides: Sequence[str] = (), validate_config: bool = True) -> Config:
    """Load a config: dataclass defaults <- YAML file <- dotted overrides.

    The dataclass defaults are the ``tiny`` preset (configs/tiny.yaml spells them out), so ``load()``
    works from an installed package with no configs/ folder."""
    schema = OmegaConf.structured(Config)
    raw: Any = {}
    if path is not None:
        path = preset_path(path)
        try:
            with open(path) as f:
                raw = yaml.safe_load(f) or {}
        except (OSError, yaml.YAMLError) as err:
            raise ConfigError("--config", f"cannot read {path}: {str(err).splitlines()[0]}") from None
    else:
        path = "defaults"
    if not isinstance(raw, dict):
        raise ConfigError("--config", f"{path} must hold a mapping of sections, got {type(raw).__name__}")
    merged = schema
    try:
        merged = OmegaConf.merge(merged, OmegaConf.create(raw))
    except OmegaConfBaseException as err:
        raise _omegaconf_error(err, path) from None
    for item in overrides:
        if "=" not in item:
            raise ConfigError(item, "an override must look like section.field=value")
        try:
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as err:
            raise _omegaconf_error(err, f"override {item!r}") from None
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise _omegaconf_error(err, path) from None
    if validate_config:
        validate(cfg)
    return cfg


def load_config(path: Optional[str] = None, overrides: Sequence[str] | Mapping[str, Any] = (),
                validate_config: bool = True) -> Config:
    """Load a :class:`Config`: the dataclass defaults (the ``tiny`` preset), then the YAML ``path`` (a preset
    name such as ``"llama3_8b"`` or a file), then ``overrides``: dotted ``"section.field=value"`` strings, as
    on the command line, or a dict ``{"section.field": value}``. Raises :class:`ConfigError`, whose message
    starts with the offending field, on unknown fields, wrong types and inconsistent values.

        cfg = jaxtron.load_config("tiny", {"train.steps": 30, "parallel.fsdp": 2})"""
    if isinstance(overrides, Mapping):
        items = []
        for key, value in overrides.items():
            if isinstance(value, (dict, list, tuple)):
                raise ConfigError(str(key), f"override values must be scalars, got {type(value).__name__}")
            text = "null" if value is None else (str(value).lower() if isinstance(value, bool) else str(value))
            items.append(f"{key}={text}")
        overrides = items
    elif isinstance(overrides, str):
        overrides = [overrides]
    return load(None if path is None else os.fspath(path), list(overrides), validate_config)


def inference_parallel(overrides: Sequence[str] = ()) -> ParallelConfig:
    """The ``parallel`` section of a generation or evaluation run: ``parallel.*`` ``overrides`` (e.g.
    ``["parallel.tensor=2"]``) on the defaults, data parallelism 1 unless they set it."""
    bad = [o for o in overrides if not o.startswith("parallel.")]
    if bad:
        raise ConfigError(bad[0].split("=")[0], "only parallel.* overrides apply to generation/evaluation")
    return load(None, ["parallel.data=1", *overrides], validate_config=False).parallel


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def to_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def from_dict(d: dict) -> Config:
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(d)))
    except OmegaConfBaseException as err:
        raise _omegaconf_error(err, "dict") from None


def _leaf_fields(cls: type, prefix: str = ""):
    """(dotted name, default value, doc) for every leaf field of the dataclass ``cls``."""
    inst = cls()
    for f in dataclasses.fields(cls):
        value = getattr(inst, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _leaf_fields(type(value), name + ".")
        else:
            yield name, value, f.metadata.get("doc", "")


def fields_help(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """(dotted name, default, doc) for every leaf field, for ``--help`` and the docs."""
    return [(name, repr(value), doc) for name, value, doc in _leaf_fields(cls, prefix)]


REFERENCE_HEADER = """\
# Config reference

<!-- Generated from the dataclass docs in jaxtron/config/schema.py by `python scripts/gen_config_reference.py`;
     do not edit by hand (tests/test_docs.py checks it is current). -->

Every field of `jaxtron.config.Config`, its default (the `tiny` preset) and what it does. Set fields in a
YAML file (`--config FILE`, sections as mappings), as dotted overrides on the command line
(`python -m jaxtron.train section.field=value`), or in Python with
`jaxtron.load_config(path, {"section.field": value})`. Defaults are written as in YAML. A bad value stops
the program before anything is compiled, with one line that starts with the field's name.
"""


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;").replace("\n", " ")


def reference_markdown() -> str:
    """The config reference (``docs/config.md``): one table per section, from the dataclass field docs."""
    out = [REFERENCE_HEADER]
    inst = Config()
    for section in dataclasses.fields(Config):
        out.append(f"## `{section.name}`\n")
        out.append(f"{section.metadata.get('doc', '')}\n")
        out.append("| field | default | description |")
        out.append("|---|---|---|")
        for name, default, doc in _leaf_fields(type(getattr(inst, section.name)), section.name + "."):
            text = yaml.safe_dump(default, default_flow_style=True).strip().removesuffix("...").strip()
            out.append(f"| `{name}` | `{_md_cell(text)}` | {_md_cell(doc)} |")
        out.append("")
    return "\n".join(out)
