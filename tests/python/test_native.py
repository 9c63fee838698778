"""The native layer (tessera._native) on its own, with numpy arrays and thread-ranks."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from tessera import _native as N
from tessera import errors as E

NAMES = {
    "float64": "f64",
    "float32": "f32",
    "float16": "f16",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
    "uint16": "u16",
    "uint32": "u32",
    "uint64": "u64",
    "bool": "bool",
}


def save_t(key, arr, gshape, goff, *, local=None, prepend=0, replica=0, flat=None, frags=None, dtype=None, **kw):
    """A SaveTensor over ``arr``'s memory (the caller keeps ``arr`` alive)."""
    assert arr.flags.c_contiguous
    fields = dict(
        key=key, dtype=dtype or NAMES[arr.dtype.name], local_shape=arr.shape if local is None else local,
        global_shape=gshape, global_offset=goff, prepend_axis_num=prepend, replica_id=replica, flattened_range=flat,
        axis_fragmentations=frags, data_ptr=arr.ctypes.data, nbytes=arr.nbytes,
    )
    return N.SaveTensor(**{**fields, **kw})


def load_t(key, arr, gshape, goff, *, local=None, prepend=0, flat=None, mismatch=False, dtype=None, **kw):
    """A LoadTensor writing into ``arr``."""
    assert arr.flags.c_contiguous and arr.flags.writeable
    fields = dict(
        key=key, dtype=dtype or NAMES[arr.dtype.name], local_shape=arr.shape if local is None else local,
        global_shape=gshape, global_offset=goff, prepend_axis_num=prepend, flattened_range=flat,
        allow_shape_mismatch=mismatch, data_ptr=arr.ctypes.data, nbytes=arr.nbytes,
    )
    return N.LoadTensor(**{**fields, **kw})


def save_o(key, gshape, goff, replica=0, data=b""):
    return N.SaveObject(key=key, global_shape=gshape, global_offset=goff, replica_id=replica, data=data)


def load_o(key, gshape, goff):
    return N.LoadObject(key=key, global_shape=gshape, global_offset=goff)


W = np.arange(48, dtype=np.float32).reshape(8, 6)
B = np.arange(5, dtype=np.int64) * -3
F = np.arange(16, dtype=np.float64).reshape(4, 4) / 7
S = np.arange(6, dtype=np.int32).reshape(2, 3)
M = np.array([True, False, True])

COMMON = [
    (["step"], 1200),
    (["big"], 2**63 - 1),
    (["small"], -(2**63)),
    (["lr"], 0.1),
    (["name"], "run-α"),
    (["flag"], False),
    (["none"], None),
    (["blob"], b"\x00\xffbytes"),
    (["cfg", "layers", 0, "width"], 64),
    (["cfg", "layers", 1, "width"], 128),
    (["cfg", "dropout"], [0.0, 0.1, [True, None]]),
    (["nested"], {"a": {"b": [1, "x", {}], "c": b""}, "d": []}),
]
META = {"iteration": 7, "tags": ["x", "y"], "ratio": 0.5}


def save_rank(comm, location, **kw):
    """Rank ``r`` of 2: rows of W, a replicated B, flat halves of F, stacked S, objects."""
    r = comm.rank()
    w = np.ascontiguousarray(W[4 * r : 4 * r + 4])
    b = B.copy()
    f = F.ravel()[[0, 7][r] : [7, 16][r]].copy()
    s = S[r].copy()
    m = M.copy()
    tensors = [
        save_t("w", w, (8, 6), (4 * r, 0), frags=(2, 1)),
        save_t("b", b, (5,), (0,), replica=r),
        save_t("f", f, (4, 4), (0, 0), local=(4, 4), flat=([0, 7][r], [7, 16][r])),
        save_t("stack", s, (2, 3), (r, 0), prepend=1),
        save_t("mask", m, (3,), (0,), replica=(0, r)),
    ]
    objects = [
        save_o("rng", (2,), (r,), 0, pickle.dumps({"rank": r})),
        save_o("cfg", (1,), (0,), r, b"shared"),
    ]
    common = COMMON if r == 0 else [(["ignored"], r)]
    return N.save(tensors, objects, common, location, comm, content_metadata=META, **kw)


