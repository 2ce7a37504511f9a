"""Datatype.Pack/Unpack (native and external32), type codes and decoding, in-process."""

from __future__ import annotations

import array

import pytest

from vpool.mpi import MPI


def test_pack_unpack_round_trip() -> None:
    ints = array.array("i", [1, -2, 3])
    dbls = array.array("d", [0.5, 1.5])
    size = MPI.INT.Pack_size(3, MPI.COMM_SELF) + MPI.DOUBLE.Pack_size(2, MPI.COMM_SELF)
    assert size == 3 * 4 + 2 * 8
    buf = bytearray(size)
    pos = MPI.INT.Pack(ints, buf, 0, MPI.COMM_SELF)
    pos = MPI.DOUBLE.Pack(dbls, buf, pos, MPI.COMM_SELF)
    assert pos == size
    out_i, out_d = array.array("i", [0] * 3), array.array("d", [0.0] * 2)
    pos = MPI.INT.Unpack(buf, 0, out_i, MPI.COMM_SELF)
    pos = MPI.DOUBLE.Unpack(buf, pos, out_d, MPI.COMM_SELF)
    assert (list(out_i), list(out_d), pos) == ([1, -2, 3], [0.5, 1.5], size)


def test_pack_derived_gathers_layout() -> None:
    vec = MPI.INT.Create_vector(2, 1, 2).Commit()
    src = array.array("i", [1, 2, 3, 4])
    buf = bytearray(vec.Pack_size(1, MPI.COMM_SELF))
    assert vec.Pack(src, buf, 0, MPI.COMM_SELF) == 8
    assert array.array("i", bytes(buf)).tolist() == [1, 3]
    out = array.array("i", [0, 0, 0, 0])
    vec.Unpack(buf, 0, out, MPI.COMM_SELF)
    assert out.tolist() == [1, 0, 3, 0]


def test_external32_is_big_endian() -> None:
    assert MPI.LONG.Pack_external_size("external32", 3) == 12  # MPICH: 4-byte long
    buf = bytearray(MPI.INT.Pack_external_size("external32", 2))
    assert MPI.INT.Pack_external("external32", array.array("i", [1, -2]), buf, 0) == 8
    assert bytes(buf) == b"\x00\x00\x00\x01\xff\xff\xff\xfe"
    out = array.array("l", [0, 0])
    lbuf = bytearray(8)
    MPI.LONG.Pack_external("external32", array.array("l", [-5, 7]), lbuf, 0)
    assert MPI.LONG.Unpack_external("external32", lbuf, 0, out) == 8
    assert out.tolist() == [-5, 7]
    with pytest.raises(MPI.Exception):
        MPI.INT.Pack_external("native", array.array("i", [1]), bytearray(4), 0)


def test_type_codes_and_decode() -> None:
    assert MPI.Datatype.fromcode("i4") is MPI.INT32_T
    assert (MPI.INT.tocode(), MPI.INT.typestr, MPI.C_BOOL.typechar) == ("i", "i4", "?")
    with pytest.raises(ValueError):
        MPI.Datatype.fromcode("x")
    vec = MPI.INT.Create_vector(2, 1, 3)
    assert vec.typestr == f"V{vec.extent}"
    base, name, info = vec.decode()
    assert (base, name, info) == (MPI.INT, "VECTOR", {"count": 2, "blocklength": 1, "stride": 3})
    assert vec.combiner == MPI.COMBINER_VECTOR
    assert MPI.INT.Get_envelope() == (0, 0, 0, 0, MPI.COMBINER_NAMED)
