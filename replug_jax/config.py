"""One way to configure a run: a file of named variants, ``file.py:variant`` or
``file.json:variant``, and ``--set key=value`` overrides coerced to each field's type. A
config made of pieces (fields whose default is itself a dataclass, as levanter's
``TrainLmConfig`` nests ``trainer`` and ``optimizer``) is one tree: ``--set
objective.gamma=1``, ``{"objective": {"gamma": 1}}`` and ``{"objective.gamma": 1}`` address
the same field. A class's ``RENAMED`` (``{"gamma": "objective.gamma"}``) names the new key of
each retired one, and a config that uses an old name is refused with it, in one line.
``replug train-lsr`` and every experiment script use it, and every problem is a
:class:`ConfigError` naming the key.

A Python config file defines ``CONFIGS = {"default": <dataclass instance or dict>, "tiny":
..., }``; a JSON one is an object of fields (variant ``default``) or ``{"configs": {variant:
{fields}}}``; a dict is read as JSON is (:func:`build`).

Mesh specifications are config text too (``"data=2,model=4"``, :func:`parse_mesh`), parsed
here without JAX so that a config can be read and checked where JAX is not loaded
(:mod:`replug_jax.sharding` builds the mesh).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.util
import json
import pathlib
import re
import typing


class ConfigError(ValueError):
    """A config that cannot be used: unknown file, variant or key, or a value of the wrong
    type; the message names it."""


@functools.cache
def _choices(cls) -> dict[str, tuple]:
    """The fields of ``cls`` annotated ``Literal[...]`` and the values each allows."""
    hints = typing.get_type_hints(cls)
    return {f.name: typing.get_args(hints[f.name]) for f in dataclasses.fields(cls)
            if typing.get_origin(hints[f.name]) is typing.Literal}


def choice_errors(obj) -> list[str]:
    """One message per field of the dataclass ``obj`` whose value is not one its
    ``Literal[...]`` annotation allows: the choices are stated once, in the annotation."""
    return [f"{name} must be one of {allowed}, got {getattr(obj, name)!r}"
            for name, allowed in _choices(type(obj)).items()
            if getattr(obj, name) not in allowed]


def _kind(field: dataclasses.Field) -> str:
    """The base type of a field as a word: 'int', 'float', 'bool', 'str', 'tuple' or ''."""
    text = field.type if isinstance(field.type, str) else \
        getattr(field.type, "__name__", str(field.type))
    text = text.replace("typing.", "")
    if text.startswith("Literal"):
        return "str"
    if text.startswith("float | str"):  # a number or a named choice (gamma="fitted")
        return "number_or_name"
    for kind in ("bool", "int", "float", "str", "tuple"):
        if text == kind or text.startswith(kind + " |") or text.startswith(kind + "["):
            return kind
    return ""


def coerce(field: dataclasses.Field, text: str):
    """``text`` as the field's type: JSON where it parses (numbers, lists, null, booleans),
    ``true``/``false`` for booleans, the raw text for strings."""
    kind, optional = _kind(field), "None" in str(field.type)
    if optional and text in ("null", "None", "none"):
        return None
    if kind == "str":
        return text
    if kind == "number_or_name":
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return text
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{field.name} expects a number or a name, got {text!r}")
        return float(value)
    if kind == "bool":
        if text.lower() == "true":
            return True
        if text.lower() == "false":
            return False
        raise ConfigError(f"{field.name} must be true or false"
                          + (" or null" if optional else "") + f", got {text!r}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        if kind in ("int", "float", "tuple"):
            raise ConfigError(f"{field.name} expects {kind}, got {text!r}") from None
        return text
    if kind == "int":
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(f"{field.name} expects an integer, got {text!r}")
    elif kind == "float":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{field.name} expects a number, got {text!r}")
        value = float(value)
    elif kind == "tuple":
        value = tuple(value) if isinstance(value, list) else (value,)
    return value


def typed(field: dataclasses.Field, value):
    """A JSON or Python ``value`` checked against the field's type (a :class:`ConfigError`
    naming the key otherwise): ``{"k": "4"}``, ``{"k": 4.5}`` or ``{"gamma": null}`` are
    refused when the config is read, not after the models load."""
    kind, optional = _kind(field), "None" in str(field.type)
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{field.name} cannot be null")
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "int" and number and float(value).is_integer():
        return int(value)
    if kind == "float" and number:
        return float(value)
    if kind == "number_or_name" and (number or isinstance(value, str)):
        return float(value) if number else value
    if kind == "str" and isinstance(value, str) or kind == "bool" and isinstance(value, bool):
        return value
    if kind == "":  # a type this check does not know: the dataclass's own checks decide
        return value
    if kind == "tuple" and isinstance(value, (list, tuple)):
        return tuple(tuple(v) if isinstance(v, list) else v for v in value)
    if kind == "tuple" and not isinstance(value, dict):  # one item, as `--set` takes it
        return (value,)
    expects = {"int": "an integer", "float": "a number", "str": "a string",
               "bool": "true or false", "number_or_name": "a number or a name",
               "tuple": "a list"}[kind]
    raise ConfigError(f"{field.name} expects {expects}"
                      + (" or null" if optional else "") + f", got {value!r}")


def pieces(cls) -> dict:
    """The nested pieces of a config class: ``{field name: piece class}`` for every field
    whose default is a dataclass, a class (``lm: LMConfig = field(default_factory=LMConfig)``)
    or a ready instance (``train: LSRConfig = field(default_factory=lambda: TRAIN)``)."""
    out = {}
    for f in dataclasses.fields(cls):
        made = f.default_factory
        if made is dataclasses.MISSING:
            continue
        kind = made if isinstance(made, type) else type(made())
        if dataclasses.is_dataclass(kind):
            out[f.name] = kind
    return out


def leaves(cls, prefix: str = "") -> list[str]:
    """Every settable key of ``cls``, pieces' fields dotted (``objective.gamma``)."""
    nested = pieces(cls)
    return [key for f in dataclasses.fields(cls)
            for key in (leaves(nested[f.name], f"{prefix}{f.name}.") if f.name in nested
                        else [prefix + f.name])]


