//! Vectors come from CPython 3.11's `pickle` (torch 2.15 for `torch.Size`), each with the
//! expression that produced it. Some use a fake module made in the generating script:
//! `fakemod = types.ModuleType('fakemod'); sys.modules['fakemod'] = fakemod` holding
//! `@dataclass class Point: x: int; y: list`, `class Ex` (with `__getnewargs_ex__`) and
//! `class Slotted: __slots__ = ('a',)`. NESTED is
//! `{'a': [1, -2, 300, 70000, -(2**40), 2**70, -(2**70), 1.5, float('inf'), None, True, False],
//!   'b': ('x', b'y\x00\xff', bytearray(b'ba'), 'é\n\\😀', ''),
//!   'c': {'d': {1, 2}, 'e': frozenset([3])}, 'f': ()}`.
use super::render::{bigint_text, key_text, KEY_TEXT_MAX};
use super::*;
use crate::error::Error;

// pickle.dumps(NESTED, 0), NESTED as in the comment above
const NESTED_P0: &[u8] = b"(dp0\nVa\np1\n(lp2\nI1\naI-2\naI300\naI70000\naL-1099511627776L\naL1180591620717411303424L\naL-1180591620717411303424L\naF1.5\naFinf\naNaI01\naI00\nasVb\np3\n(Vx\np4\nc_codecs\nencode\np5\n(Vy\\u0000\xff\np6\nVlatin1\np7\ntp8\nRp9\nc__builtin__\nbytearray\np10\n(g5\n(Vba\np11\ng7\ntp12\nRp13\ntp14\nRp15\nV\xe9\\u000a\\u005c\\U0001f600\np16\nV\np17\ntp18\nsVc\np19\n(dp20\nVd\np21\nc__builtin__\nset\np22\n((lp23\nI1\naI2\natp24\nRp25\nsVe\np26\nc__builtin__\nfrozenset\np27\n((lp28\nI3\natp29\nRp30\nssVf\np31\n(ts.";
// pickle.dumps(NESTED, 1), NESTED as in the comment above
const NESTED_P1: &[u8] = b"}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01J\xfe\xff\xff\xffM,\x01Jp\x11\x01\x00L-1099511627776L\nL1180591620717411303424L\nL-1180591620717411303424L\nG?\xf8\x00\x00\x00\x00\x00\x00G\x7f\xf0\x00\x00\x00\x00\x00\x00NI01\nI00\neX\x01\x00\x00\x00bq\x03(X\x01\x00\x00\x00xq\x04c_codecs\nencode\nq\x05(X\x04\x00\x00\x00y\x00\xc3\xbfq\x06X\x06\x00\x00\x00latin1q\x07tq\x08Rq\x09c__builtin__\nbytearray\nq\n(h\x05(X\x02\x00\x00\x00baq\x0bh\x07tq\x0cRq\x0dtq\x0eRq\x0fX\x08\x00\x00\x00\xc3\xa9\n\\\xf0\x9f\x98\x80q\x10X\x00\x00\x00\x00q\x11tq\x12X\x01\x00\x00\x00cq\x13}q\x14(X\x01\x00\x00\x00dq\x15c__builtin__\nset\nq\x16(]q\x17(K\x01K\x02etq\x18Rq\x19X\x01\x00\x00\x00eq\x1ac__builtin__\nfrozenset\nq\x1b(]q\x1cK\x03atq\x1dRq\x1euX\x01\x00\x00\x00fq\x1f)u.";
// pickle.dumps(NESTED, 2), NESTED as in the comment above
const NESTED_P2: &[u8] = b"\x80\x02}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01J\xfe\xff\xff\xffM,\x01Jp\x11\x01\x00\x8a\x06\x00\x00\x00\x00\x00\xff\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00@\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\xc0G?\xf8\x00\x00\x00\x00\x00\x00G\x7f\xf0\x00\x00\x00\x00\x00\x00N\x88\x89eX\x01\x00\x00\x00bq\x03(X\x01\x00\x00\x00xq\x04c_codecs\nencode\nq\x05X\x04\x00\x00\x00y\x00\xc3\xbfq\x06X\x06\x00\x00\x00latin1q\x07\x86q\x08Rq\x09c__builtin__\nbytearray\nq\nh\x05X\x02\x00\x00\x00baq\x0bh\x07\x86q\x0cRq\x0d\x85q\x0eRq\x0fX\x08\x00\x00\x00\xc3\xa9\n\\\xf0\x9f\x98\x80q\x10X\x00\x00\x00\x00q\x11tq\x12X\x01\x00\x00\x00cq\x13}q\x14(X\x01\x00\x00\x00dq\x15c__builtin__\nset\nq\x16]q\x17(K\x01K\x02e\x85q\x18Rq\x19X\x01\x00\x00\x00eq\x1ac__builtin__\nfrozenset\nq\x1b]q\x1cK\x03a\x85q\x1dRq\x1euX\x01\x00\x00\x00fq\x1f)u.";
// pickle.dumps(NESTED, 3), NESTED as in the comment above
const NESTED_P3: &[u8] = b"\x80\x03}q\x00(X\x01\x00\x00\x00aq\x01]q\x02(K\x01J\xfe\xff\xff\xffM,\x01Jp\x11\x01\x00\x8a\x06\x00\x00\x00\x00\x00\xff\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00@\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\xc0G?\xf8\x00\x00\x00\x00\x00\x00G\x7f\xf0\x00\x00\x00\x00\x00\x00N\x88\x89eX\x01\x00\x00\x00bq\x03(X\x01\x00\x00\x00xq\x04C\x03y\x00\xffq\x05cbuiltins\nbytearray\nq\x06C\x02baq\x07\x85q\x08Rq\x09X\x08\x00\x00\x00\xc3\xa9\n\\\xf0\x9f\x98\x80q\nX\x00\x00\x00\x00q\x0btq\x0cX\x01\x00\x00\x00cq\x0d}q\x0e(X\x01\x00\x00\x00dq\x0fcbuiltins\nset\nq\x10]q\x11(K\x01K\x02e\x85q\x12Rq\x13X\x01\x00\x00\x00eq\x14cbuiltins\nfrozenset\nq\x15]q\x16K\x03a\x85q\x17Rq\x18uX\x01\x00\x00\x00fq\x19)u.";
// pickle.dumps(NESTED, 4), NESTED as in the comment above
const NESTED_P4: &[u8] = b"\x80\x04\x95\xb2\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01J\xfe\xff\xff\xffM,\x01Jp\x11\x01\x00\x8a\x06\x00\x00\x00\x00\x00\xff\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00@\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\xc0G?\xf8\x00\x00\x00\x00\x00\x00G\x7f\xf0\x00\x00\x00\x00\x00\x00N\x88\x89e\x8c\x01b\x94(\x8c\x01x\x94C\x03y\x00\xff\x94\x8c\x08builtins\x94\x8c\x09bytearray\x94\x93\x94C\x02ba\x94\x85\x94R\x94\x8c\x08\xc3\xa9\n\\\xf0\x9f\x98\x80\x94\x8c\x00\x94t\x94\x8c\x01c\x94}\x94(\x8c\x01d\x94\x8f\x94(K\x01K\x02\x90\x8c\x01e\x94(K\x03\x91\x94u\x8c\x01f\x94)u.";
// pickle.dumps(NESTED, 5), NESTED as in the comment above
const NESTED_P5: &[u8] = b"\x80\x05\x95\x9c\x00\x00\x00\x00\x00\x00\x00}\x94(\x8c\x01a\x94]\x94(K\x01J\xfe\xff\xff\xffM,\x01Jp\x11\x01\x00\x8a\x06\x00\x00\x00\x00\x00\xff\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00@\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\xc0G?\xf8\x00\x00\x00\x00\x00\x00G\x7f\xf0\x00\x00\x00\x00\x00\x00N\x88\x89e\x8c\x01b\x94(\x8c\x01x\x94C\x03y\x00\xff\x94\x96\x02\x00\x00\x00\x00\x00\x00\x00ba\x94\x8c\x08\xc3\xa9\n\\\xf0\x9f\x98\x80\x94\x8c\x00\x94t\x94\x8c\x01c\x94}\x94(\x8c\x01d\x94\x8f\x94(K\x01K\x02\x90\x8c\x01e\x94(K\x03\x91\x94u\x8c\x01f\x94)u.";
// pickle.dumps(collections.OrderedDict([('a', 1), ('b', [2])]), 0)
const ODICT_P0: &[u8] = b"ccollections\nOrderedDict\np0\n(tRp1\nVa\np2\nI1\nsVb\np3\n(lp4\nI2\nas.";
// pickle.dumps(collections.OrderedDict([('a', 1), ('b', [2])]), 2)
const ODICT_P2: &[u8] = b"\x80\x02ccollections\nOrderedDict\nq\x00)Rq\x01(X\x01\x00\x00\x00aq\x02K\x01X\x01\x00\x00\x00bq\x03]q\x04K\x02au.";
// pickle.dumps([b'\x00\xffabc', 'é'.encode(), b''], 2)
const BYTES_P2: &[u8] = b"\x80\x02]q\x00(c_codecs\nencode\nq\x01X\x06\x00\x00\x00\x00\xc3\xbfabcq\x02X\x06\x00\x00\x00latin1q\x03\x86q\x04Rq\x05h\x01X\x04\x00\x00\x00\xc3\x83\xc2\xa9q\x06h\x03\x86q\x07Rq\x08c__builtin__\nbytes\nq\x09)Rq\ne.";
// a = [1]; pickle.dumps([a, a, (a,)], 2)
const SHARED_P2: &[u8] = b"\x80\x02]q\x00(]q\x01K\x01ah\x01h\x01\x85q\x02e.";
// pickle.dumps(fakemod.Point(1, [2, 3]), 0) (Point: a dataclass with x: int, y: list)
const POINT_P0: &[u8] = b"ccopy_reg\n_reconstructor\np0\n(cfakemod\nPoint\np1\nc__builtin__\nobject\np2\nNtp3\nRp4\n(dp5\nVx\np6\nI1\nsVy\np7\n(lp8\nI2\naI3\nasb.";
// pickle.dumps(fakemod.Point(1, [2, 3]), 4)
const POINT_P4: &[u8] = b"\x80\x04\x95/\x00\x00\x00\x00\x00\x00\x00\x8c\x07fakemod\x94\x8c\x05Point\x94\x93\x94)\x81\x94}\x94(\x8c\x01x\x94K\x01\x8c\x01y\x94]\x94(K\x02K\x03eub.";
// pickle.dumps(fakemod.Ex(5, k=6), 4) (Ex.__getnewargs_ex__ returns ((a,), {'k': k}))
const EX_P4: &[u8] = b"\x80\x04\x950\x00\x00\x00\x00\x00\x00\x00\x8c\x07fakemod\x94\x8c\x02Ex\x94\x93\x94K\x05\x85\x94}\x94\x8c\x01k\x94K\x06s\x92\x94}\x94(\x8c\x01a\x94K\x05h\x05K\x06ub.";
// s = fakemod.Slotted(); s.a = 9; pickle.dumps(s, 2) (__slots__ = ('a',))
const SLOTTED_P2: &[u8] = b"\x80\x02cfakemod\nSlotted\nq\x00)\x81q\x01N}q\x02X\x01\x00\x00\x00aq\x03K\x09s\x86q\x04b.";
// pickle.dumps(fractions.Fraction(1, 3), 2)
const FRACTION_P2: &[u8] = b"\x80\x02cfractions\nFraction\nq\x00K\x01K\x03\x86q\x01Rq\x02.";
// pickle.dumps(datetime.date(2020, 1, 2), 0)
const DATE_P0: &[u8] =
    b"cdatetime\ndate\np0\n(c_codecs\nencode\np1\n(V\x07\xe4\x01\x02\np2\nVlatin1\np3\ntp4\nRp5\ntp6\nRp7\n.";
