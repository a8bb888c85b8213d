"""replug_jax/cli/common.py: the argument types every command shares refuse bad values in
one line naming what they expected."""

import argparse

import pytest

from replug_jax.cli.common import (
    existing_dir,
    existing_file,
    mesh_shape,
    non_negative_float,
    port_number,
    positive_int,
    unit_interval,
)


def test_number_types_take_their_range_and_say_what_they_expected():
    assert positive_int("3") == 3 and non_negative_float("0") == 0.0
    assert unit_interval("1") == 1.0 and port_number("8080") == 8080
    for parse, text, message in ((positive_int, "0", "must be positive, got 0"),
                                 (positive_int, "2.5", "expected int, got '2.5'"),
                                 (unit_interval, "0", r"must be in \(0, 1\], got 0.0"),
                                 (port_number, "70000", "must be in 1..65535, got 70000")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            parse(text)


def test_paths_and_meshes(tmp_path):
    (tmp_path / "f.txt").write_text("x")
    assert existing_file(str(tmp_path / "f.txt")) == tmp_path / "f.txt"
    assert existing_dir(str(tmp_path)) == tmp_path
    with pytest.raises(argparse.ArgumentTypeError, match="no such file"):
        existing_file(str(tmp_path / "missing"))
    with pytest.raises(argparse.ArgumentTypeError, match="no such directory"):
        existing_dir(str(tmp_path / "f.txt"))
    assert mesh_shape("data=2,model=4") == {"data": 2, "model": 4}
    with pytest.raises(argparse.ArgumentTypeError):
        mesh_shape("data=0")
