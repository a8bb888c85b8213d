"""The retrieval temperature τ of ``λ = softmax(s(d, x) / τ)`` (paper Eq. 2) fitted on a
user's dev file, kept beside the index it was fitted with (``retrieval_temperature.json``) or
in an exported retriever's ``replug.json`` (``retrieval_temperature``): one record format in
both places (:func:`record`: ``{"temperature", "fit": evidence, "query_encoder"?}``).

τ depends on the query encoder (the scale of its similarities), the corpus and the LM, so the
record names all three. :meth:`~replug_jax.retrieval.encoder.Retriever.for_index` applies it
when the query encoder is the one it was fitted for; ``replug ask``, ``generate``, ``score``
and ``eval`` all load retrievers that way, and every result's settings say where τ came
from (``retrieval_temperature_source``). An explicit ``--retrieval-temperature`` wins.
"""

from __future__ import annotations

import json
import pathlib
import warnings

FILE = "retrieval_temperature.json"
SETTINGS_KEY = "retrieval_temperature"  # its key in a retriever's replug.json


def record(temperature: float, evidence: dict, query_encoder: dict | None = None) -> dict:
    """One τ record: the τ, what it was fitted on (``evidence``: the file, the LM, the
    log-likelihoods at τ = 1 and at the fit), and, beside an index that several query encoders
    may share, the query encoder it was fitted for."""
    if not temperature > 0:
        raise ValueError(f"the retrieval temperature must be > 0, got {temperature}")
    out = {"temperature": float(temperature), "fit": dict(evidence)}
    if query_encoder is not None:
        out["query_encoder"] = query_encoder
    return out


def in_settings(settings: dict) -> dict | None:
    """The τ record of a retriever's ``replug.json``, or None: its ``retrieval_temperature``,
    or the ``temperature`` and ``temperature_fit`` keys of earlier releases read as one."""
    if SETTINGS_KEY in settings:
        return settings[SETTINGS_KEY]
    if "temperature" in settings:
        return record(settings["temperature"], settings.get("temperature_fit", {}))
    return None


def query_fingerprint(identity: dict) -> str:
    """The query encoder's fingerprint (a two-tower retriever's query tower, else the one
    encoder) from :attr:`Retriever.identity`."""
    return identity.get("query_fingerprint", identity["fingerprint"])


def _records(path: pathlib.Path) -> dict[str, dict]:
    """Every τ record of the file by query-encoder fingerprint. One index can serve several
    query encoders (a query-tower-only retriever shares its base's passages), so each keeps
    its own τ; a file of the single-record format of earlier versions reads as one entry."""
    if not path.is_file():
        return {}
    try:
        stored = json.loads(path.read_text())
        records = stored["fits"] if "fits" in stored else {
            stored["query_encoder"]["fingerprint"]: stored}
        for record in records.values():
            float(record["temperature"]), record["query_encoder"]["fingerprint"]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: not a readable τ record ({err}); delete it or fit again "
                         "with `replug fit-tau`") from err
    return records


def write(index_dir: str | pathlib.Path, temperature: float, retriever_identity: dict,
          evidence: dict) -> pathlib.Path:
    """Store τ with the index for this query encoder (the records of other query encoders
    are kept); ``evidence`` says what it was fitted on (the file, the LM, the
    log-likelihoods at τ = 1 and at the fit)."""
    from replug_jax.fileio import write_json_atomic

    path = pathlib.Path(index_dir) / FILE
    records = _records(path)
    fingerprint = query_fingerprint(retriever_identity)
    records[fingerprint] = record(temperature, evidence, {
        "source": retriever_identity.get("query_source", retriever_identity["source"]),
        "fingerprint": fingerprint})
    write_json_atomic({"fits": records}, path)
    return path


def read(index_dir: str | pathlib.Path, retriever_identity: dict) -> tuple[float, str] | None:
    """``(τ, where it came from)`` stored with the index for this query encoder, or None (no
    fit stored, or only fits for other query encoders: a note says they are not used)."""
    path = pathlib.Path(index_dir) / FILE
    records = _records(path)
    record = records.get(query_fingerprint(retriever_identity))
    if record is None:
        if records:
            others = ", ".join(f"τ = {r['temperature']:g} for "
                               f"{r['query_encoder'].get('source')}" for r in records.values())
            warnings.warn(f"{path}: no τ fitted for this query encoder ({others}: not used)",
                          stacklevel=2)
        return None
    fit = record.get("fit", {})
    return float(record["temperature"]), (
        f"fitted on {fit.get('data', '?')} with {fit.get('lm', '?')} "
        f"(stored with the index, {FILE})")
