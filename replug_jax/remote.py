"""Remote files and folders (``gs://``, ``s3://``, ``az://``, ``hf://``) as local copies.

An index, a retriever or an LM kept in a bucket is read through ``etils.epath``, the file layer
orbax reads checkpoints through (``gs://`` needs ``gcsfs``, ``s3://`` ``s3fs``: the ``gcs``
extra installs the first). FAISS memory-maps its files and safetensors opens them by name, so a
remote source is copied to local disk once, under ``~/.cache/replug_jax/remote/`` (or
``$REPLUG_REMOTE_CACHE``), and read from there: files are streamed into a temporary folder
that is renamed into place when every file is in, so an interrupted copy is never taken for a
whole one, and a complete copy is reused while the remote listing (names and sizes) is the
same. Local paths pass through untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil

SCHEMES = ("gs://", "s3://", "az://", "hf://")  # etils.epath's remote schemes
LISTING = ".replug-remote.json"


def is_remote(path) -> bool:
    return str(path).startswith(SCHEMES)


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("REPLUG_REMOTE_CACHE",
                                       pathlib.Path.home() / ".cache" / "replug_jax" / "remote"))


def _listing(src, prefix: str = "") -> dict[str, int]:
    """``{relative name: size}`` of a remote file (name "") or of every file under a folder
    (by listing each folder: fsspec's walk drops the scheme from the paths it yields)."""
    if not src.is_dir():
        return {prefix: src.stat().length}
    out = {}
    for child in sorted(src.iterdir()):
        out.update(_listing(child, f"{prefix}/{child.name}" if prefix else child.name))
    return out


def local_copy(path, *, progress: bool = True) -> pathlib.Path:
    """``path`` itself when local; a remote file's or folder's local copy, made or reused
    (module docstring)."""
    if not is_remote(path):
        return pathlib.Path(path)
    from etils import epath
    from tqdm.auto import tqdm

    url = str(path).rstrip("/")
    src = epath.Path(url)
    try:
        if not src.exists():
            raise FileNotFoundError(f"{url}: no such remote file or folder")
        listing = _listing(src)
    except (ImportError, ValueError) as err:  # fsspec has no backend for the scheme
        raise RuntimeError(f"{url}: cannot read this remote path ({err}); install its "
                           "filesystem (gs://: pip install gcsfs, or the gcs extra)") from err
    name = url.rsplit("/", 1)[-1] or "root"
    dest = cache_root() / hashlib.sha256(url.encode()).hexdigest()[:16] / name
    record = dest.parent / LISTING
    if dest.exists() and record.exists() and json.loads(record.read_text()) == listing:
        return dest
    tmp = dest.parent / f".{name}.partial{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    if "" not in listing:  # a folder (an empty one included)
        tmp.mkdir(parents=True)
    bar = tqdm(total=sum(listing.values()), unit="B", unit_scale=True, desc=f"copying {url}",
               disable=not progress)
    for rel in listing:
        out = tmp / rel if rel else tmp
        out.parent.mkdir(parents=True, exist_ok=True)
        with (src / rel if rel else src).open("rb") as fin, open(out, "wb") as fout:
            while chunk := fin.read(16 << 20):
                fout.write(chunk)
                bar.update(len(chunk))
    bar.close()
    record.unlink(missing_ok=True)  # the old copy stops counting before it is replaced
    if dest.is_dir():
        shutil.rmtree(dest)
    elif dest.exists():
        dest.unlink()
    os.replace(tmp, dest)
    record.write_text(json.dumps(listing))
    return dest