// pickle.dumps(datetime.date(2020, 1, 2), 3)
const DATE_P3: &[u8] = b"\x80\x03cdatetime\ndate\nq\x00C\x04\x07\xe4\x01\x02q\x01\x85q\x02Rq\x03.";
// Pickler with persistent_id(b'T') = 'pid0': dump([b'T', 1]) with protocol 0
const PERSID_P0: &[u8] = b"(lp0\nPpid0\naI1\na.";
// Pickler with persistent_id(b'T') = ('storage', 'k0', 3): dump([b'T', 1]) with protocol 2
const PERSID_P2: &[u8] = b"\x80\x02]q\x00(X\x07\x00\x00\x00storageq\x01X\x02\x00\x00\x00k0q\x02K\x03\x87q\x03QK\x01e.";
// pickle.dumps([2**2040, -(2**2040)], 2)
const LONG4_P2: &[u8] = b"\x80\x02]q\x00(\x8b\x00\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x01\x8b\x00\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\xffe.";
// l = []; l.append(l); pickle.dumps(l, 2)
const RECURSIVE_P2: &[u8] = b"\x80\x02]q\x00h\x00a.";
// l = []; t = (l,); l.append(t); pickle.dumps(t, 2) (uses POP_MARK)
const RECURSIVE_TUPLE_P2: &[u8] = b"\x80\x02]q\x00h\x00\x85q\x01a0h\x01.";
// copyreg.add_extension('fakemod', 'Point', 42); pickle.dumps(fakemod.Point, 2)
const EXT1_P2: &[u8] = b"\x80\x02\x82*.";
// copyreg.add_extension('fakemod', 'Ex', 300); pickle.dumps(fakemod.Ex, 2)
const EXT2_P2: &[u8] = b"\x80\x02\x83,\x01.";
// copyreg.add_extension('fakemod', 'Slotted', 70000); pickle.dumps(fakemod.Slotted, 2)
const EXT4_P2: &[u8] = b"\x80\x02\x84p\x11\x01\x00.";
// pickle.dumps(pickle.PickleBuffer(bytearray(b'abc')), 5, buffer_callback=lambda b: False)
const NEXT_BUFFER_P5: &[u8] = b"\x80\x05\x97.";
// pickle.dumps(pickle.PickleBuffer(b'abc'), 5, buffer_callback=lambda b: False)
const READONLY_BUFFER_P5: &[u8] = b"\x80\x05\x97\x98.";
// pickle.dumps({'size': torch.Size([2, 3]), 'dtype': torch.float32}, 2) (torch 2.x)
const TORCH_SIZE_P2: &[u8] = b"\x80\x02}q\x00(X\x04\x00\x00\x00sizeq\x01ctorch\nSize\nq\x02K\x02K\x03\x86q\x03\x85q\x04Rq\x05X\x05\x00\x00\x00dtypeq\x06ctorch\nfloat32\nq\x07u.";

