"""Small files in and out: JSONL reading, and atomic writes, the one way every module writes a
file that must never be seen half written: write a temporary sibling, then rename it over the
target (``os.replace`` is atomic on POSIX and Windows), so a killed process leaves the old file
or the new one, never a torn one.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: str | pathlib.Path, suffix: str = "") -> Iterator[pathlib.Path]:
    """Yield a temporary path next to ``path``; on success it replaces ``path``, on an error it
    is removed. ``suffix`` keeps an extension that a writer insists on (``np.save``: ``.npy``).
    The name carries the process id, so processes writing the same file never collide. The
    file gets the mode the umask gives a new file (a writer's private 0600 would leave a
    release unreadable to the other users of a machine)."""
    path = pathlib.Path(path)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}{suffix}")
    try:
        yield tmp
        if tmp.is_file():  # a writer's private mode (safetensors: 0600) becomes the usual one
            os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_text_atomic(text: str, path: str | pathlib.Path) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json_atomic(obj, path: str | pathlib.Path) -> None:
    write_text_atomic(json.dumps(obj, indent=2, sort_keys=True) + "\n", path)


def write_jsonl_atomic(rows, path: str | pathlib.Path) -> None:
    """One JSON object per line (UTF-8, not ASCII-escaped), written atomically."""
    write_text_atomic("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), path)


def replace_dir(tmp: pathlib.Path, out: pathlib.Path) -> None:
    """Put the finished folder ``tmp`` at ``out``, replacing an older one: ``out`` is always
    either the old folder or the new one."""
    if out.exists():
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old)
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp.rename(out)


def read_jsonl(path: str | pathlib.Path) -> list[dict]:
    """Objects of a JSONL file (blank lines skipped); bad lines and empty files raise."""
    return [row for _, row in read_jsonl_lines(path)]


def read_jsonl_lines(path: str | pathlib.Path) -> list[tuple[int, dict]]:
    """``(line number, object)`` of every non-blank line of a JSONL file, lines counted from 1
    as physical lines (blank ones included) and split at ``\n`` only, as the corpus reader
    does (``str.splitlines`` would also split inside a JSON string at U+2028 and other
    Unicode line separators, which JSON allows unescaped)."""
    path = pathlib.Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such data file")
    rows = []
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        lineno = raw[:err.start].count(b"\n") + 1
        raise ValueError(f"{path}:{lineno}: not UTF-8 (byte {raw[err.start]:#04x} at offset "
                         f"{err.start}); save the file as UTF-8") from None
    for lineno, line in enumerate(text.split("\n"), 1):
        if line.strip():
            try:
                rows.append((lineno, json.loads(line)))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err})") from err
    if not rows:
        raise ValueError(f"{path}: no examples")
    return rows