@pytest.fixture
def ckpt(tmp_path, ranks):
    location = str(tmp_path / "ckpt")
    reports = ranks(2, lambda c: save_rank(c, location))
    assert reports[0]["files"] == 2 and reports[0]["total_tensor_bytes"] > 0
    return location


def test_two_ranks_save_then_load_another_layout(ckpt, ranks):
    def load_rank(comm):
        r = comm.rank()
        cols = np.empty((8, 3), np.float32)
        f, s, b = np.empty((4, 4)), np.empty((2, 3), np.int32), np.empty(5, np.int64)
        out = N.load(
            [
                load_t("w", cols, (8, 6), (0, 3 * r)),
                load_t("f", f, (4, 4), (0, 0)),
                load_t("stack", s, (2, 3), (0, 0)),
                load_t("b", b, (5,), (0,)),
            ],
            [load_o("rng", (2,), (r,))],
            ckpt,
            comm,
        )
        assert out["loaded"] == [True] * 4
        return cols, f, s, b, pickle.loads(out["objects"][0])

    for r, (cols, f, s, b, obj) in enumerate(ranks(2, load_rank)):
        np.testing.assert_array_equal(cols, W[:, 3 * r : 3 * r + 3])
        np.testing.assert_array_equal(f, F)
        np.testing.assert_array_equal(s, S)
        np.testing.assert_array_equal(b, B)
        assert obj == {"rank": r}


def test_solo_load_whole_flat_and_mismatched_shape(ckpt):
    w, m = np.zeros((8, 6), np.float32), np.zeros(3, bool)
    part = np.zeros(20, np.float32)  # a flattened range of the whole box
    grown = np.full((10, 6), 9, np.float32)  # stored (8, 6): the rest is zeroed
    out = N.load(
        [
            load_t("w", w, (8, 6), (0, 0)),
            load_t("mask", m, (3,), (0,)),
            load_t("w", part, (8, 6), (0, 0), local=(8, 6), flat=(5, 25)),
            load_t("w", grown, (10, 6), (0, 0), mismatch=True),
        ],
        [load_o("cfg", (1,), (0,))],
        ckpt,
    )
    np.testing.assert_array_equal(w, W)
    np.testing.assert_array_equal(m, M)
    np.testing.assert_array_equal(part, W.ravel()[5:25])
    np.testing.assert_array_equal(grown[:8], W)
    assert not grown[8:].any()
    assert out["objects"] == [b"shared"]
    assert {tuple(p): v for p, v in out["common"]} == {tuple(p): v for p, v in COMMON}
    assert out["missing_keys"] == [] and out["unexpected_keys"] == []
    assert set(out["stats"]) == {"bytes_needed", "bytes_read", "header_bytes_read", "reads", "bytes_received"}
    assert out["stats"]["bytes_needed"] >= w.nbytes
    assert out["stats"]["bytes_received"] == 0  # no exchange asked for


def test_tensors_metadata(ckpt):
    assert N.load_tensors_metadata(ckpt) == {
        "w": ("f32", (8, 6)),
        "b": ("i64", (5,)),
        "f": ("f64", (4, 4)),
        "stack": ("i32", (2, 3)),
        "mask": ("bool", (3,)),
    }


def test_common_values_round_trip(ckpt):
    got = N.load_common(ckpt)
    assert all(type(p) is list for p, _ in got)
    got_map, want = {tuple(p): v for p, v in got}, {tuple(p): v for p, v in COMMON}
    assert got_map == want  # "ignored" came from rank 1: only rank 0's values are saved
    for path, value in want.items():
        assert type(got_map[path]) is type(value)
    assert N.load([], [], ckpt)["common"] == got