// Hand-made pickles (each checked with `pickle.loads` in CPython, result in the comment).
// ([1], [1]): the list is memoized, put in a tuple twice, then appended to.
const MEMO_LATE_APPEND: &[u8] = b"\x80\x04]\x94h\x00h\x00\x86h\x00K\x01a0.";
// {b'key': b'va\\l\x00\nA\\q', b'\xff': 1} with encoding='bytes' (Python 2 `str`s, protocol 0).
const PY2_STRINGS: &[u8] = b"(dp0\nS'key'\np1\nS'va\\\\l\\x00\\n\\101\\q'\np2\nsS'\\xff'\np3\nI1\ns.";
// (b'abc', b'\xff\xfe'): SHORT_BINSTRING and BINSTRING.
const PY2_BIN: &[u8] = b"\x80\x02U\x03abcT\x02\x00\x00\x00\xff\xfe\x86.";
// (Point(x=1, y=None), Point(x=1, y=[])): INST then BUILD, and OBJ.
const INST_OBJ: &[u8] = b"((ifakemod\nPoint\n(dVx\nI1\nsb(cfakemod\nPoint\nI1\n(lot.";
// ([5], [5]): POP, POP_MARK, DUP (the 1 left on the stack is ignored).
const STACK_OPS: &[u8] = b"\x80\x02K\x01K\x020(K\x03K\x041]2K\x05a\x86.";
// ([], []): LONG_BINPUT / LONG_BINGET.
const LONG_MEMO: &[u8] = b"\x80\x02]r\x00\x00\x01\x00j\x00\x00\x01\x00\x86.";
// ('hi', b'z'): BINUNICODE8 and BINBYTES8.
const EIGHT_BYTE_LENGTHS: &[u8] =
    b"\x80\x04\x8d\x02\x00\x00\x00\x00\x00\x00\x00hi\x8e\x01\x00\x00\x00\x00\x00\x00\x00z\x86.";
// {1: 'c'}: keys 1, 1.0 and True are one key in Python.
const DUP_KEYS: &[u8] =
    b"\x80\x02}(K\x01X\x01\x00\x00\x00aG?\xf0\x00\x00\x00\x00\x00\x00X\x01\x00\x00\x00b\x88X\x01\x00\x00\x00cu.";
// A Point (NEWOBJ) built twice: {'x': 1, 'y': 2} then {'x': 3} -> __dict__ {'x': 3, 'y': 2}.
const TWO_BUILDS: &[u8] =
    b"\x80\x02cfakemod\nPoint\n)\x81}(X\x01\x00\x00\x00xK\x01X\x01\x00\x00\x00yK\x02ub}X\x01\x00\x00\x00xK\x03sb.";

const DCP_METADATA: &[u8] = include_bytes!("../testdata/dcp_single.metadata");
/// `common/data.pkl` of the Megatron fixture's `common.pt` (a torch.save zip).
const MEGATRON_COMMON: &[u8] = include_bytes!("../testdata/megatron_common_data.pkl");
/// `data.pkl` of `torch.save({'w': torch.arange(6, dtype=torch.float32).reshape(2, 3), 'step': 5})`.
const TORCH_SAVE: &[u8] = include_bytes!("../testdata/torch_save_data.pkl");

/// Every valid vector above, for the truncation and mutation tests.
const VALID: &[&[u8]] = &[
    NESTED_P0,
    NESTED_P1,
    NESTED_P2,
    NESTED_P3,
    NESTED_P4,
    NESTED_P5,
    ODICT_P0,
    ODICT_P2,
    BYTES_P2,
    SHARED_P2,
    POINT_P0,
    POINT_P4,
    EX_P4,
    SLOTTED_P2,
    FRACTION_P2,
    DATE_P0,
    DATE_P3,
    PERSID_P0,
    PERSID_P2,
    LONG4_P2,
    TORCH_SIZE_P2,
    MEMO_LATE_APPEND,
    PY2_STRINGS,
    PY2_BIN,
    INST_OBJ,
    STACK_OPS,
    LONG_MEMO,
    EIGHT_BYTE_LENGTHS,
    DUP_KEYS,
    TWO_BUILDS,
    DCP_METADATA,
    MEGATRON_COMMON,
    TORCH_SAVE,
];

fn load(data: &[u8]) -> PickleValue {
    load_with(data, UnpickleLimits::default()).unwrap()
}

/// The pickle unpickled as a tree and read in place: both must agree, value for value, and
/// fail alike.
fn load_with(data: &[u8], limits: UnpickleLimits) -> Result<PickleValue> {
    let tree = unpickle(data, "test", &limits);
    // On a thread of its own: rebuilding and printing a tree 512 levels deep recurses.
    std::thread::scope(|s| {
        let compare = || {
            let view = unpickle_view(data, "test", &limits).map(|v| tree_of(v.root()));
            assert_eq!(format!("{tree:?}"), format!("{view:?}"), "tree and view differ");
        };
        std::thread::Builder::new().stack_size(256 << 20).spawn_scoped(s, compare).unwrap().join().unwrap();
    });
    tree
}

/// The tree of a value read in place, built from the view alone.
fn tree_of(r: PickleRef<'_>) -> PickleValue {
    let all = |xs: view::Items<'_>| xs.iter().map(tree_of).collect::<Vec<_>>();
    let pairs =
        |xs: Vec<(PickleRef<'_>, PickleRef<'_>)>| xs.into_iter().map(|(k, v)| (tree_of(k), tree_of(v))).collect();
    match r.view() {
        PickleView::None => PickleValue::None,
        PickleView::Bool(b) => PickleValue::Bool(b),
        PickleView::Int(i) => PickleValue::Int(i),
        PickleView::BigInt(b) => PickleValue::BigInt(b.to_vec()),
        PickleView::Float(f) => PickleValue::Float(f),
        PickleView::Str(s) => PickleValue::Str(s.to_string()),
        PickleView::Bytes(b) => PickleValue::Bytes(b.to_vec()),
        PickleView::List(xs) => PickleValue::List(all(xs)),
        PickleView::Tuple(xs) => PickleValue::Tuple(all(xs)),
        PickleView::Set(xs) => PickleValue::Set(all(xs)),
        PickleView::Dict(xs) => PickleValue::Dict(pairs(xs.pairs().collect())),
        PickleView::Global { module, name } => PickleValue::Global { module: module.into(), name: name.into() },
        PickleView::Object(o) => {
            let (module, name) = o.class();
            let (kwargs, list_items, dict_items) = o.extra();
            PickleValue::Object(Box::new(PickleObject {
                module: module.into(),
                name: name.into(),
                args: o.args().into_iter().map(tree_of).collect(),
                kwargs: pairs(kwargs),
                state: o.state().map(tree_of),
                list_items: list_items.into_iter().map(tree_of).collect(),
                dict_items: pairs(dict_items),
            }))
        }
        PickleView::PersistentId(p) => PickleValue::PersistentId(Box::new(tree_of(p))),
    }
}

/// The reason of the error, checked to be a `Corrupt` naming the origin and an offset.
fn fail(data: &[u8]) -> String {
    fail_with(data, UnpickleLimits::default())
}

fn fail_with(data: &[u8], limits: UnpickleLimits) -> String {
    match load_with(data, limits) {
        Err(Error::Corrupt { path, reason }) => {
            assert_eq!(path, std::path::Path::new("test"));
            assert!(reason.starts_with("pickle: at byte "), "{reason}");
            reason
        }
        other => panic!("expected a Corrupt error, got {other:?}"),
    }
}

