//! Reading an unpickled value in place: [`Unpickled`] keeps the checked arena, and
//! [`PickleRef`] walks it without building a [`PickleValue`](super::PickleValue) tree. A
//! DCP `.metadata` of millions of values is read this way (issue 29): the tree would take
//! several times the arena, and the reader needs only a few fields of each entry. A value shared
//! through the memo is read where it is, never copied.

use super::machine::{Id, Machine, Node, Text};
use super::UnpickleLimits;
use crate::error::Result;

/// A pickle decoded into its checked arena (see [`unpickle_view`]).
pub(crate) struct Unpickled<'a> {
    m: Machine<'a>,
    root: Id,
}

/// Decodes one pickle as [`unpickle`](super::unpickle) does, with the same limits, errors and
/// checks of the result (no cycle; depth, values and bytes counting every copy of a shared
/// value), but leaves the value in the unpickler's compact arena, to be read in place.
pub(crate) fn unpickle_view<'a>(data: &'a [u8], origin: &'a str, limits: &UnpickleLimits) -> Result<Unpickled<'a>> {
    let mut m = Machine::new(data, origin, limits);
    let root = m.run()?;
    m.finish_run();
    m.check_tree(root)?;
    Ok(Unpickled { m, root })
}

impl Unpickled<'_> {
    /// The value the pickle holds.
    pub(crate) fn root(&self) -> PickleRef<'_> {
        PickleRef { m: &self.m, id: self.root }
    }
}

/// A value of an [`Unpickled`] arena.
#[derive(Clone, Copy)]
pub(crate) struct PickleRef<'p> {
    m: &'p Machine<'p>,
    id: Id,
}

/// What a [`PickleRef`] is, with its contents borrowed from the arena (the variants of
/// [`PickleValue`](super::PickleValue)).
// Every kind of value a pickle holds, though the DCP reader reads only a few (the tests read
// them all, against the tree).
#[cfg_attr(not(test), allow(dead_code))]
pub(crate) enum PickleView<'p> {
    None,
    Bool(bool),
    Int(i64),
    BigInt(&'p [u8]),
    Float(f64),
    Str(&'p str),
    Bytes(&'p [u8]),
    List(Items<'p>),
    Tuple(Items<'p>),
    Set(Items<'p>),
    Dict(Items<'p>),
    Global { module: &'p str, name: &'p str },
    Object(ObjectRef<'p>),
    PersistentId(PickleRef<'p>),
}

/// The items of a list, tuple or set, or the keys and values (interleaved) of a dict.
#[derive(Clone, Copy)]
pub(crate) struct Items<'p> {
    r: PickleRef<'p>,
    node: Node,
    len: usize,
}

impl<'p> Items<'p> {
    /// Items held (for a dict: keys and values, twice its length).
    pub(crate) fn len(&self) -> usize {
        self.len
    }
    /// Item `i`.
    pub(crate) fn get(&self, i: usize) -> Option<PickleRef<'p>> {
        let id = self.r.m.child(self.node, i)?;
        Some(PickleRef { m: self.r.m, id })
    }
    /// The items in order.
    pub(crate) fn iter(self) -> impl Iterator<Item = PickleRef<'p>> {
        (0..self.len).filter_map(move |i| self.get(i))
    }
    /// A dict's `(key, value)` pairs in order.
    pub(crate) fn pairs(self) -> impl Iterator<Item = (PickleRef<'p>, PickleRef<'p>)> {
        (0..self.len / 2).filter_map(move |i| Some((self.get(2 * i)?, self.get(2 * i + 1)?)))
    }
}

/// A key and its value.
pub(crate) type RefPair<'p> = (PickleRef<'p>, PickleRef<'p>);

/// An unevaluated call or class instance.
#[derive(Clone, Copy)]
pub(crate) struct ObjectRef<'p> {
    r: PickleRef<'p>,
    o: u32,
}

impl<'p> ObjectRef<'p> {
    fn node(&self) -> Option<&'p super::machine::ObjNode> {
        self.r.m.objects.get(self.o as usize)
    }
    /// Module and name of the class or function.
    pub(crate) fn class(&self) -> (&'p str, &'p str) {
        let m = self.r.m;
        self.node().and_then(|o| m.global_of(o.class)).unwrap_or_default()
    }
    /// Arguments of the call.
    pub(crate) fn args(&self) -> Vec<PickleRef<'p>> {
        let m = self.r.m;
        self.node().map(|o| m.args_of(o).into_iter().map(|id| PickleRef { m, id }).collect()).unwrap_or_default()
    }
    /// The state `BUILD` gave.
    pub(crate) fn state(&self) -> Option<PickleRef<'p>> {
        let m = self.r.m;
        self.node()?.state.map(|id| PickleRef { m, id })
    }
    /// Keyword arguments, items appended with `APPEND(S)` and set with `SETITEM(S)`: what
    /// [`PickleObject`](super::PickleObject) has besides; the DCP reader never needs them.
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) fn extra(&self) -> (Vec<RefPair<'p>>, Vec<PickleRef<'p>>, Vec<RefPair<'p>>) {
        let m = self.r.m;
        let r = |id| PickleRef { m, id };
        let Some(e) = self.node().and_then(|o| o.extra.as_deref()) else { return Default::default() };
        (
            e.kwargs.pairs().map(|(k, v)| (r(k), r(v))).collect(),
            e.list_items.iter().map(|&id| r(id)).collect(),
            e.dict_items.pairs().map(|(k, v)| (r(k), r(v))).collect(),
        )
    }
}

