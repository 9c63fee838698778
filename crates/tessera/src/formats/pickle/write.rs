//! A minimal pickle encoder: the values DCP metadata and `torch.save` archives need, written
//! with the opcodes Python's own pickler uses for them. Pure: a value in, bytes out.
//!
//! Protocol 2 is what `torch.save` writes and the only one `torch.load(weights_only=True)`
//! reads fully (its unpickler knows `GLOBAL` but not `STACK_GLOBAL`, `BINUNICODE` but not
//! `SHORT_BINUNICODE`, and no `BINBYTES`: bytes go through `_codecs.encode`, as protocol 2
//! always did). Protocol 4 (what `pickle.dump` writes for DCP's `.metadata`) uses the shorter
//! forms. No memo is written: every value is spelled out where it occurs, which keeps the
//! encoder stateless (and the reader's sharing rules irrelevant).

use crate::model::Value;

/// A value to pickle. Only the shapes DCP and `torch.save` use: plain data, references to
/// globals, calls (`REDUCE`), class instances (`NEWOBJ` + `BUILD`) and persistent ids.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Pk {
    None,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<Pk>),
    Tuple(Vec<Pk>),
    Dict(Vec<(Pk, Pk)>),
    /// `module.name`, unevaluated (a class, function or constant such as `torch.float32`).
    Global(String, String),
    /// `func(*args)`.
    Reduce(Box<Pk>, Vec<Pk>),
    /// `cls.__new__(cls, *args)`, then `BUILD` with the state when there is one (how
    /// dataclasses and classes with `__getstate__` pickle).
    Obj {
        class: Box<Pk>,
        args: Vec<Pk>,
        state: Option<Box<Pk>>,
    },
    /// A persistent id (`torch.save`'s reference to a storage).
    PersId(Box<Pk>),
    /// The opcodes of one value taken from another pickle of protocol 2 or 3 (its body: no
    /// `PROTO`, no `STOP`), spliced in as they are: how a value tessera holds only as
    /// `torch.save` bytes goes into a pickle it writes. Sound because this writer keeps no
    /// memo: the fragment's `PUT`s and `GET`s refer to its own objects only (a later fragment's
    /// `PUT` to the same index replaces the entry, after the earlier fragment is done with it).
    Raw(Vec<u8>),
}

impl Pk {
    pub(crate) fn global(module: &str, name: &str) -> Pk {
        Pk::Global(module.into(), name.into())
    }
    pub(crate) fn str(s: &str) -> Pk {
        Pk::Str(s.into())
    }
    /// A call of `module.name(*args)`.
    pub(crate) fn call(module: &str, name: &str, args: Vec<Pk>) -> Pk {
        Pk::Reduce(Box::new(Pk::global(module, name)), args)
    }
    /// An instance of `module.name` built from `state` (a dataclass: a dict of its fields).
    pub(crate) fn object(module: &str, name: &str, state: Pk) -> Pk {
        Pk::Obj { class: Box::new(Pk::global(module, name)), args: Vec::new(), state: Some(Box::new(state)) }
    }
    /// A dict with string keys.
    pub(crate) fn fields(items: Vec<(&str, Pk)>) -> Pk {
        Pk::Dict(items.into_iter().map(|(k, v)| (Pk::str(k), v)).collect())
    }
    /// A tuple of non-negative ints.
    pub(crate) fn dims(xs: &[u64]) -> Pk {
        Pk::Tuple(xs.iter().map(|&x| Pk::Int(x as i64)).collect())
    }
}

impl From<&Value> for Pk {
    /// A plain value as Python holds it (maps become dicts in their order).
    fn from(v: &Value) -> Pk {
        match v {
            Value::Null => Pk::None,
            Value::Bool(b) => Pk::Bool(*b),
            Value::Int(i) => Pk::Int(*i),
            Value::Float(f) => Pk::Float(*f),
            Value::Str(s) => Pk::Str(s.clone()),
            Value::Bytes(b) => Pk::Bytes(b.clone()),
            Value::List(xs) => Pk::List(xs.iter().map(Pk::from).collect()),
            Value::Map(kv) => Pk::Dict(kv.iter().map(|(k, v)| (Pk::Str(k.clone()), Pk::from(v))).collect()),
        }
    }
}

const MARK: u8 = b'(';
const STOP: u8 = b'.';
const NONE: u8 = b'N';
const NEWTRUE: u8 = 0x88;
const NEWFALSE: u8 = 0x89;
const BININT: u8 = b'J';
const BININT1: u8 = b'K';
const BININT2: u8 = b'M';
const LONG1: u8 = 0x8a;
const BINFLOAT: u8 = b'G';
const BINUNICODE: u8 = b'X';
const SHORT_BINUNICODE: u8 = 0x8c;
const BINBYTES: u8 = b'B';
const SHORT_BINBYTES: u8 = b'C';
const EMPTY_LIST: u8 = b']';
const APPENDS: u8 = b'e';
const EMPTY_TUPLE: u8 = b')';
const TUPLE: u8 = b't';
const TUPLE1: u8 = 0x85;
const TUPLE2: u8 = 0x86;
const TUPLE3: u8 = 0x87;
const EMPTY_DICT: u8 = b'}';
const SETITEMS: u8 = b'u';
const GLOBAL: u8 = b'c';
const STACK_GLOBAL: u8 = 0x93;
const REDUCE: u8 = b'R';
const NEWOBJ: u8 = 0x81;
const BUILD: u8 = b'b';
const BINPERSID: u8 = b'Q';
const PROTO: u8 = 0x80;