fn s(x: &str) -> PickleValue {
    PickleValue::Str(x.into())
}
fn i(x: i64) -> PickleValue {
    PickleValue::Int(x)
}
fn b(x: &[u8]) -> PickleValue {
    PickleValue::Bytes(x.to_vec())
}
fn list(v: Vec<PickleValue>) -> PickleValue {
    PickleValue::List(v)
}
fn tuple(v: Vec<PickleValue>) -> PickleValue {
    PickleValue::Tuple(v)
}
fn dict(v: Vec<(PickleValue, PickleValue)>) -> PickleValue {
    PickleValue::Dict(v)
}
fn global(module: &str, name: &str) -> PickleValue {
    PickleValue::Global { module: module.into(), name: name.into() }
}
fn object(module: &str, name: &str, f: impl FnOnce(&mut PickleObject)) -> PickleValue {
    let mut o = PickleObject { module: module.into(), name: name.into(), ..Default::default() };
    f(&mut o);
    PickleValue::Object(Box::new(o))
}
fn get<'v>(v: &'v PickleValue, key: &str) -> &'v PickleValue {
    match v {
        PickleValue::Dict(pairs) => {
            &pairs.iter().find(|(k, _)| *k == s(key)).unwrap_or_else(|| panic!("no key {key}")).1
        }
        other => panic!("not a dict: {other:?}"),
    }
}
fn state(v: &PickleValue) -> &PickleValue {
    match v {
        PickleValue::Object(o) => o.state.as_ref().expect("no state"),
        other => panic!("not an object: {other:?}"),
    }
}

fn nested_expected() -> PickleValue {
    let two70 = PickleValue::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0, 0x40]);
    let minus_two70 = PickleValue::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0, 0xc0]);
    dict(vec![
        (
            s("a"),
            list(vec![
                i(1),
                i(-2),
                i(300),
                i(70000),
                i(-(1 << 40)),
                two70,
                minus_two70,
                PickleValue::Float(1.5),
                PickleValue::Float(f64::INFINITY),
                PickleValue::None,
                PickleValue::Bool(true),
                PickleValue::Bool(false),
            ]),
        ),
        (s("b"), tuple(vec![s("x"), b(b"y\x00\xff"), b(b"ba"), s("é\n\\😀"), s("")])),
        (s("c"), dict(vec![(s("d"), PickleValue::Set(vec![i(1), i(2)])), (s("e"), PickleValue::Set(vec![i(3)]))])),
        (s("f"), tuple(vec![])),
    ])
}

#[test]
fn nested_plain_values_in_every_protocol() {
    for (proto, data) in [NESTED_P0, NESTED_P1, NESTED_P2, NESTED_P3, NESTED_P4, NESTED_P5].iter().enumerate() {
        assert_eq!(load(data), nested_expected(), "protocol {proto}");
    }
}

#[test]
fn python2_strings_and_text_opcodes() {
    assert_eq!(load(PY2_STRINGS), dict(vec![(s("key"), s("va\\l\x00\nA\\q")), (b(b"\xff"), i(1))]));
    assert_eq!(load(PY2_BIN), tuple(vec![s("abc"), b(b"\xff\xfe")]));
    assert_eq!(load(EIGHT_BYTE_LENGTHS), tuple(vec![s("hi"), b(b"z")]));
    // Text integers: python 2 wrote INT for any int that fits in a C long, LONG beyond.
    assert_eq!(load(b"I-9223372036854775808\n."), i(i64::MIN));
    assert_eq!(load(b"I9223372036854775808\n."), PickleValue::BigInt(vec![0, 0, 0, 0, 0, 0, 0, 0x80, 0]));
    assert_eq!(load(b"L12L\n."), i(12));
    assert_eq!(load(b"I0x1f\n."), i(31));
    assert_eq!(load(b"F-2.5e3\n."), PickleValue::Float(-2500.0));
    assert!(matches!(load(b"Fnan\n."), PickleValue::Float(f) if f.is_nan()));
    // raw-unicode-escape: an escaped surrogate pair is one character, a lone one U+FFFD,
    // and an even number of backslashes is no escape.
    assert_eq!(load(b"V\\ud83d\\ude00|\\ud800|\\\\u0041\n."), s("😀|\u{fffd}|\\\\u0041"));
    // BINUNICODE with a surrogate (Python writes them with surrogatepass).
    assert_eq!(load(b"X\x03\x00\x00\x00\xed\xa0\x80."), s("\u{fffd}\u{fffd}\u{fffd}"));
    let digits = "9".repeat(4301);
    assert!(fail(format!("L{digits}L\n.").as_bytes()).contains("4301 digits"));
    assert!(fail(b"S'abc\n.").contains("must be quoted"));
    assert!(fail(b"S'a\\x4'\n.").contains("\\x escape"));
    assert!(fail(b"V\\u12\n.").contains("truncated \\uXXXX"));
    assert!(fail(b"V\\U00110000\n.").contains("out of range"));
    assert!(fail(b"Iabc\n.").contains("invalid integer"));
    assert!(fail(b"Fx\n.").contains("invalid FLOAT"));
}

#[test]
fn ordered_dict_is_a_dict() {
    let expected = dict(vec![(s("a"), i(1)), (s("b"), list(vec![i(2)]))]);
    assert_eq!(load(ODICT_P0), expected);
    assert_eq!(load(ODICT_P2), expected);
    // Python 2's OrderedDict.__reduce__: (OrderedDict, ([[k, v], ...],)).
    let py2 = b"\x80\x02ccollections\nOrderedDict\n](X\x01\x00\x00\x00aK\x01la\x85R.";
    assert_eq!(load(py2), dict(vec![(s("a"), i(1))]));
    // BUILD on a dict (an OrderedDict subclass's __dict__) merges; None is ignored.
    assert_eq!(load(b"\x80\x02}X\x01\x00\x00\x00xK\x01sNb}X\x01\x00\x00\x00yK\x02sb."), {
        dict(vec![(s("x"), i(1)), (s("y"), i(2))])
    });
    assert!(fail(b"\x80\x02}K\x01b.").contains("BUILD of a dict"));
}

#[test]
fn torch_size_is_a_tuple_and_dtypes_stay_globals() {
    assert_eq!(
        load(TORCH_SIZE_P2),
        dict(vec![(s("size"), tuple(vec![i(2), i(3)])), (s("dtype"), global("torch", "float32"))])
    );
}

#[test]
fn protocol_2_bytes_and_bytearray_calls() {
    assert_eq!(load(BYTES_P2), list(vec![b(b"\x00\xffabc"), b("é".as_bytes()), b(b"")]));
    // bytes given as a list of ints, _codecs.encode with utf-8.
    assert_eq!(load(b"c__builtin__\nbytes\n((I1\nI255\nltR."), b(b"\x01\xff"));
    assert_eq!(load(b"c_codecs\nencode\n(V\xe9\nVutf-8\ntR."), b("é".as_bytes()));
    // A code point above 255 cannot be latin-1: the call stays an object.
    assert_eq!(load(b"c_codecs\nencode\n(V\\u0100\nVlatin1\ntR.").class(), Some(("_codecs", "encode")));
}

#[test]
fn builtin_container_calls() {
    assert_eq!(load(b"c__builtin__\nset\n((I1\nI2\nI1\nltR."), PickleValue::Set(vec![i(1), i(2)]));
    assert_eq!(load(b"cbuiltins\nlist\n((I1\nttR."), list(vec![i(1)]));
    assert_eq!(load(b"cbuiltins\ntuple\n((I1\nltR."), tuple(vec![i(1)]));
    assert_eq!(load(b"cbuiltins\ndict\n(((Va\nI1\ntltR."), dict(vec![(s("a"), i(1))]));
    assert_eq!(load(b"cbuiltins\ndict\n(tR."), dict(vec![]));
}