impl<'p> PickleRef<'p> {
    /// What the value is.
    pub(crate) fn view(self) -> PickleView<'p> {
        let m = self.m;
        let Some(node) = m.get(self.id) else { return PickleView::None };
        let text = |len, at| m.text(Text { at, len });
        let items = |node| Items { r: self, node, len: m.child_count(node) };
        match node {
            Node::None => PickleView::None,
            Node::Bool(b) => PickleView::Bool(b),
            Node::Int(i) => PickleView::Int(i),
            Node::Float(f) => PickleView::Float(f),
            Node::Str { len, at } => PickleView::Str(m.text_str(Text { at, len })),
            Node::Bytes { len, at } => PickleView::Bytes(text(len, at)),
            Node::BigInt { len, at } => PickleView::BigInt(text(len, at)),
            Node::Global(_) => {
                let (module, name) = m.global_of(self.id).unwrap_or_default();
                PickleView::Global { module, name }
            }
            Node::List(_) => PickleView::List(items(node)),
            Node::Tuple { .. } => PickleView::Tuple(items(node)),
            Node::Set(_) => PickleView::Set(items(node)),
            Node::Dict(_) => PickleView::Dict(items(node)),
            Node::Object(o) => PickleView::Object(ObjectRef { r: self, o }),
            Node::Persistent(p) => PickleView::PersistentId(PickleRef { m, id: p }),
        }
    }

    /// The string, if this is one.
    pub(crate) fn as_str(self) -> Option<&'p str> {
        match self.view() {
            PickleView::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The value as a non-negative integer (a bool counts), if it is one.
    pub(crate) fn as_u64(self) -> Option<u64> {
        match self.view() {
            PickleView::Int(i) => u64::try_from(i).ok(),
            PickleView::Bool(b) => Some(u64::from(b)),
            _ => None,
        }
    }

    /// The items of a tuple or list.
    pub(crate) fn seq(self) -> Option<Items<'p>> {
        match self.view() {
            PickleView::Tuple(xs) | PickleView::List(xs) => Some(xs),
            _ => None,
        }
    }

    /// A tuple or list of non-negative integers.
    pub(crate) fn as_dims(self) -> Option<Vec<u64>> {
        self.seq()?.iter().map(PickleRef::as_u64).collect()
    }

    /// A short description for error messages, as
    /// [`torch_save::describe`](crate::formats::torch_save::describe) gives of the same value
    /// (only a container's kind: describing one never walks it).
    pub(crate) fn describe(self) -> String {
        match self.view() {
            PickleView::Global { module, name } => format!("{module}.{name}"),
            PickleView::Object(o) => {
                let (module, name) = o.class();
                format!("an object of {module}.{name}")
            }
            PickleView::None => "None".into(),
            PickleView::Dict(_) => "a dict".into(),
            PickleView::List(_) => "a list".into(),
            PickleView::Tuple(_) => "a tuple".into(),
            PickleView::Set(_) => "a set".into(),
            PickleView::PersistentId(_) => "a persistent id".into(),
            // Scalars as their tree's debug form, cut as the tree's description cuts it.
            _ => {
                self.m.get(self.id).and_then(|n| self.m.scalar_debug(n)).unwrap_or_default().chars().take(60).collect()
            }
        }
    }
}

impl Machine<'_> {
    /// `format!("{:?}")` of the [`PickleValue`](super::PickleValue) of a scalar node.
    fn scalar_debug(&self, node: Node) -> Option<String> {
        let text = |len, at| self.text(Text { at, len });
        Some(match node {
            Node::Bool(b) => format!("{:?}", super::PickleValue::Bool(b)),
            Node::Int(i) => format!("{:?}", super::PickleValue::Int(i)),
            Node::Float(f) => format!("{:?}", super::PickleValue::Float(f)),
            // Cut before formatting: a description never needs a whole long string.
            Node::Str { len, at } => {
                let s: String = self.text_str(Text { at, len }).chars().take(60).collect();
                format!("{:?}", super::PickleValue::Str(s))
            }
            Node::Bytes { len, at } => {
                let b = text(len, at);
                format!("{:?}", super::PickleValue::Bytes(b[..b.len().min(60)].to_vec()))
            }
            Node::BigInt { len, at } => {
                let b = text(len, at);
                format!("{:?}", super::PickleValue::BigInt(b[..b.len().min(60)].to_vec()))
            }
            _ => return None,
        })
    }
}