def dotted(tree: dict, prefix: str = "") -> dict:
    """A config's JSON tree as ``{dotted key: value}`` (``{"objective.gamma": 0.1, ...}``)."""
    out = {}
    for key, value in tree.items():
        out.update(dotted(value, f"{prefix}{key}.") if isinstance(value, dict)
                   else {prefix + key: value})
    return out


def field_at(cls, key: str) -> tuple[tuple[str, ...], dataclasses.Field]:
    """``(path, field)`` of a dotted key; a :class:`ConfigError` naming the new key for a
    name the class has retired (``cls.RENAMED``), or the nearest known keys otherwise."""
    renamed = getattr(cls, "RENAMED", {})
    if key in renamed:
        raise ConfigError(f"config key {key!r} is now {renamed[key]!r}")
    path, owner = key.split("."), cls
    for i, name in enumerate(path):
        fields = {f.name: f for f in dataclasses.fields(owner)}
        nested = pieces(owner)
        if name not in fields:
            break
        if i == len(path) - 1 and name not in nested:
            return tuple(path), fields[name]
        if name not in nested:
            break
        owner = nested[name]
    raise ConfigError(f"unknown config key {key!r}{_nearest(key, leaves(cls))}")


def build(cls, values: dict, where: str = ""):
    """``cls`` from a JSON/Python tree: pieces as nested objects or dotted keys, leaves
    checked against their field's type (:func:`typed`)."""
    tree: dict = {}
    for key, value in values.items():
        head, dot, rest = key.partition(".")
        value = dict(value) if isinstance(value, dict) else value
        if dot:
            value, key = {rest: value}, head
        if isinstance(value, dict) and isinstance(tree.get(key), dict):
            tree[key].update(value)
        elif key in tree:
            raise ConfigError(f"config key {where + key!r} given twice")
        else:
            tree[key] = value
    nested, fields, kwargs = pieces(cls), {f.name: f for f in dataclasses.fields(cls)}, {}
    renamed = getattr(cls, "RENAMED", {})
    for name, value in tree.items():
        if name in renamed and not (name in nested and isinstance(value, dict)):
            raise ConfigError(f"config key {where + name!r} is now {where + renamed[name]!r}")
        if name not in fields:
            raise ConfigError(f"unknown config key {where + name!r}"
                              f"{_nearest(where + name, leaves(cls, where))}")
        if name in nested:
            if isinstance(value, nested[name]):
                kwargs[name] = value
            elif isinstance(value, dict) and isinstance(fields[name].default_factory, type):
                kwargs[name] = build(nested[name], value, f"{where}{name}.")
            elif isinstance(value, dict):  # a piece whose default is a template: changed
                kwargs[name] = _within(updated, fields[name].default_factory(),
                                       dotted(value), f"{where}{name}.")
            else:
                raise ConfigError(f"{where}{name} is a group of settings: give an object "
                                  f"of {', '.join(leaves(nested[name], where + name + '.'))}")
        else:
            kwargs[name] = typed(fields[name], value)
    try:
        return cls(**kwargs)
    except ValueError as err:  # the dataclass's own validation
        raise ConfigError(f"{where.rstrip('.') + ': ' if where else ''}{err}") from None