#[test]
fn memo_shares_references() {
    let a = list(vec![i(1)]);
    assert_eq!(load(SHARED_P2), list(vec![a.clone(), a.clone(), tuple(vec![a.clone()])]));
    // The list is appended to after it was fetched from the memo: both references see it.
    assert_eq!(load(MEMO_LATE_APPEND), tuple(vec![a.clone(), a]));
    assert_eq!(load(LONG_MEMO), tuple(vec![list(vec![]), list(vec![])]));
    assert_eq!(load(STACK_OPS), tuple(vec![list(vec![i(5)]), list(vec![i(5)])]));
    // Text PUT/GET (protocol 0) are in NESTED_P0; MEMOIZE in NESTED_P4.
    assert!(fail(b"\x80\x02h\x07.").contains("bad memo index 7"));
    assert!(fail(b"g3\n.").contains("bad memo index 3"));
    assert!(fail(b"p-1\n.").contains("bad PUT index"));
    assert!(fail(b"\x80\x02q\x00.").contains("stack underflow"));
}

#[test]
fn dict_keys_are_deduplicated_as_in_python() {
    assert_eq!(load(DUP_KEYS), dict(vec![(i(1), s("c"))]));
    // Equal tuple keys are one key; distinct objects are distinct keys; sets dedupe.
    let tuples = b"\x80\x02}(K\x01K\x02\x86K\x01K\x01K\x02\x86K\x02u.";
    assert_eq!(load(tuples), dict(vec![(tuple(vec![i(1), i(2)]), i(2))]));
    let objects = b"\x80\x02}(cm\nC\n)\x81K\x01cm\nC\n)\x81K\x02u.";
    assert!(matches!(load(objects), PickleValue::Dict(p) if p.len() == 2));
    assert_eq!(load(b"\x80\x04\x8f(K\x01K\x01K\x02\x90."), PickleValue::Set(vec![i(1), i(2)]));
    assert_eq!(load(b"\x80\x04(K\x02K\x02\x91."), PickleValue::Set(vec![i(2)]));
}

#[test]
fn large_dicts_and_sets_deduplicate_as_small_ones_do() {
    // Past a few keys a collection is indexed by hash: the same keys, first places and last
    // values as when every key is compared. Keys 0..40, then 1.0 (== 1), True (== 1), the
    // tuple (3, 4) twice, the string "k" twice, and NaN twice (never equal to itself).
    let mut p = b"\x80\x02}(".to_vec();
    for k in 0..40u8 {
        p.extend_from_slice(&[b'K', k, b'K', k]);
    }
    p.extend_from_slice(b"G?\xf0\x00\x00\x00\x00\x00\x00K\x64\x88K\x65");
    p.extend_from_slice(b"K\x03K\x04\x86K\x66K\x03K\x04\x86K\x67");
    p.extend_from_slice(b"X\x01\x00\x00\x00kK\x68X\x01\x00\x00\x00kK\x69");
    let nan = b"G\x7f\xf8\x00\x00\x00\x00\x00\x00";
    for v in [0x6a, 0x6b] {
        p.extend_from_slice(nan);
        p.extend_from_slice(&[b'K', v]);
    }
    p.extend_from_slice(b"u.");
    let PickleValue::Dict(pairs) = load(&p) else { panic!("not a dict") };
    assert_eq!(pairs.len(), 40 + 1 + 1 + 2, "{pairs:?}");
    assert_eq!(pairs[1], (i(1), i(0x65)), "1, 1.0 and True are one key, the last value wins");
    assert_eq!(pairs[40], (tuple(vec![i(3), i(4)]), i(0x67)));
    assert_eq!(pairs[41], (s("k"), i(0x69)));
    assert!(matches!(pairs[42].0, PickleValue::Float(f) if f.is_nan()));
    // A set of 30 keys, each twice.
    let mut set = b"\x80\x04\x8f(".to_vec();
    for k in (0..30u8).chain(0..30) {
        set.extend_from_slice(&[b'K', k]);
    }
    set.extend_from_slice(b"\x90.");
    assert_eq!(load(&set), PickleValue::Set((0..30).map(i).collect()));
}

#[test]
fn arena_nodes_are_small() {
    // The memory of a pickle of millions of values is its nodes (issue 29).
    assert!(std::mem::size_of::<machine::Node>() <= 16, "{}", std::mem::size_of::<machine::Node>());
}

#[test]
fn class_instances_newobj_reduce_and_build() {
    let state = dict(vec![(s("x"), i(1)), (s("y"), list(vec![i(2), i(3)]))]);
    assert_eq!(load(POINT_P4), object("fakemod", "Point", |o| o.state = Some(state.clone())), "NEWOBJ + BUILD");
    assert_eq!(
        load(POINT_P0),
        object("fakemod", "Point", |o| {
            o.args = vec![global("__builtin__", "object"), PickleValue::None];
            o.state = Some(state.clone());
        }),
        "copy_reg._reconstructor + BUILD"
    );
    assert_eq!(
        load(EX_P4),
        object("fakemod", "Ex", |o| {
            o.args = vec![i(5)];
            o.kwargs = vec![(s("k"), i(6))];
            o.state = Some(dict(vec![(s("a"), i(5)), (s("k"), i(6))]));
        }),
        "NEWOBJ_EX"
    );
    assert_eq!(
        load(SLOTTED_P2),
        object("fakemod", "Slotted", |o| o.state = Some(tuple(vec![PickleValue::None, dict(vec![(s("a"), i(9))])]))),
        "slots state"
    );
    assert_eq!(
        load(INST_OBJ),
        tuple(vec![
            object("fakemod", "Point", |o| o.state = Some(dict(vec![(s("x"), i(1))]))),
            object("fakemod", "Point", |o| o.args = vec![i(1), list(vec![])]),
        ]),
        "INST and OBJ"
    );
    // Two BUILDs with dict states merge (dict.update); a non-dict later state replaces.
    assert_eq!(
        load(TWO_BUILDS),
        object("fakemod", "Point", |o| o.state = Some(dict(vec![(s("x"), i(3)), (s("y"), i(2))])))
    );
    let replaced = b"\x80\x02cfakemod\nPoint\n)\x81}X\x01\x00\x00\x00xK\x01sbK\x07b.";
    assert_eq!(load(replaced), object("fakemod", "Point", |o| o.state = Some(i(7))));
    // APPEND and SETITEM on objects (list and dict subclasses).
    let items = b"\x80\x02cm\nL\n)\x81K\x01aK\x02K\x03s.";
    assert_eq!(
        load(items),
        object("m", "L", |o| {
            o.list_items = vec![i(1)];
            o.dict_items = vec![(i(2), i(3))];
        })
    );
}

#[test]
fn reduce_of_unknown_globals_stays_an_object() {
    assert_eq!(load(FRACTION_P2), object("fractions", "Fraction", |o| o.args = vec![i(1), i(3)]));
    let date = object("datetime", "date", |o| o.args = vec![b(b"\x07\xe4\x01\x02")]);
    assert_eq!(load(DATE_P0), date);
    assert_eq!(load(DATE_P3), date);
    assert_eq!(load(b"cos\nsystem\n."), global("os", "system"));
    assert!(fail(b"\x80\x02cm\nf\n)R)R.").contains("REDUCE of a value that is not a global"));
    assert!(fail(b"\x80\x02cm\nf\nK\x01R.").contains("REDUCE arguments are not a tuple"));
    assert!(fail(b"\x80\x02K\x01)\x81.").contains("NEWOBJ of a value that is not a global"));
    assert!(fail(b"\x80\x04K\x01K\x02\x93.").contains("STACK_GLOBAL"));
    assert!(fail(b"\x80\x02]]b.").contains("BUILD on a value"));
    assert!(fail(b"\x80\x02)K\x01a.").contains("APPEND to a value"));
    assert!(fail(b"\x80\x02]K\x01K\x01s.").contains("SETITEM on a value"));
    assert!(fail(b"\x80\x04](K\x01\x90.").contains("ADDITEMS to a value"));
    assert!(fail(b"\x80\x02(o.").contains("OBJ without a class"));
}