/// Python's pickler batches `APPENDS`/`SETITEMS` by this many items; readers do not care, but
/// the same batches keep the stack a reader must hold small.
const BATCH: usize = 1000;

/// The pickle of `v` (protocol 2, 3 or 4; see the module's note on what each changes).
pub(crate) fn pickle(v: &Pk, protocol: u8) -> Vec<u8> {
    debug_assert!((2..=4).contains(&protocol));
    let mut w = Writer { out: vec![PROTO, protocol], protocol };
    w.value(v);
    w.out.push(STOP);
    w.out
}

struct Writer {
    out: Vec<u8>,
    protocol: u8,
}

impl Writer {
    fn value(&mut self, v: &Pk) {
        match v {
            Pk::None => self.out.push(NONE),
            Pk::Bool(b) => self.out.push(if *b { NEWTRUE } else { NEWFALSE }),
            Pk::Int(i) => self.int(*i),
            Pk::Float(f) => {
                self.out.push(BINFLOAT);
                self.out.extend_from_slice(&f.to_bits().to_be_bytes());
            }
            Pk::Str(s) => self.text(s),
            Pk::Bytes(b) => self.bytes(b),
            Pk::List(xs) => {
                self.out.push(EMPTY_LIST);
                for batch in xs.chunks(BATCH) {
                    self.out.push(MARK);
                    batch.iter().for_each(|x| self.value(x));
                    self.out.push(APPENDS);
                }
            }
            Pk::Tuple(xs) => {
                match xs.len() {
                    0 => {}
                    1..=3 => xs.iter().for_each(|x| self.value(x)),
                    _ => {
                        self.out.push(MARK);
                        xs.iter().for_each(|x| self.value(x));
                    }
                }
                self.out.push(match xs.len() {
                    0 => EMPTY_TUPLE,
                    1 => TUPLE1,
                    2 => TUPLE2,
                    3 => TUPLE3,
                    _ => TUPLE,
                });
            }
            Pk::Dict(kv) => {
                self.out.push(EMPTY_DICT);
                for batch in kv.chunks(BATCH) {
                    self.out.push(MARK);
                    for (k, v) in batch {
                        self.value(k);
                        self.value(v);
                    }
                    self.out.push(SETITEMS);
                }
            }
            Pk::Global(module, name) => {
                if self.protocol >= 4 {
                    self.text(module);
                    self.text(name);
                    self.out.push(STACK_GLOBAL);
                } else {
                    // Protocol 2 names globals as two text lines; neither part can hold a newline
                    // (they are Python identifiers, which the callers here always pass).
                    debug_assert!(!module.contains('\n') && !name.contains('\n'));
                    self.out.push(GLOBAL);
                    for part in [module, name] {
                        self.out.extend_from_slice(part.as_bytes());
                        self.out.push(b'\n');
                    }
                }
            }
            Pk::Reduce(func, args) => {
                self.value(func);
                self.value(&Pk::Tuple(args.clone()));
                self.out.push(REDUCE);
            }
            Pk::Obj { class, args, state } => {
                self.value(class);
                self.value(&Pk::Tuple(args.clone()));
                self.out.push(NEWOBJ);
                if let Some(state) = state {
                    self.value(state);
                    self.out.push(BUILD);
                }
            }
            Pk::PersId(pid) => {
                self.value(pid);
                self.out.push(BINPERSID);
            }
            Pk::Raw(body) => self.out.extend_from_slice(body),
        }
    }

    fn int(&mut self, i: i64) {
        if (0..256).contains(&i) {
            self.out.extend_from_slice(&[BININT1, i as u8]);
        } else if (0..65536).contains(&i) {
            self.out.push(BININT2);
            self.out.extend_from_slice(&(i as u16).to_le_bytes());
        } else if i32::try_from(i).is_ok() {
            self.out.push(BININT);
            self.out.extend_from_slice(&(i as i32).to_le_bytes());
        } else {
            // LONG1: the shortest little-endian two's complement that keeps the sign.
            let bytes = i.to_le_bytes();
            let mut n = 8;
            while n > 1 {
                let (top, below) = (bytes[n - 1], bytes[n - 2]);
                let redundant = (top == 0 && below < 0x80) || (top == 0xff && below >= 0x80);
                if !redundant {
                    break;
                }
                n -= 1;
            }
            self.out.extend_from_slice(&[LONG1, n as u8]);
            self.out.extend_from_slice(&bytes[..n]);
        }
    }