def _within(change, cfg, values, where: str):
    """``change(cfg, values)``, its :class:`ConfigError` naming keys under ``where``."""
    try:
        return change(cfg, values)
    except ConfigError as err:
        raise ConfigError(f"{where.rstrip('.')}: {err}") from None


def from_record(cls, record: dict):
    """``cls`` from a stored record (a results file's or a run's ``config``), which may use
    the names ``cls.RENAMED`` retired: records are read as they were written, where a config
    file or ``--set`` with those names is refused."""
    renamed, nested = getattr(cls, "RENAMED", {}), pieces(cls)
    return build(cls, {key if key not in renamed or (key in nested and isinstance(value, dict))
                       else renamed[key]: value for key, value in record.items()})


def replace_all(cfg, changes: dict):
    """``cfg`` with ``changes`` (``{path tuple: value}``) applied at once: each piece is
    replaced (and checked) once with all of its changes, then the whole, so that settings
    that only hold together (``supervision.kind=pool`` with its ``train_pool``) can be set
    together."""
    here = {path[0]: value for path, value in changes.items() if len(path) == 1}
    inner: dict = {}
    for path, value in changes.items():
        if len(path) > 1:
            inner.setdefault(path[0], {})[path[1:]] = value
    for name, sub in inner.items():
        here[name] = replace_all(getattr(cfg, name), sub)
    return dataclasses.replace(cfg, **here)


def _set_together(cfg, items, convert):
    """``cfg`` with each ``(dotted key, value)`` of ``items`` set at once, each value made
    its field's type by ``convert(field, value)``."""
    paths = {}
    for key, value in items:
        path, field = field_at(type(cfg), key)
        paths[path] = convert(field, value)
    try:
        return replace_all(cfg, paths)
    except ValueError as err:  # the dataclasses' own validation
        raise ConfigError(str(err)) from err


def updated(cfg, changes: dict):
    """``cfg`` with ``{key: value}`` applied together, keys dotted (``{"objective.gamma":
    0.5, "total_steps": 10}``), values checked as a JSON config's are (:func:`typed`)."""
    return _set_together(cfg, changes.items(), typed)


def apply_overrides(cfg, overrides: typing.Iterable[str]):
    """``cfg`` with ``key=value`` overrides applied together (later ones win);
    ``piece.name=value`` sets a piece's field (:func:`field_at`), the text coerced to its
    type (:func:`coerce`)."""
    items = []
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not key=value")
        items.append((key, text))
    return _set_together(cfg, items, coerce)


def _nearest(key: str, names) -> str:
    """``"; did you mean 'a' or 'b'?"`` (the closest names), or the known names when none is
    close."""
    close = difflib.get_close_matches(key, list(names), n=3, cutoff=0.6)
    if close:
        return "; did you mean " + " or ".join(repr(c) for c in close) + "?"
    return f"; known keys: {', '.join(sorted(names))}"


def _line(err: BaseException, path: pathlib.Path) -> str:
    """The line of ``path`` where ``err`` was raised (its traceback's last frame there)."""
    tb, line = err.__traceback__, "?"
    while tb is not None:
        if pathlib.Path(tb.tb_frame.f_code.co_filename) == path.resolve() or \
                tb.tb_frame.f_code.co_filename == str(path):
            line = str(tb.tb_lineno)
        tb = tb.tb_next
    return line