#[test]
fn persistent_ids() {
    assert_eq!(load(PERSID_P0), list(vec![PickleValue::PersistentId(Box::new(s("pid0"))), i(1)]));
    let pid = tuple(vec![s("storage"), s("k0"), i(3)]);
    assert_eq!(load(PERSID_P2), list(vec![PickleValue::PersistentId(Box::new(pid)), i(1)]));
    assert!(fail(b"P\xff\n.").contains("ASCII"));
}

#[test]
fn big_integers() {
    let v = load(LONG4_P2);
    let PickleValue::List(items) = &v else { panic!("{v:?}") };
    assert_eq!(items.len(), 2);
    let Value::Str(text) = items[0].to_value_lossy() else { panic!() };
    assert_eq!(text.len(), 615);
    assert!(text.starts_with("12623830496605862226") && text.ends_with("81077553168201547776"), "{text}");
    assert_eq!(items[1].to_value_lossy(), Value::Str(format!("-{text}")));
    assert_eq!(items[0].to_plain(), None);
    // LONG1 with redundant sign bytes is still a small int; i64 bounds are exact.
    assert_eq!(load(b"\x80\x02\x8a\x0a\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff."), i(-1));
    assert_eq!(load(b"\x80\x02\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80."), i(i64::MIN));
    assert_eq!(load(b"\x80\x02\x8a\x00."), i(0));
    let two63 = load(b"\x80\x02\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x80\x00.");
    assert_eq!(two63.to_value_lossy(), Value::Str("9223372036854775808".into()));
    assert_eq!(bigint_text(&[0x00, 0x80]), "-32768");
    // Past 4300 digits the text is hexadecimal.
    let mut huge = vec![0u8; 2000];
    huge.push(1);
    assert!(bigint_text(&huge).starts_with("0x1000"));
}

#[test]
fn refused_opcodes() {
    for (data, what) in [
        (EXT1_P2, "extension registry"),
        (EXT2_P2, "extension registry"),
        (EXT4_P2, "extension registry"),
        (NEXT_BUFFER_P5, "out-of-band buffers"),
        (READONLY_BUFFER_P5, "out-of-band buffers"),
        (b"\x80\x02\xff.", "unknown opcode 0xff"),
        (b"\x80\x05\x99.", "unknown opcode 0x99"),
        (b"\x80\x02Z.", "unknown opcode 0x5a"),
    ] {
        let reason = fail(data);
        assert!(reason.contains(what), "{reason}");
        assert!(reason.starts_with("pickle: at byte 2: "), "{reason}");
    }
}

#[test]
fn every_opcode_reaches_its_family() {
    // The dispatch routes each opcode to a family function, which matches it again: an opcode
    // routed to the wrong family would fail as unknown. Each one alone and after a mark and a
    // few values fails or succeeds, but never as an unknown opcode.
    use super::opcodes as op;
    let all = [
        op::MARK,
        op::STOP,
        op::POP,
        op::POP_MARK,
        op::DUP,
        op::FLOAT,
        op::INT,
        op::BININT,
        op::BININT1,
        op::LONG,
        op::BININT2,
        op::NONE,
        op::PERSID,
        op::BINPERSID,
        op::REDUCE,
        op::STRING,
        op::BINSTRING,
        op::SHORT_BINSTRING,
        op::UNICODE,
        op::BINUNICODE,
        op::APPEND,
        op::BUILD,
        op::GLOBAL,
        op::DICT,
        op::EMPTY_DICT,
        op::APPENDS,
        op::GET,
        op::BINGET,
        op::INST,
        op::LONG_BINGET,
        op::LIST,
        op::EMPTY_LIST,
        op::OBJ,
        op::PUT,
        op::BINPUT,
        op::LONG_BINPUT,
        op::SETITEM,
        op::TUPLE,
        op::EMPTY_TUPLE,
        op::SETITEMS,
        op::BINFLOAT,
        op::PROTO,
        op::NEWOBJ,
        op::EXT1,
        op::EXT2,
        op::EXT4,
        op::TUPLE1,
        op::TUPLE2,
        op::TUPLE3,
        op::NEWTRUE,
        op::NEWFALSE,
        op::LONG1,
        op::LONG4,
        op::BINBYTES,
        op::SHORT_BINBYTES,
        op::SHORT_BINUNICODE,
        op::BINUNICODE8,
        op::BINBYTES8,
        op::EMPTY_SET,
        op::ADDITEMS,
        op::FROZENSET,
        op::NEWOBJ_EX,
        op::STACK_GLOBAL,
        op::MEMOIZE,
        op::FRAME,
        op::BYTEARRAY8,
        op::NEXT_BUFFER,
        op::READONLY_BUFFER,
    ];
    let mut seen = std::collections::HashSet::new();
    for o in all {
        assert!(seen.insert(o), "0x{o:02x} listed twice");
        for prefix in [&b""[..], b"\x80\x05(NK\x01K\x02"] {
            let data = [prefix, &[o], b"."].concat();
            if let Err(Error::Corrupt { reason, .. }) = load_with(&data, UnpickleLimits::default()) {
                assert!(!reason.contains("unknown opcode"), "0x{o:02x}: {reason}");
            }
        }
    }
    assert_eq!(seen.len(), 68, "the opcodes of protocols 0-5");
}

#[test]
fn structural_errors() {
    assert_eq!(fail(b"\x80\x06N."), "pickle: at byte 0: unsupported pickle protocol 6");
    assert!(fail(b"").contains("no STOP"));
    assert!(fail(b"\x80\x02N").contains("no STOP"));
    assert!(fail(b"\x80\x02.").contains("stack underflow"));
    assert!(fail(b"\x80\x02(.").contains("stack underflow"));
    assert!(fail(b"\x80\x02Nt.").contains("missing MARK"));
    assert!(fail(b"\x80\x02(a.").contains("stack underflow"));
    assert!(fail(b"\x80\x02N(\x86.").contains("stack underflow"));
    assert!(fail(b"\x80\x02(K\x01d.").contains("odd number"));
    assert!(fail(b"\x80\x02}(K\x01u.").contains("odd number"));
    assert!(fail(b"\x80\x021.").contains("missing MARK"));
    assert_eq!(fail(b"\x80\x02NN\x860\x86."), "pickle: at byte 6: stack underflow");
    // Trailing bytes after STOP are ignored, as pickle.loads does with a file.
    assert_eq!(load(b"\x80\x02K\x05.garbage\xff"), i(5));
    // Stack items left under the result are ignored too.
    assert_eq!(load(b"\x80\x02K\x01K\x02."), i(2));
}

#[test]
fn recursive_structures_are_errors() {
    assert!(fail(RECURSIVE_P2).contains("recursive structure"));
    assert!(fail(RECURSIVE_TUPLE_P2).contains("recursive structure"));
    // An object whose state holds itself.
    assert!(fail(b"\x80\x02cm\nC\n)\x81\x94}X\x01\x00\x00\x00sh\x00sb.").contains("recursive structure"));
}