def test_content_metadata_and_objects(ckpt, tmp_path):
    assert N.load_content_metadata(ckpt) == META
    objs = N.load_objects([load_o("rng", (2,), (1,)), load_o("rng", (2,), (0,)), load_o("cfg", (1,), (0,))], ckpt)
    assert [pickle.loads(o) for o in objs[:2]] == [{"rank": 1}, {"rank": 0}]
    assert objs[2] == b"shared"
    plain = str(tmp_path / "plain")
    N.save([], [], [], plain)
    assert N.load_content_metadata(plain) is None
    assert N.load_common(plain) == []


def test_every_dtype_round_trips_bytes():
    sizes = {"f64": 8, "i64": 8, "u64": 8, "f32": 4, "i32": 4, "u32": 4, "f16": 2, "bf16": 2, "i16": 2, "u16": 2}
    assert len(N.DTYPES) == 15
    rng = np.random.default_rng(0)
    data = {d: rng.integers(0, 2 if d == "bool" else 256, 5 * sizes.get(d, 1), dtype=np.uint8) for d in N.DTYPES}
    N.save([save_t(d, a, (5,), (0,), local=(5,), dtype=d) for d, a in data.items()], [], [], "mem://dtypes")
    back = {d: np.zeros_like(a) for d, a in data.items()}
    N.load([load_t(d, a, (5,), (0,), local=(5,), dtype=d) for d, a in back.items()], [], "mem://dtypes")
    for d in N.DTYPES:
        np.testing.assert_array_equal(back[d], data[d], err_msg=d)
    assert N.load_tensors_metadata("mem://dtypes")["bf16"] == ("bf16", (5,))


def test_strict_modes(ckpt):
    def request():
        w, x = np.zeros((8, 6), np.float32), np.zeros(2, np.float32)
        return (w, x), [load_t("w", w, (8, 6), (0, 0)), load_t("nope", x, (2,), (0,))]

    (w, _), tensors = request()
    with pytest.raises(E.KeyMismatchError) as ei:
        N.load(tensors, [], ckpt, strict="raise_unexpected")
    assert isinstance(ei.value, KeyError) and ei.value.unexpected == ["nope"]
    assert "nope" in str(ei.value)

    (w, _), tensors = request()
    out = N.load(tensors, [load_o("gone", (1,), (0,)), load_o("cfg", (1,), (0,))], ckpt, strict="return_unexpected")
    assert out["loaded"] == [True, False]
    assert out["objects"] == [None, b"shared"]
    assert out["unexpected_keys"] == ["gone", "nope"] and out["missing_keys"] == []
    np.testing.assert_array_equal(w, W)

    (w, _), tensors = request()
    out = N.load(tensors, [], ckpt, strict="return_all")
    assert out["unexpected_keys"] == ["nope"]
    assert sorted(out["missing_keys"]) == ["b", "cfg", "f", "mask", "rng", "stack"]

    (w, _), tensors = request()
    with pytest.raises(E.KeyMismatchError) as ei:
        N.load(tensors, [], ckpt, strict="raise_all")
    assert "stack" in ei.value.missing

    (w, _), tensors = request()
    with pytest.raises(E.NotCoveredError):
        N.load(tensors, [], ckpt)  # assume_ok_unexpected: the absent key fails when looked for
    with pytest.raises(E.InvalidArgumentError):
        N.load([], [], ckpt, strict="sometimes")


ERRORS = [
    ("NotFoundError", FileNotFoundError),
    ("NotCommittedError", FileNotFoundError),
    ("AlreadyExistsError", FileExistsError),
    ("CorruptError", ValueError),
    ("IncompatibleVersionError", ValueError),
    ("InvalidShardingError", ValueError),
    ("NotCoveredError", KeyError),
    ("MismatchError", ValueError),
    ("KeyMismatchError", KeyError),
    ("UnknownStrategyError", LookupError),
    ("InvalidArgumentError", ValueError),
    ("PeerFailedError", RuntimeError),
    ("CommError", RuntimeError),
    ("StorageIOError", OSError),
    ("AccessDeniedError", PermissionError),
    ("CommitUnknownError", RuntimeError),
]