def read_variants(path: str | pathlib.Path) -> dict:
    """The ``CONFIGS`` dict of a config file: a Python file's ``CONFIGS``, or a JSON file's
    ``"configs"`` object (``{variant: {field: value}}``), or a JSON object of fields (its one
    variant is ``default``)."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: no such config file")
    if path.suffix == ".json":
        try:
            obj = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{path}:{err.lineno}: not valid JSON ({err.msg})") from None
        if not isinstance(obj, dict):
            raise ConfigError(f"{path}: a JSON config is an object of fields, or "
                              '{"configs": {variant: {fields}}}')
        configs = obj["configs"] if "configs" in obj else {"default": obj}
        if not isinstance(configs, dict) or not all(isinstance(c, dict)
                                                    for c in configs.values()):
            raise ConfigError(f'{path}: "configs" must map each variant to an object of fields')
        return configs
    spec = importlib.util.spec_from_file_location(f"_replug_cfg_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except TypeError as err:  # a misspelt field: LSRConfig(totl_steps=...)
        bad = re.search(r"(\w+)\.__init__\(\) got an unexpected keyword argument '(\w+)'",
                        str(err))
        cls = bad and next((v for v in vars(module).values() if isinstance(v, type)
                            and v.__name__ == bad[1] and dataclasses.is_dataclass(v)), None)
        if cls is None:
            raise ConfigError(f"{path}:{_line(err, path)}: {err}") from None
        raise ConfigError(f"{path}:{_line(err, path)}: {bad[1]} has no field {bad[2]!r}"
                          f"{_nearest(bad[2], [f.name for f in dataclasses.fields(cls)])}"
                          ) from None
    except (SyntaxError, NameError, AttributeError, ValueError, ImportError) as err:
        line = err.lineno if isinstance(err, SyntaxError) else _line(err, path)
        raise ConfigError(f"{path}:{line}: {type(err).__name__}: {err}") from None
    configs = getattr(module, "CONFIGS", None)
    if not isinstance(configs, dict):
        raise ConfigError(f"{path}: defines no CONFIGS dict")
    return configs


def select(configs: dict, variant: str, overrides: typing.Iterable[str] = (), *,
           cls=None, where: str = ""):
    """``configs[variant]`` (a dataclass instance, or a dict of ``cls`` fields) with
    overrides."""
    if variant not in configs:
        raise ConfigError(f"{where}no variant {variant!r} (has: {', '.join(sorted(configs))})")
    cfg = configs[variant]
    if isinstance(cfg, dict):
        if cls is None:
            raise ConfigError(f"{where}{variant}: a dict variant needs a config class")
        try:
            cfg = build(cls, cfg)
        except ConfigError as err:
            raise ConfigError(f"{where}{variant}: {err}") from None
    return apply_overrides(cfg, overrides)


def load(spec: str, overrides: typing.Iterable[str] = (), *, cls=None,
         default_file: str | pathlib.Path | None = None):
    """``path/to/config.py[:variant]`` (or a bare ``variant`` of ``default_file``) ->
    ``(config, variant)``."""
    path_text, sep, variant = spec.partition(":")
    if not sep and not path_text.endswith((".py", ".json")):
        if default_file is None:
            raise ConfigError(f"{spec!r}: give a config file, path/to/config.py[:variant] "
                              "or config.json[:variant]")
        path_text, variant = str(default_file), spec
    variant = variant or "default"
    configs = read_variants(path_text)
    return select(configs, variant, overrides, cls=cls, where=f"{path_text}: "), variant


DATA, FSDP, MODEL = "data", "fsdp", "model"
MESH_AXES = (DATA, FSDP, MODEL)


def parse_mesh(text: str) -> dict[str, int]:
    """``"data=2,model=4"`` -> ``{"data": 2, "model": 4}``; axes are ``data``, ``fsdp`` and
    ``model``, each at most once, each a positive integer."""
    out: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, eq, size = part.partition("=")
        name = name.strip()
        if not eq or name not in MESH_AXES or name in out:
            raise ValueError(f"mesh {text!r}: expected axis=size pairs such as "
                             f"'data=2,model=4' with axes from {', '.join(MESH_AXES)}, each "
                             "at most once")
        try:
            out[name] = int(size)
        except ValueError:
            raise ValueError(f"mesh {text!r}: size of {name!r} is not an integer") from None
        if out[name] < 1:
            raise ValueError(f"mesh {text!r}: size of {name!r} must be at least 1")
    if not out:
        raise ValueError(f"mesh {text!r}: no axes given (e.g. 'model=8')")
    return out


def format_mesh(shape) -> str:
    return ",".join(f"{k}={v}" for k, v in dict(shape).items())
