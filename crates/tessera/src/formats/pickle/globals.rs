//! Globals and calls: the known callables (`collections.OrderedDict`, `torch.Size`,
//! `_codecs.encode`, the `builtins` containers and bytes, the `copyreg` helpers) become plain
//! values when their arguments have the expected shape; any other call stays an unevaluated
//! object naming its class, and `BUILD` records (or merges) its state. Nothing is imported or
//! run.

use super::machine::{Id, Keyed, Machine, Node, ObjExtra, ObjNode, Slot};
use crate::error::Result;

/// Callables and classes the unpickler turns into plain values.
#[derive(Clone, Copy)]
enum Known {
    Dict,
    TorchSize,
    CodecsEncode,
    Bytes,
    Set,
    List,
    Tuple,
    Reconstructor,
    NewObj,
    NewObjEx,
}

/// The known callable `module.name` names, if any (Python 2 module names too).
fn known_kind(module: &str, name: &str) -> Option<Known> {
    let module = match module {
        "__builtin__" => "builtins",
        "copy_reg" => "copyreg",
        m => m,
    };
    Some(match (module, name) {
        ("collections", "OrderedDict") | ("builtins", "dict") => Known::Dict,
        ("torch", "Size") => Known::TorchSize,
        ("_codecs", "encode") => Known::CodecsEncode,
        ("builtins", "bytes" | "bytearray") => Known::Bytes,
        ("builtins", "set" | "frozenset") => Known::Set,
        ("builtins", "list") => Known::List,
        ("builtins", "tuple") => Known::Tuple,
        ("copyreg", "_reconstructor") => Known::Reconstructor,
        ("copyreg", "__newobj__") => Known::NewObj,
        ("copyreg", "__newobj_ex__") => Known::NewObjEx,
        _ => return None,
    })
}

/// Encodes `s` as `_codecs.encode(s, encoding)` would, for the encodings pickles use.
fn encode_str(s: &str, encoding: &str) -> Option<Vec<u8>> {
    let enc = encoding.to_ascii_lowercase().replace('_', "-");
    match enc.as_str() {
        "latin1" | "latin-1" | "iso-8859-1" | "iso8859-1" | "l1" => {
            s.chars().map(|c| u8::try_from(u32::from(c)).ok()).collect()
        }
        "utf-8" | "utf8" => Some(s.as_bytes().to_vec()),
        _ => None,
    }
}

