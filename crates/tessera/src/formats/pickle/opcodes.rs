//! The opcodes of pickle protocols 0–5, named as in CPython's `pickle.py` (where each one's
//! argument and stack effect is described).

// Protocol 0 and 1.

/// Push a mark: the start of the items the next mark-consuming opcode takes.
pub(super) const MARK: u8 = b'(';
/// End of the pickle: the value on top of the stack is the result.
pub(super) const STOP: u8 = b'.';
/// Discard the top of the stack (or the top mark, when nothing is above it).
pub(super) const POP: u8 = b'0';
/// Discard the stack down to and including the top mark.
pub(super) const POP_MARK: u8 = b'1';
/// Push the top of the stack again.
pub(super) const DUP: u8 = b'2';
/// A float as decimal text, to the end of the line.
pub(super) const FLOAT: u8 = b'F';
/// An integer (or `00`/`01` for a bool) as decimal text, to the end of the line.
pub(super) const INT: u8 = b'I';
/// A 4-byte signed integer.
pub(super) const BININT: u8 = b'J';
/// A 1-byte unsigned integer.
pub(super) const BININT1: u8 = b'K';
/// An integer as decimal text with an optional `L` suffix, to the end of the line.
pub(super) const LONG: u8 = b'L';
/// A 2-byte unsigned integer.
pub(super) const BININT2: u8 = b'M';
/// `None`.
pub(super) const NONE: u8 = b'N';
/// A persistent id given as an ASCII line.
pub(super) const PERSID: u8 = b'P';
/// A persistent id taken from the stack.
pub(super) const BINPERSID: u8 = b'Q';
/// Call the callable under the top with the argument tuple on top.
pub(super) const REDUCE: u8 = b'R';
/// A quoted, escaped Python 2 `str`, to the end of the line.
pub(super) const STRING: u8 = b'S';
/// A Python 2 `str` with a 4-byte signed length.
pub(super) const BINSTRING: u8 = b'T';
/// A Python 2 `str` with a 1-byte length.
pub(super) const SHORT_BINSTRING: u8 = b'U';
/// A `raw-unicode-escape` string, to the end of the line.
pub(super) const UNICODE: u8 = b'V';
/// A UTF-8 string with a 4-byte length.
pub(super) const BINUNICODE: u8 = b'X';
/// Append the top of the stack to the list under it.
pub(super) const APPEND: u8 = b'a';
/// Set the state of the object under the top (`__setstate__` or `__dict__` update).
pub(super) const BUILD: u8 = b'b';
/// A global given as module and name lines.
pub(super) const GLOBAL: u8 = b'c';
/// A dict of the key/value pairs above the mark.
pub(super) const DICT: u8 = b'd';
/// An empty dict.
pub(super) const EMPTY_DICT: u8 = b'}';
/// Append the items above the mark to the list under the mark.
pub(super) const APPENDS: u8 = b'e';
/// Push a memo entry whose index is decimal text.
pub(super) const GET: u8 = b'g';
/// Push a memo entry with a 1-byte index.
pub(super) const BINGET: u8 = b'h';
/// Call a global given as module and name lines with the items above the mark.
pub(super) const INST: u8 = b'i';
/// Push a memo entry with a 4-byte index.
pub(super) const LONG_BINGET: u8 = b'j';
/// A list of the items above the mark.
pub(super) const LIST: u8 = b'l';
/// An empty list.
pub(super) const EMPTY_LIST: u8 = b']';
/// Call the first item above the mark with the others.
pub(super) const OBJ: u8 = b'o';
/// Store the top of the stack in the memo at an index given as decimal text.
pub(super) const PUT: u8 = b'p';
/// Store the top of the stack in the memo at a 1-byte index.
pub(super) const BINPUT: u8 = b'q';
/// Store the top of the stack in the memo at a 4-byte index.
pub(super) const LONG_BINPUT: u8 = b'r';
/// Set a key (under the top) to a value (the top) in the dict under them.
pub(super) const SETITEM: u8 = b's';
/// A tuple of the items above the mark.
pub(super) const TUPLE: u8 = b't';
/// An empty tuple.
pub(super) const EMPTY_TUPLE: u8 = b')';
/// Set the key/value pairs above the mark in the dict under the mark.
pub(super) const SETITEMS: u8 = b'u';
/// An 8-byte big-endian float.
pub(super) const BINFLOAT: u8 = b'G';

// Protocol 2.

/// The protocol number (first opcode of protocol 2 and later pickles).
pub(super) const PROTO: u8 = 0x80;
/// Instantiate the class under the top with the argument tuple on top (`cls.__new__`).
pub(super) const NEWOBJ: u8 = 0x81;
/// A global from the extension registry, by a 1-byte code.
pub(super) const EXT1: u8 = 0x82;
/// A global from the extension registry, by a 2-byte code.
pub(super) const EXT2: u8 = 0x83;
/// A global from the extension registry, by a 4-byte code.
pub(super) const EXT4: u8 = 0x84;
/// A tuple of the top item.
pub(super) const TUPLE1: u8 = 0x85;
/// A tuple of the top two items.
pub(super) const TUPLE2: u8 = 0x86;
/// A tuple of the top three items.
pub(super) const TUPLE3: u8 = 0x87;
/// `True`.
pub(super) const NEWTRUE: u8 = 0x88;
/// `False`.
pub(super) const NEWFALSE: u8 = 0x89;
/// A little-endian two's complement integer with a 1-byte length.
pub(super) const LONG1: u8 = 0x8a;
/// A little-endian two's complement integer with a 4-byte signed length.
pub(super) const LONG4: u8 = 0x8b;

// Protocol 3.

/// Bytes with a 4-byte length.
pub(super) const BINBYTES: u8 = b'B';
/// Bytes with a 1-byte length.
pub(super) const SHORT_BINBYTES: u8 = b'C';

// Protocol 4.

/// A UTF-8 string with a 1-byte length.
pub(super) const SHORT_BINUNICODE: u8 = 0x8c;
/// A UTF-8 string with an 8-byte length.
pub(super) const BINUNICODE8: u8 = 0x8d;
/// Bytes with an 8-byte length.
pub(super) const BINBYTES8: u8 = 0x8e;
/// An empty set.
pub(super) const EMPTY_SET: u8 = 0x8f;
/// Add the items above the mark to the set under the mark.
pub(super) const ADDITEMS: u8 = 0x90;
/// A frozenset of the items above the mark.
pub(super) const FROZENSET: u8 = 0x91;
/// Instantiate a class with an argument tuple and a keyword dict (`cls.__new__`).
pub(super) const NEWOBJ_EX: u8 = 0x92;
/// A global from the module and name strings on the stack.
pub(super) const STACK_GLOBAL: u8 = 0x93;
/// Store the top of the stack in the memo at the next index.
pub(super) const MEMOIZE: u8 = 0x94;
/// The start of a frame, with its 8-byte length.
pub(super) const FRAME: u8 = 0x95;

// Protocol 5.

/// A bytearray with an 8-byte length.
pub(super) const BYTEARRAY8: u8 = 0x96;
/// An out-of-band buffer.
pub(super) const NEXT_BUFFER: u8 = 0x97;
/// Make the out-of-band buffer on top read-only.
pub(super) const READONLY_BUFFER: u8 = 0x98;