#[test]
fn truncation_at_every_offset_is_an_error() {
    for data in VALID {
        assert!(load_with(data, UnpickleLimits::default()).is_ok());
        for n in 0..data.len() {
            let reason = fail(&data[..n]);
            assert!(reason.contains("truncated") || reason.contains("no STOP"), "prefix {n}: {reason}");
        }
    }
}

#[test]
fn mutated_inputs_never_panic() {
    // A cheap deterministic cousin of the fuzz target: every byte of every vector replaced
    // by a few values; each result must be a value or an error (tiny limits keep it fast).
    let limits = UnpickleLimits { max_depth: 32, max_values: 10_000, max_bytes: 1 << 16, ..UnpickleLimits::default() };
    for data in VALID {
        let mut m = data.to_vec();
        // Every byte of the small vectors, about 150 positions of the larger files.
        for pos in (0..m.len()).step_by(m.len() / 150 + 1) {
            let orig = m[pos];
            for x in [0x00, 0x01, 0x7f, 0x80, 0xff, orig ^ 0x20, b'(', b'h', b'.'] {
                m[pos] = x;
                if let Ok(v) = unpickle(&m, "mutated", &limits) {
                    let _ = (v.to_plain(), v.to_value_lossy());
                }
            }
            m[pos] = orig;
        }
    }
}

#[test]
fn untrusted_lengths_are_checked_before_allocating() {
    let mut cases: Vec<Vec<u8>> = Vec::new();
    for op in [0x8d, 0x8e, 0x96] {
        // BINUNICODE8, BINBYTES8, BYTEARRAY8 with a length of 2^60, 2^64-1.
        for n in [1u64 << 60, u64::MAX] {
            let mut v = vec![0x80, 4, op];
            v.extend_from_slice(&n.to_le_bytes());
            v.extend_from_slice(b"abc.");
            cases.push(v);
        }
    }
    for op in [b'X', b'B', b'T', 0x8b] {
        // 4-byte lengths: 0xffffffff (negative for BINSTRING and LONG4).
        let mut v = vec![0x80, 4, op];
        v.extend_from_slice(&u32::MAX.to_le_bytes());
        v.extend_from_slice(b"abc.");
        cases.push(v);
    }
    cases.push(b"\x80\x02\x8a\xff\x00.".to_vec());
    cases.push(b"\x80\x02C\xffab.".to_vec());
    for case in cases {
        let reason = fail(&case);
        assert!(reason.contains("truncated") || reason.contains("negative"), "{reason}");
    }
}

/// `n` lists nested in one another, as `[[[...]]]` (EMPTY_LIST n times, APPEND n-1 times).
fn nested_lists(n: usize) -> Vec<u8> {
    let mut v = vec![0x80, 2];
    v.extend(std::iter::repeat_n(b']', n));
    v.extend(std::iter::repeat_n(b'a', n - 1));
    v.push(b'.');
    v
}

#[test]
fn depth_limit() {
    let limits = UnpickleLimits::default();
    assert_eq!(limits.max_depth, 512);
    // Run on a small stack: neither decoding nor dropping may recurse deeply.
    std::thread::Builder::new()
        .stack_size(256 << 10)
        .spawn(move || {
            for n in [511, 512] {
                let v = load_with(&nested_lists(n), limits).unwrap();
                let mut depth = 0;
                let mut cur = &v;
                while let PickleValue::List(items) = cur {
                    depth += 1;
                    match items.first() {
                        Some(next) => cur = next,
                        None => break,
                    }
                }
                assert_eq!(depth, n);
            }
            let reason = fail_with(&nested_lists(513), limits);
            assert!(reason.contains("nesting deeper than 512"), "{reason}");
        })
        .unwrap()
        .join()
        .unwrap();
    // Depth counts objects and their state too; scalars do not count.
    // Point: object > state dict > list y.
    assert!(load_with(POINT_P4, UnpickleLimits { max_depth: 3, ..limits }).is_ok());
    assert!(fail_with(POINT_P4, UnpickleLimits { max_depth: 2, ..limits }).contains("nesting deeper than 2"));
    assert!(load_with(b"K\x01.", UnpickleLimits { max_depth: 0, ..limits }).is_ok());
    // Depth reached through memo references: list k+1 = [memo[k]].
    let mut v = vec![0x80, 2, b']', b'q', 0];
    for k in 0..600u32 {
        v.extend_from_slice(b"(j");
        v.extend_from_slice(&k.to_le_bytes());
        v.extend_from_slice(b"lr");
        v.extend_from_slice(&(k + 1).to_le_bytes());
    }
    v.push(b'.');
    assert!(fail(&v).contains("nesting deeper than 512"));
}

#[test]
fn billion_laughs_hits_max_values() {
    // memo[0] = None; memo[k+1] = (memo[k], memo[k]): 2^61 values once copied out.
    let mut v = vec![0x80, 4, b'N', 0x94];
    for k in 0..60u8 {
        v.extend_from_slice(&[b'h', k, b'h', k, 0x86, 0x94]);
    }
    v.push(b'.');
    let start = std::time::Instant::now();
    let reason = fail(&v);
    // The budget relative to the input trips long before the absolute max_values.
    assert!(reason.contains("budget") && reason.contains("365-byte pickle"), "{reason}");
    let reason = fail_with(&v, UnpickleLimits { output_per_input_byte: usize::MAX, ..UnpickleLimits::default() });
    assert!(reason.contains("more than 50000000 values"), "{reason}");
    assert!(start.elapsed() < std::time::Duration::from_secs(5));
    // Just under and just over a small limit: 2^(k+1) - 1 values at level k.
    let mut v = vec![0x80, 4, b'N', 0x94];
    for k in 0..9u8 {
        v.extend_from_slice(&[b'h', k, b'h', k, 0x86, 0x94]);
    }
    v.push(b'.');
    let limits = |max_values| UnpickleLimits { max_values, ..UnpickleLimits::default() };
    assert!(load_with(&v, limits(1023)).is_ok());
    assert!(fail_with(&v, limits(1022)).contains("more than 1022 values"));
    // Values pushed while decoding count too.
    let many = [&b"\x80\x02("[..], &b"K\x01".repeat(100), b"l."].concat();
    assert!(fail_with(&many, limits(50)).contains("more than 50 values"));
}

#[test]
fn bytes_limit() {
    let limits = |max_bytes| UnpickleLimits { max_bytes, ..UnpickleLimits::default() };
    let payload = [&b"\x80\x03B\x00\x01\x00\x00"[..], &[b'x'; 256], b"."].concat();
    assert!(load_with(&payload, limits(256)).is_ok());
    assert!(fail_with(&payload, limits(255)).contains("more than 255 bytes"));
    // A shared string counts once per copy in the result.
    let mut shared = [&b"\x80\x04C\x64"[..], &[b'y'; 100], b"\x94"].concat();
    for k in 0..4u8 {
        shared.extend_from_slice(&[b'h', k, b'h', k, 0x86, 0x94]);
    }
    shared.push(b'.');
    assert!(load_with(&shared, limits(1600)).is_ok());
    assert!(fail_with(&shared, limits(1599)).contains("more than 1599 bytes"));
}