@pytest.mark.parametrize("name,builtin", ERRORS)
def test_exception_classes(name, builtin):
    cls = getattr(E, name)
    assert cls is getattr(N, name)
    assert issubclass(cls, E.TesseraError) and issubclass(cls, builtin)
    assert issubclass(E.TesseraError, Exception)
    assert set(E.__all__) == {"TesseraError"} | {n for n, _ in ERRORS}


def test_not_found_and_not_committed(tmp_path):
    missing = str(tmp_path / "missing")
    with pytest.raises(E.NotFoundError) as ei:
        N.load_tensors_metadata(missing)
    assert isinstance(ei.value, FileNotFoundError) and ei.value.path == missing
    assert N.detect(missing) is None
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "0123456789abcdef-r00000.safetensors").write_bytes(b"partial")
    with pytest.raises(E.NotCommittedError) as ei:
        N.load_common(str(tmp_path / "half"))
    assert ei.value.path == str(tmp_path / "half")
    assert N.detect(str(tmp_path / "half")) is None
    assert N.gc(str(tmp_path / "half"))["removed"] == ["0123456789abcdef-r00000.safetensors"]


def test_already_exists(ckpt, ranks):
    with pytest.raises(E.AlreadyExistsError) as ei:
        ranks(2, lambda c: save_rank(c, ckpt))
    assert isinstance(ei.value, FileExistsError) and ei.value.path == ckpt
    ranks(2, lambda c: save_rank(c, ckpt, overwrite=True))
    assert N.verify(ckpt)["problems"] == []


def test_invalid_sharding_raised_on_every_rank(tmp_path, ranks_raw):
    location = str(tmp_path / "bad")

    def tensors(rank, w):  # rows 0..5 and 3..8 overlap
        return [save_t("w", w, (8, 6), (3 * rank, 0))]

    def save(comm):
        w = np.ascontiguousarray(W[3 * comm.rank() : 3 * comm.rank() + 5])
        return N.save(tensors(comm.rank(), w), [], [], location, comm)

    def validate(comm):
        w = np.ascontiguousarray(W[3 * comm.rank() : 3 * comm.rank() + 5])
        return N.validate_sharding(tensors(comm.rank(), w), [], comm)

    for fn in (save, validate):
        for r in ranks_raw(2, fn):
            assert isinstance(r, E.InvalidShardingError) and isinstance(r, ValueError), r
            assert r.key == "w" and r.reason
    assert N.detect(location) is None


def test_validate_sharding_accepts_a_valid_layout(ranks):
    def validate(comm):
        r = comm.rank()
        w = np.ascontiguousarray(W[4 * r : 4 * r + 4])
        objects = [save_o("rng", (2,), (r,), 0), save_o("cfg", (1,), (0,), r)]
        return N.validate_sharding([save_t("w", w, (8, 6), (4 * r, 0))], objects, comm)

    assert ranks(2, validate) == [None, None]


def test_corrupt_after_flipping_a_byte(ckpt):
    name = sorted(n for n in os.listdir(ckpt) if n.endswith("-r00000.safetensors"))[0]
    path = os.path.join(ckpt, name)
    raw = bytearray(open(path, "rb").read())
    first_data_byte = 8 + int.from_bytes(raw[:8], "little")  # after the safetensors header
    raw[first_data_byte] ^= 0xFF
    open(path, "wb").write(bytes(raw))
    w = np.zeros((8, 6), np.float32)
    with pytest.raises(E.CorruptError) as ei:
        N.load([load_t("w", w, (8, 6), (0, 0))], [], ckpt)
    assert isinstance(ei.value, ValueError) and name in ei.value.path and ei.value.reason
    assert N.verify(ckpt)["problems"]