impl Machine<'_> {
    /// An unevaluated call or instance of `class` (a `Global` node), without state yet.
    pub(super) fn new_object(&mut self, class: Id, args: Vec<Id>, kwargs: Keyed) -> Result<Id> {
        let o = u32::try_from(self.objects.len()).map_err(|_| self.err("too many objects"))?;
        let id = self.alloc(Node::Object(o))?;
        let (args_at, args_len) = self.pool_ids(&args)?;
        let extra = (!kwargs.is_empty()).then(|| Box::new(ObjExtra { kwargs, ..ObjExtra::default() }));
        self.objects.push(ObjNode { class, args_at, args_len, state: None, state_owned: false, extra });
        Ok(id)
    }

    /// A call (`REDUCE`, `OBJ`, `INST`) or instantiation (`NEWOBJ`, `NEWOBJ_EX`) of `class`:
    /// a plain value for the known callables, an unevaluated object otherwise. `known` is
    /// false for the class inside `copyreg.__newobj__`, so that the copyreg helpers do not
    /// nest.
    pub(super) fn call(&mut self, class: Id, args: Vec<Id>, kwargs: Keyed, what: &str, known: bool) -> Result<Id> {
        let kind = match self.global_of(class) {
            Some((module, name)) => known_kind(module, name),
            None => return Err(self.err(format!("{what} of a value that is not a global"))),
        };
        // The copyreg helpers do not nest (their class argument is taken as given).
        let kind = kind.filter(|k| known || !matches!(k, Known::Reconstructor | Known::NewObj | Known::NewObjEx));
        if let (Some(kind), true) = (kind, kwargs.is_empty()) {
            if let Some(id) = self.known_call(kind, &args)? {
                return Ok(id);
            }
        }
        self.new_object(class, args, kwargs)
    }

    /// The plain value a known callable makes of `args`, if they have the expected shape.
    fn known_call(&mut self, kind: Known, args: &[Id]) -> Result<Option<Id>> {
        Ok(Some(match (kind, args) {
            (Known::Dict, []) => self.new_dict(&[])?,
            (Known::Dict, [a]) => return self.dict_call(*a),
            (Known::TorchSize, [a]) => {
                let Some(items) = self.seq(*a) else { return Ok(None) };
                if !items.iter().all(|&i| matches!(self.get(i), Some(Node::Int(_)))) {
                    return Ok(None);
                }
                self.charge_values(items.len())?;
                if matches!(self.get(*a), Some(Node::Tuple { .. })) {
                    // The size is its argument, a tuple (which nothing can change): the same
                    // node, charged as a copy.
                    self.charge_values(1)?;
                    *a
                } else {
                    self.new_tuple(&items)?
                }
            }
            (Known::CodecsEncode, [s]) => {
                let Some(b) = self.str_of(*s).map(|s| s.as_bytes().to_vec()) else { return Ok(None) };
                self.new_bytes(&b)?
            }
            (Known::CodecsEncode | Known::Bytes, [s, enc]) => {
                let (Some(s), Some(enc)) = (self.str_of(*s), self.str_of(*enc)) else { return Ok(None) };
                let Some(b) = encode_str(s, enc) else { return Ok(None) };
                self.new_bytes(&b)?
            }
            (Known::Bytes, []) => self.new_bytes(&[])?,
            (Known::Bytes, [a]) => return self.bytes_call(*a),
            (Known::Set, []) => self.new_set(&[])?,
            (Known::Set, [a]) => {
                let Some(items) = self.iterable(*a) else { return Ok(None) };
                self.charge_values(items.len())?;
                self.new_set(&items)?
            }
            (Known::List, []) => self.new_list(Vec::new())?,
            (Known::Tuple, []) => self.new_tuple(&[])?,
            (Known::List | Known::Tuple, [a]) => {
                let Some(items) = self.iterable(*a) else { return Ok(None) };
                self.charge_values(items.len())?;
                if matches!(kind, Known::List) {
                    self.new_list(items)?
                } else {
                    self.new_tuple(&items)?
                }
            }
            (Known::Reconstructor, [cls, base, state]) if self.is_global(*cls) => {
                self.new_object(*cls, vec![*base, *state], Keyed::new(true))?
            }
            (Known::NewObj, [cls, rest @ ..]) if self.is_global(*cls) => {
                self.charge_values(rest.len())?;
                self.call(*cls, rest.to_vec(), Keyed::new(true), "copyreg.__newobj__", false)?
            }
            (Known::NewObjEx, [cls, a, kw]) if self.is_global(*cls) => {
                let (Some(a), Some(kw)) = (self.seq(*a), self.dict_pairs(*kw)) else { return Ok(None) };
                self.charge_values(a.len() + kw.len())?;
                let kwargs = self.keyed_from(&kw)?;
                self.call(*cls, a, kwargs, "copyreg.__newobj_ex__", false)?
            }
            _ => return Ok(None),
        }))
    }

    /// `dict(a)` / `OrderedDict(a)`: from a dict, or from a list, tuple or set of pairs.
    fn dict_call(&mut self, a: Id) -> Result<Option<Id>> {
        let pairs = if let Some(pairs) = self.dict_pairs(a) {
            pairs
        } else if let Some(items) = self.iterable(a) {
            let mut pairs = Vec::with_capacity(items.len());
            for item in items {
                match self.seq(item).as_deref() {
                    Some(&[k, v]) => pairs.push((k, v)),
                    _ => return Ok(None),
                }
            }
            pairs
        } else {
            return Ok(None);
        };
        self.charge_values(pairs.len())?;
        Ok(Some(self.new_dict(&pairs)?))
    }

    /// `bytes(a)` / `bytearray(a)`: from bytes, or from a list or tuple of ints in `0..256`.
    fn bytes_call(&mut self, a: Id) -> Result<Option<Id>> {
        let b = match self.get(a) {
            Some(Node::Bytes { len, at }) => self.text(super::machine::Text { at, len }).to_vec(),
            _ => {
                let Some(items) = self.seq(a) else { return Ok(None) };
                let mut b = Vec::with_capacity(items.len());
                for i in items {
                    match self.get(i) {
                        Some(Node::Int(x)) => match u8::try_from(x) {
                            Ok(x) => b.push(x),
                            Err(_) => return Ok(None),
                        },
                        _ => return Ok(None),
                    }
                }
                b
            }
        };
        Ok(Some(self.new_bytes(&b)?))
    }

    /// A bytes value of `b` (in the own text), its length charged to `max_bytes`.
    fn new_bytes(&mut self, b: &[u8]) -> Result<Id> {
        self.charge_bytes(b.len())?;
        let t = self.own_text(b)?;
        self.alloc(Node::Bytes { len: t.len, at: t.at })
    }

    /// A detached key collection (for keyword arguments) holding `pairs`.
    pub(super) fn keyed_from(&mut self, pairs: &[(Id, Id)]) -> Result<Keyed> {
        // Build it in a scratch dict node, then take it out (the node stays, empty).
        let id = self.new_dict(pairs)?;
        match self.node(id)? {
            Node::Dict(k) => match self.keyeds.get_mut(k as usize) {
                Some(keyed) => Ok(std::mem::replace(keyed, Keyed::new(true))),
                None => Err(self.err("internal: not a dict")),
            },
            _ => Err(self.err("internal: not a dict")),
        }
    }
    // --- BUILD -----------------------------------------------------------------------------------

    /// The pairs of a dict node, charged to `max_values` (they are copied).
    fn copied_pairs(&mut self, id: Id) -> Result<Option<Vec<(Id, Id)>>> {
        let Some(pairs) = self.dict_pairs(id) else { return Ok(None) };
        self.charge_values(pairs.len())?;
        Ok(Some(pairs))
    }

    fn is_dict(&self, id: Id) -> bool {
        matches!(self.get(id), Some(Node::Dict(_)))
    }

    /// `BUILD`: sets the state of the object on top of the stack, merging a dict state into an
    /// earlier dict state; on a dict, merges a dict state into its items.
    pub(super) fn build(&mut self) -> Result<()> {
        let state = self.pop()?;
        let target = self.top()?;
        match self.node(target)? {
            Node::Object(oi) => {
                let Some(o) = self.objects.get(oi as usize) else { return Err(self.err("internal: bad object")) };
                let (old, owned) = (o.state, o.state_owned);
                let (new_state, new_owned) = match old {
                    // dict.update of the earlier dict state: into a copy, unless this object
                    // made that dict itself by an earlier merge.
                    Some(old) if self.is_dict(old) && self.is_dict(state) => {
                        let merged = if owned {
                            old
                        } else {
                            let old_pairs = self.copied_pairs(old)?.unwrap_or_default();
                            self.new_dict(&old_pairs)?
                        };
                        let pairs = self.copied_pairs(state)?.unwrap_or_default();
                        self.insert_pairs(merged, Slot::Main, &pairs)?;
                        (merged, true)
                    }
                    _ => (state, false),
                };
                if let Some(o) = self.objects.get_mut(oi as usize) {
                    o.state = Some(new_state);
                    o.state_owned = new_owned;
                }
                Ok(())
            }
            Node::Dict(_) => match self.copied_pairs(state)? {
                Some(pairs) => self.insert_pairs(target, Slot::Main, &pairs),
                None if matches!(self.get(state), Some(Node::None)) => Ok(()),
                None => Err(self.err("BUILD of a dict with a state that is not a dict")),
            },
            _ => Err(self.err("BUILD on a value that is neither an object nor a dict")),
        }
    }
}