#[test]
fn to_plain() {
    let plain = load(ODICT_P2).to_plain().unwrap();
    assert_eq!(plain, Value::Map(vec![("a".into(), Value::Int(1)), ("b".into(), Value::List(vec![Value::Int(2)]))]));
    assert_eq!(
        load(MEGATRON_COMMON).to_plain().unwrap(),
        Value::Map(vec![
            ("iteration".into(), Value::Int(1234)),
            (
                "args".into(),
                Value::Map(vec![("lr".into(), Value::Float(0.001)), ("name".into(), Value::Str("fixture".into()))])
            ),
        ])
    );
    assert_eq!(
        load(PY2_BIN).to_plain(),
        Some(Value::List(vec![Value::Str("abc".into()), Value::Bytes(vec![0xff, 0xfe])]))
    );
    assert_eq!(load(b"N.").to_plain(), Some(Value::Null));
    // Not plain: sets, big ints, globals, objects, persistent ids, non-str keys.
    assert_eq!(nested_expected().to_plain(), None);
    assert_eq!(load(TORCH_SIZE_P2).to_plain(), None);
    assert_eq!(load(POINT_P4).to_plain(), None);
    assert_eq!(load(PERSID_P2).to_plain(), None);
    assert_eq!(load(DUP_KEYS).to_plain(), None);
    assert_eq!(load(b"\x80\x04\x8f.").to_plain(), None);
}

#[test]
fn to_value_lossy() {
    let str = |x: &str| Value::Str(x.into());
    let nested = nested_expected().to_value_lossy();
    assert_eq!(nested.get("a").unwrap(), &{
        let Value::List(items) = nested.get("a").unwrap() else { panic!() };
        assert_eq!(items[5], str("1180591620717411303424"));
        assert_eq!(items[6], str("-1180591620717411303424"));
        Value::List(items.clone())
    });
    assert_eq!(
        nested.get("c").unwrap(),
        &Value::Map(vec![
            ("d".into(), Value::List(vec![Value::Int(1), Value::Int(2)])),
            ("e".into(), Value::List(vec![Value::Int(3)])),
        ])
    );
    assert_eq!(
        load(EX_P4).to_value_lossy(),
        Value::Map(vec![
            ("__class__".into(), str("fakemod.Ex")),
            ("args".into(), Value::List(vec![Value::Int(5)])),
            ("kwargs".into(), Value::Map(vec![("k".into(), Value::Int(6))])),
            ("state".into(), Value::Map(vec![("a".into(), Value::Int(5)), ("k".into(), Value::Int(6))])),
        ])
    );
    assert_eq!(
        load(b"\x80\x02cm\nL\n)\x81K\x01a.").to_value_lossy(),
        Value::Map(vec![("__class__".into(), str("m.L")), ("items".into(), Value::List(vec![Value::Int(1)]))])
    );
    assert_eq!(
        load(b"\x80\x02cm\nD\n)\x81K\x02K\x03s.").to_value_lossy(),
        Value::Map(vec![
            ("__class__".into(), str("m.D")),
            ("items".into(), Value::Map(vec![("2".into(), Value::Int(3))]))
        ])
    );
    assert_eq!(
        load(TORCH_SIZE_P2).to_value_lossy(),
        Value::Map(vec![
            ("size".into(), Value::List(vec![Value::Int(2), Value::Int(3)])),
            ("dtype".into(), str("torch.float32")),
        ])
    );
    assert_eq!(
        load(PERSID_P0).to_value_lossy(),
        Value::List(vec![Value::Map(vec![("__persistent_id__".into(), str("pid0"))]), Value::Int(1)])
    );
    // Keys that are not strings are rendered like Python's repr.
    let keys = b"\x80\x02}(K\x02N\x88NNNK\x00X\x01\x00\x00\x00a\x86NC\x02\x00zNG?\xf8\x00\x00\x00\x00\x00\x00Nu.";
    let Value::Map(entries) = load(keys).to_value_lossy() else { panic!() };
    let names: Vec<&str> = entries.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(names, ["2", "True", "None", "(0, 'a')", "b'\\x00z'", "1.5"]);
    // An unhashable key (a tuple holding a list) is kept as given.
    let odd_keys = load(b"\x80\x02}(K\x01K\x02\x86N]\x85Nu.");
    let names: Vec<String> = match odd_keys.to_value_lossy() {
        Value::Map(e) => e.into_iter().map(|(k, _)| k).collect(),
        other => panic!("{other:?}"),
    };
    assert_eq!(names, ["(1, 2)", "([],)"]);
    let tuple_key = tuple((0..500).map(i).collect());
    assert!(key_text(&tuple_key).chars().count() <= KEY_TEXT_MAX + 1);
}

#[test]
fn real_dcp_metadata() {
    let md = load(DCP_METADATA);
    assert_eq!(md.class(), Some(("torch.distributed.checkpoint.metadata", "Metadata")));
    let st = state(&md);
    let PickleValue::Dict(sdm) = get(st, "state_dict_metadata") else { panic!() };
    let keys: Vec<&PickleValue> = sdm.iter().map(|(k, _)| k).collect();
    let expected = [
        "model.w_f32",
        "model.w_bf16",
        "model.w_f16",
        "model.ids_i64",
        "model.mask_bool",
        "model.bytes_u8",
        "model.scalar",
        "model.empty",
        "step",
        "note",
        "lrs",
    ];
    assert_eq!(keys, expected.iter().map(|k| s(k)).collect::<Vec<_>>().iter().collect::<Vec<_>>());
    let w = get(&PickleValue::Dict(sdm.clone()), "model.w_f32").clone();
    assert_eq!(w.class(), Some(("torch.distributed.checkpoint.metadata", "TensorStorageMetadata")));
    assert_eq!(get(state(&w), "size"), &tuple(vec![i(7), i(5)]));
    let props = get(state(&w), "properties");
    let PickleValue::Tuple(p) = state(props) else { panic!("{props:?}") };
    assert_eq!(p[0], global("torch", "float32"));
    let PickleValue::Dict(storage) = get(st, "storage_data") else { panic!() };
    assert_eq!(storage.len(), 11);
    let mut ends = Vec::new();
    for (k, v) in storage {
        assert_eq!(k.class(), Some(("torch.distributed.checkpoint.metadata", "MetadataIndex")));
        assert_eq!(v.class(), Some(("torch.distributed.checkpoint.filesystem", "_StorageInfo")));
        let info = state(v);
        assert_eq!(get(info, "relative_path"), &s("__0_0.distcp"));
        let (PickleValue::Int(offset), PickleValue::Int(length)) = (get(info, "offset"), get(info, "length")) else {
            panic!("{info:?}")
        };
        ends.push((*offset, *offset + *length));
    }
    // The items tile the data file.
    ends.sort();
    assert_eq!(ends[0].0, 0);
    assert!(ends.windows(2).all(|w| w[0].1 == w[1].0));
    assert_eq!(ends.last().unwrap().1, 16911);
    // The lossy rendering has the class names and, for keys that are objects, a repr.
    let lossy = md.to_value_lossy();
    assert_eq!(lossy.get("__class__"), Some(&Value::Str("torch.distributed.checkpoint.metadata.Metadata".into())));
    let storage = lossy.get("state").and_then(|s| s.get("storage_data")).unwrap();
    assert!(storage.get("<torch.distributed.checkpoint.metadata.MetadataIndex object>").is_some());
}

#[test]
fn real_torch_save_data_pkl() {
    let v = load(TORCH_SAVE);
    assert_eq!(get(&v, "step"), &i(5));
    let w = get(&v, "w");
    assert_eq!(
        w,
        &object("torch._utils", "_rebuild_tensor_v2", |o| {
            o.args = vec![
                PickleValue::PersistentId(Box::new(tuple(vec![
                    s("storage"),
                    global("torch", "FloatStorage"),
                    s("0"),
                    s("cpu"),
                    i(6),
                ]))),
                i(0),
                tuple(vec![i(2), i(3)]),
                tuple(vec![i(3), i(1)]),
                PickleValue::Bool(false),
                dict(vec![]),
            ]
        })
    );
}