def test_verify_gc_detect_remove(ckpt):
    report = N.verify(ckpt, threads=2)
    assert report["problems"] == [] and report["files"] == 2 and report["chunks"] >= 5
    assert report["bytes_checked"] > 0
    found = N.detect(ckpt)
    assert (found.backend, found.version, found.is_native, found.is_dcp) == ("tessera", N.FORMAT_VERSION, True, False)
    leftover = os.path.join(ckpt, "fedcba9876543210-r00001.safetensors")
    open(leftover, "wb").write(b"x")
    assert N.gc(ckpt)["removed"] == [os.path.basename(leftover)]
    assert N.gc(ckpt)["removed"] == []
    assert N.remove_sharded_tensors(ckpt, "st") == ["stack"]
    assert "stack" not in N.load_tensors_metadata(ckpt)
    assert N.remove_sharded_tensors(ckpt, "zzz") == []


def test_argument_errors(ckpt):
    w = np.zeros((8, 6), np.float32)
    good = load_t("w", w, (8, 6), (0, 0))
    with pytest.raises(E.InvalidArgumentError, match="null"):
        N.load([load_t("w", w, (8, 6), (0, 0), data_ptr=0)], [], ckpt)
    with pytest.raises(E.InvalidArgumentError, match="dtype") as ei:
        load_t("w", w, (8, 6), (0, 0), dtype="f33")
    assert "'w'" in str(ei.value) or '"w"' in str(ei.value)
    with pytest.raises(E.InvalidArgumentError):
        N.load([load_t("w", w, (8, 6), (0, 0), nbytes=w.nbytes - 4)], [], ckpt)  # buffer too small for the shard
    with pytest.raises(E.InvalidArgumentError, match="overlap"):
        N.load([good, load_t("w", w[4:], (8, 6), (4, 0))], [], ckpt)
    with pytest.raises(E.MismatchError):
        N.load([load_t("w", w.view(np.int32), (8, 6), (0, 0))], [], ckpt)
    with pytest.raises(E.MismatchError):
        N.load([load_t("w", np.zeros((9, 6), np.float32), (9, 6), (0, 0))], [], ckpt)
    with pytest.raises(E.InvalidArgumentError, match="w.*negative") as ei:
        load_t("w", w, (8, 6), (-1, 0))
    assert isinstance(ei.value, ValueError)
    with pytest.raises(E.InvalidArgumentError, match="replica_id"):
        save_t("w", w, (8, 6), (0, 0), replica=-1)
    # Only the typed values cross: a tuple is refused, a field of the wrong type names the key.
    with pytest.raises(TypeError):
        N.load([("w", "f32", (8, 6), (8, 6), (0, 0), 0, None, False, w.ctypes.data, w.nbytes)], [], ckpt)
    with pytest.raises(TypeError, match="'w'.*global_shape|\"w\".*global_shape"):
        load_t("w", w, "8x6", (0, 0))
    with pytest.raises(TypeError, match="key must be a str"):
        N.LoadObject(key=3, global_shape=(1,), global_offset=(0,))
    with pytest.raises(TypeError, match="data"):
        save_o("o", (1,), (0,), data="text")
    with pytest.raises(TypeError):
        N.SaveTensor("w", "f32", (1,), (1,), (0,))  # keyword arguments only
    with pytest.raises(E.InvalidArgumentError, match="scheme"):
        N.detect("ftp://host/x")


def test_typed_values_keep_their_fields():
    w = np.zeros((4, 6), np.float32)
    t = save_t("w", w, [8, 6], (4, 0), frags=[2, 1], replica=(0, 1), flat=(2, 5))
    assert (t.key, t.dtype, t.local_shape, t.global_shape, t.global_offset) == ("w", "f32", (4, 6), (8, 6), (4, 0))
    assert (t.prepend_axis_num, t.replica_id, t.flattened_range, t.axis_fragmentations) == (0, (0, 1), (2, 5), (2, 1))
    assert (t.data_ptr, t.nbytes) == (w.ctypes.data, w.nbytes)
    assert "SaveTensor(key=\"w\"" in repr(t)
    l = load_t("w", w, (8, 6), (4, 0), mismatch=True)
    assert l.allow_shape_mismatch and l.flattened_range is None and l.global_shape == (8, 6)
    o = save_o("rng", (2,), (1,), 3, bytearray(b"xy"))
    assert (o.key, o.global_shape, o.global_offset, o.replica_id, o.data) == ("rng", (2,), (1,), (3,), b"xy")
    assert N.SaveObject(key="c", global_shape=(), global_offset=()).data == b""
    assert load_o("rng", (2,), (1,)).global_offset == (1,)


