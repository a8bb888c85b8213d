"""The package's front doors load nothing heavy, and a missing optional dependency names its
extra (replug_jax/imports.py)."""

import subprocess
import sys

import pytest

from replug_jax.imports import MissingExtraError, exports, require


def test_a_missing_extra_is_named_with_its_install_command():
    with pytest.raises(MissingExtraError, match=r"the server needs the 'serve' extra .*"
                                                r"pip install 'replug-jax\[serve\]'"):
        require("replug_jax_no_such_module", "serve", "the server")
    assert require("json", "serve", "the server").dumps([1]) == "[1]"


def test_a_front_door_imports_each_name_on_first_use():
    getattr_, dir_, names = exports("replug_jax.retrieval", {"Passage": "corpus"})
    assert names == ["Passage"] and dir_() == ["Passage"]
    from replug_jax.retrieval.corpus import Passage

    assert getattr_("Passage") is Passage
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        getattr_("Nope")
    code = ("import sys\nfrom replug_jax.models import DEFAULT_LM\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
