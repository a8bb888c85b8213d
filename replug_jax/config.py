"""One way to configure a run: a file of named variants, ``file.py:variant`` or
``file.json:variant``, and ``--set key=value`` overrides coerced to each field's type. A
config class that groups its fields into pieces (``PIECES = {"objective": {"gamma":
"gamma", ...}, "lm": {"dtype": "lm_dtype", ...}}``: a piece's name for each field it holds)
also takes dotted keys, ``objective.gamma=1``, ``lm.dtype=bfloat16`` or ``{"objective":
{"gamma": 1}}``: the field is stored flat, so every config written before the pieces existed
loads and hashes as it did.
``replug train-lsr`` and every experiment script use it, and every problem is a
:class:`ConfigError` naming the key.

A Python config file defines ``CONFIGS = {"default": <dataclass instance or dict>, "tiny":
..., }``; a JSON one is an object of fields (variant ``default``) or ``{"configs": {variant:
{fields}}}``.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import pathlib
import re
import typing


class ConfigError(ValueError):
    """A config that cannot be used: unknown file, variant or key, or a value of the wrong
    type; the message names it."""


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


def flat_key(cls, key: str) -> str:
    """The field a key names: itself, or for ``piece.name`` the field ``cls.PIECES[piece]``
    maps ``name`` to (a :class:`ConfigError` naming the nearest known keys otherwise)."""
    names = [f.name for f in dataclasses.fields(cls)]
    pieces = getattr(cls, "PIECES", {})
    piece, dot, name = key.partition(".")
    if dot and piece in pieces:
        if name in pieces[piece]:
            return pieces[piece][name]
        raise ConfigError(f"unknown config key {key!r}"
                          f"{_nearest(key, [f'{piece}.{n}' for n in pieces[piece]])}")
    if key not in names:
        dotted = [f"{p}.{n}" for p, members in pieces.items() for n in members]
        raise ConfigError(f"unknown config key {key!r}{_nearest(key, names + dotted)}")
    return key


def flatten(cls, values: dict) -> dict:
    """A dict of fields with its pieces' nested dicts and dotted keys made flat."""
    pieces, flat = getattr(cls, "PIECES", {}), {}
    for key, value in values.items():
        if key in pieces and isinstance(value, dict):
            for name, inner in value.items():
                flat[flat_key(cls, f"{key}.{name}")] = inner
        else:
            flat[flat_key(cls, key)] = value
    return flat


def apply_overrides(cfg, overrides: typing.Iterable[str]):
    """``cfg`` with ``key=value`` overrides applied (later ones win); ``piece.name=value``
    sets a piece's field (:func:`flat_key`)."""
    fields = {f.name: f for f in dataclasses.fields(cfg)}
    changes = {}
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep:
            raise ConfigError(f"override {item!r} is not key=value")
        key = flat_key(type(cfg), key)
        changes[key] = coerce(fields[key], text)
    try:
        return dataclasses.replace(cfg, **changes)
    except ValueError as err:  # the dataclass's own validation
        raise ConfigError(str(err)) from err


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
            fields = {f.name: f for f in dataclasses.fields(cls)}
            values = {key: typed(fields[key], value)
                      for key, value in flatten(cls, cfg).items()}
        except ConfigError as err:
            raise ConfigError(f"{where}{variant}: {err}") from None
        try:
            cfg = cls(**values)
        except ValueError as err:
            raise ConfigError(str(err)) from err
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