def test_tensor_check_and_rank_offsets_are_the_cores():
    w = np.zeros((4, 6), np.float32)
    save_t("w", w, (8, 6), (4, 0), frags=(2, 1)).check()
    with pytest.raises(E.InvalidShardingError, match="exceeds global shape") as ei:
        save_t("w", w, (8, 6), (6, 0)).check()
    assert ei.value.key == "w"
    save_t("w", w, (8, 6), (6, 0)).check(in_bounds=False)
    with pytest.raises(E.InvalidShardingError, match="fragment"):
        save_t("w", w, (9, 6), (4, 0), frags=(2, 1)).check(in_bounds=False)
    assert N.from_rank_offsets("w", (4, 6), [(0, 1, 2)]) == ((8, 6), (4, 0), (2, 1))
    assert N.from_rank_offsets("w", (4,), [(0, 3, 8)], prepend_axis_num=1) == ((8, 4), (3, 0), (8, 1))
    with pytest.raises(E.InvalidShardingError, match="given twice") as ei:
        N.from_rank_offsets("w", (4, 6), [(0, 1, 2), (0, 0, 2)])
    assert ei.value.key == "w"


@pytest.mark.parametrize(
    "value", [{1, 2}, np.float64(1.0), {1: "int key"}, [object()], type("IntSub", (int,), {})(1), 2**64, (1, object())]
)
def test_non_plain_common_values_are_type_errors(value):
    with pytest.raises(TypeError, match=r"common\[0\]"):
        N.save([], [], [(["x"], value)], "mem://never")
    with pytest.raises(TypeError, match="content_metadata"):
        N.save([], [], [], "mem://never", content_metadata=value)
    with pytest.raises(TypeError):
        N.encode_value(value)


def test_a_tuple_is_stored_as_a_list():
    assert N.decode_value(N.encode_value((1, (2.5, "x")))) == [1, [2.5, "x"]]


def test_common_paths_are_checked():
    with pytest.raises(TypeError, match="path"):
        N.save([], [], [(["a", 1.5], 1)], "mem://never")
    with pytest.raises(TypeError, match="path"):
        N.save([], [], [("ab", 1)], "mem://never")
    with pytest.raises(E.InvalidArgumentError):
        N.save([], [], [([], 1)], "mem://never")


def test_comm_failures(tmp_path, ranks_raw):
    class Broken:
        def rank(self):
            return 0

        def world_size(self):
            return 1

        def all_gather(self, data):
            raise RuntimeError("link down")

        def broadcast(self, data, root):
            raise RuntimeError("link down")

    with pytest.raises(E.CommError, match="link down") as ei:
        N.save([], [], [], str(tmp_path / "c"), Broken())
    assert isinstance(ei.value, RuntimeError)

    def save(comm):  # rank 1's buffer does not match its shard: rank 0 hears of it
        w = np.ascontiguousarray(W[4 * comm.rank() : 4 * comm.rank() + 4])
        nbytes = w.nbytes - 4 if comm.rank() == 1 else w.nbytes
        t = save_t("w", w, (8, 6), (4 * comm.rank(), 0), nbytes=nbytes)
        return N.save([t], [], [], str(tmp_path / "p"), comm)

    r0, r1 = ranks_raw(2, save)
    assert isinstance(r0, E.PeerFailedError) and r0.rank == 1, r0
    assert isinstance(r1, E.InvalidArgumentError), r1


def test_value_encoding():
    for _, value in COMMON:
        data = N.encode_value(value)
        assert isinstance(data, bytes) and N.decode_value(data) == value
    with pytest.raises(E.InvalidArgumentError):
        N.decode_value(N.encode_value([1, 2]) + b"\x00")