    fn text(&mut self, s: &str) {
        if self.protocol >= 4 && s.len() < 256 {
            self.out.extend_from_slice(&[SHORT_BINUNICODE, s.len() as u8]);
        } else {
            self.out.push(BINUNICODE);
            self.out.extend_from_slice(&(s.len() as u32).to_le_bytes());
        }
        self.out.extend_from_slice(s.as_bytes());
    }

    fn bytes(&mut self, b: &[u8]) {
        if self.protocol >= 3 {
            if b.len() < 256 {
                self.out.extend_from_slice(&[SHORT_BINBYTES, b.len() as u8]);
            } else {
                self.out.push(BINBYTES);
                self.out.extend_from_slice(&(b.len() as u32).to_le_bytes());
            }
            self.out.extend_from_slice(b);
        } else {
            // Protocol 2 has no bytes opcode: Python pickles `bytes` as
            // `_codecs.encode(<the bytes as latin-1 text>, 'latin1')`.
            let latin1: String = b.iter().map(|&c| c as char).collect();
            self.value(&Pk::call("_codecs", "encode", vec![Pk::Str(latin1), Pk::str("latin1")]));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::formats::pickle::{unpickle, PickleObject, PickleValue, UnpickleLimits};

    fn back(v: &Pk, protocol: u8) -> PickleValue {
        unpickle(&pickle(v, protocol), "test", &UnpickleLimits::default()).unwrap()
    }

    #[test]
    fn plain_values_round_trip_in_every_protocol() {
        let ints = [
            0,
            1,
            255,
            256,
            65535,
            65536,
            -1,
            -128,
            -129,
            i32::MAX as i64,
            i32::MIN as i64,
            1 << 40,
            i64::MAX,
            i64::MIN,
        ];
        let value = Value::Map(vec![
            ("none".into(), Value::Null),
            ("t".into(), Value::Bool(true)),
            ("f".into(), Value::Bool(false)),
            ("ints".into(), Value::List(ints.iter().map(|&i| Value::Int(i)).collect())),
            ("floats".into(), Value::List(vec![Value::Float(1.5), Value::Float(-0.0), Value::Float(f64::INFINITY)])),
            ("text".into(), Value::Str("é\n\\😀".into())),
            ("long".into(), Value::Str("x".repeat(300))),
            ("bytes".into(), Value::Bytes(vec![0, 0x7f, 0x80, 0xff])),
            ("big bytes".into(), Value::Bytes((0..=255u8).cycle().take(700).collect())),
            ("empty".into(), Value::List(vec![])),
            ("many".into(), Value::List((0..2500).map(Value::Int).collect())),
            ("nested".into(), Value::Map(vec![("a".into(), Value::List(vec![Value::Map(vec![])]))])),
        ]);
        for protocol in 2..=4 {
            assert_eq!(back(&Pk::from(&value), protocol).to_plain(), Some(value.clone()), "protocol {protocol}");
        }
    }

    #[test]
    fn tuples_globals_calls_objects_and_persistent_ids() {
        for protocol in 2..=4 {
            for n in 0..6 {
                let t = Pk::Tuple((0..n).map(Pk::Int).collect());
                assert_eq!(back(&t, protocol), PickleValue::Tuple((0..n).map(PickleValue::Int).collect()));
            }
            assert_eq!(
                back(&Pk::global("torch", "float32"), protocol),
                PickleValue::Global { module: "torch".into(), name: "float32".into() }
            );
            let call = Pk::call("m", "f", vec![Pk::Int(1), Pk::str("a")]);
            let PickleValue::Object(o) = back(&call, protocol) else { panic!("not an object") };
            assert_eq!((o.module.as_str(), o.name.as_str()), ("m", "f"));
            assert_eq!(o.args, vec![PickleValue::Int(1), PickleValue::Str("a".into())]);
            assert_eq!(o.state, None);

            let obj = Pk::object("pkg.mod", "Cls", Pk::fields(vec![("x", Pk::Int(3))]));
            let expected = PickleObject {
                module: "pkg.mod".into(),
                name: "Cls".into(),
                state: Some(PickleValue::Dict(vec![(PickleValue::Str("x".into()), PickleValue::Int(3))])),
                ..Default::default()
            };
            assert_eq!(back(&obj, protocol), PickleValue::Object(Box::new(expected)));

            let pid = Pk::PersId(Box::new(Pk::Tuple(vec![Pk::str("storage"), Pk::Int(4)])));
            assert_eq!(
                back(&pid, protocol),
                PickleValue::PersistentId(Box::new(PickleValue::Tuple(vec![
                    PickleValue::Str("storage".into()),
                    PickleValue::Int(4)
                ])))
            );
        }
    }

    #[test]
    fn protocol_2_uses_only_what_weights_only_loading_reads() {
        // Bytes as `_codecs.encode`, globals as GLOBAL lines, text as BINUNICODE.
        let p = pickle(&Pk::List(vec![Pk::Bytes(vec![1]), Pk::global("a", "b"), Pk::str("s")]), 2);
        assert_eq!(
            p,
            b"\x80\x02](c_codecs\nencode\nX\x01\x00\x00\x00\x01X\x06\x00\x00\x00latin1\x86Rca\nb\nX\x01\x00\x00\x00se."
        );
    }
}
