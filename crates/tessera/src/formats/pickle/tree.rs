//! The result, at `STOP`: the arena under the root is checked (no cycle; depth, values and
//! string bytes within the limits, shared values counted once per copy) before anything is
//! built, then materialized into a [`PickleValue`] tree without recursion.

use super::machine::Keyed;
use super::machine::{Id, Machine, Node};
use super::{PickleObject, PickleValue};
use crate::error::Result;

impl Machine<'_> {
    /// Calls `f` on each child of a node, in the order materialization lays them out.
    fn for_each_child(&self, id: Id, mut f: impl FnMut(Id)) {
        let keyed = |k: &Keyed, f: &mut dyn FnMut(Id)| {
            if k.values.is_empty() {
                k.keys.iter().for_each(|&x| f(x));
            } else {
                for (&a, &b) in k.keys.iter().zip(&k.values) {
                    f(a);
                    f(b);
                }
            }
        };
        match self.nodes.get(id) {
            None | Some(Node::Leaf(_)) => {}
            Some(Node::List(items) | Node::Tuple(items)) => items.iter().for_each(|&x| f(x)),
            Some(Node::Dict(k) | Node::Set(k)) => keyed(k, &mut f),
            Some(Node::Persistent(p)) => f(*p),
            Some(Node::Object(o)) => {
                o.args.iter().for_each(|&x| f(x));
                keyed(&o.kwargs, &mut f);
                if let Some(s) = o.state {
                    f(s);
                }
                o.list_items.iter().for_each(|&x| f(x));
                keyed(&o.dict_items, &mut f);
            }
        }
    }

    /// Bytes of strings a node holds itself (not counting children).
    fn own_bytes(&self, id: Id) -> usize {
        let leaf_bytes = |v: &PickleValue| match v {
            PickleValue::Str(s) => s.len(),
            PickleValue::Bytes(b) | PickleValue::BigInt(b) => b.len(),
            PickleValue::Global { module, name } => module.len() + name.len(),
            _ => 0,
        };
        match self.nodes.get(id) {
            Some(Node::Leaf(v)) => leaf_bytes(v),
            Some(Node::Object(o)) => self.leaf(o.class).map_or(0, leaf_bytes),
            _ => 0,
        }
    }

    /// Checks, before building anything, that the tree under `root` is finite (no cycle) and
    /// within the limits: depth, values and string bytes counting every copy of shared values.
    /// Linear in the number of nodes reachable from `root`.
    pub(super) fn check_tree(&self, root: Id) -> Result<()> {
        const WHITE: u8 = 0;
        const GREY: u8 = 1;
        const BLACK: u8 = 2;
        let n = self.nodes.len();
        let mut color = vec![WHITE; n];
        // Per node: values, bytes and height of its materialized subtree (saturating).
        let mut size = vec![(0u64, 0u64, 0u64); n];
        let mut todo: Vec<(Id, bool)> = vec![(root, false)];
        let cycle = || self.err("recursive structure (a container contains itself), which a tree cannot hold");
        while let Some((id, done)) = todo.pop() {
            let Some(&c) = color.get(id) else { return Err(self.err("internal: bad node id")) };
            if done {
                let (mut values, mut bytes, mut height) = (1u64, self.own_bytes(id) as u64, 0u64);
                let container = !matches!(self.nodes.get(id), Some(Node::Leaf(_)));
                self.for_each_child(id, |child| {
                    let (v, b, h) = size.get(child).copied().unwrap_or_default();
                    values = values.saturating_add(v);
                    bytes = bytes.saturating_add(b);
                    height = height.max(h);
                });
                if container {
                    height = height.saturating_add(1);
                }
                if height > self.limits.max_depth as u64 {
                    return Err(self.err(format!("nesting deeper than {} levels (max_depth)", self.limits.max_depth)));
                }
                if values > self.limits.max_values as u64 {
                    return Err(self.err(format!(
                        "the result would hold more than {} values (max_values; shared values count once per copy)",
                        self.limits.max_values
                    )));
                }
                if bytes > self.limits.max_bytes as u64 {
                    return Err(self.err(format!(
                        "the result would hold more than {} bytes of strings (max_bytes; shared values count once per copy)",
                        self.limits.max_bytes
                    )));
                }
                self.check_budget(values, bytes, "the result (shared values counted once per copy): ")?;
                size[id] = (values, bytes, height);
                color[id] = BLACK;
                continue;
            }
            match c {
                BLACK => continue,
                GREY => return Err(cycle()),
                _ => {}
            }
            color[id] = GREY;
            todo.push((id, true));
            let mut found_cycle = false;
            self.for_each_child(id, |child| match color.get(child) {
                Some(&GREY) => found_cycle = true,
                Some(&WHITE) => todo.push((child, false)),
                _ => {}
            });
            if found_cycle {
                return Err(cycle());
            }
        }
        Ok(())
    }

    /// Builds the tree under `root` (checked by [`Machine::check_tree`]) without recursion.
    pub(super) fn materialize(&self, root: Id) -> Result<PickleValue> {
        enum Frame {
            Enter(Id),
            Exit(Id),
        }
        let mut frames = vec![Frame::Enter(root)];
        let mut out: Vec<PickleValue> = Vec::new();
        let internal = || self.err("internal: malformed value tree");
        while let Some(frame) = frames.pop() {
            match frame {
                Frame::Enter(id) => {
                    if let Node::Leaf(v) = self.node(id)? {
                        out.push(v.clone());
                        continue;
                    }
                    frames.push(Frame::Exit(id));
                    let mut children = Vec::new();
                    self.for_each_child(id, |c| children.push(c));
                    frames.extend(children.into_iter().rev().map(Frame::Enter));
                }
                Frame::Exit(id) => {
                    let mut count = 0usize;
                    self.for_each_child(id, |_| count += 1);
                    let start = out.len().checked_sub(count).ok_or_else(internal)?;
                    let mut items = out.split_off(start).into_iter();
                    let mut take = |n: usize| items.by_ref().take(n).collect::<Vec<_>>();
                    let pairs = |v: Vec<PickleValue>| {
                        let mut it = v.into_iter();
                        let mut pairs = Vec::new();
                        while let (Some(k), Some(v)) = (it.next(), it.next()) {
                            pairs.push((k, v));
                        }
                        pairs
                    };
                    let value = match self.node(id)? {
                        Node::Leaf(_) => return Err(internal()),
                        Node::List(_) => PickleValue::List(take(count)),
                        Node::Tuple(_) => PickleValue::Tuple(take(count)),
                        Node::Set(_) => PickleValue::Set(take(count)),
                        Node::Dict(_) => PickleValue::Dict(pairs(take(count))),
                        Node::Persistent(_) => PickleValue::PersistentId(Box::new(take(1).pop().ok_or_else(internal)?)),
                        Node::Object(o) => {
                            let (module, name) = match self.leaf(o.class) {
                                Some(PickleValue::Global { module, name }) => (module.clone(), name.clone()),
                                _ => return Err(internal()),
                            };
                            let args = take(o.args.len());
                            let kwargs = pairs(take(2 * o.kwargs.keys.len()));
                            let state = if o.state.is_some() { take(1).pop() } else { None };
                            let list_items = take(o.list_items.len());
                            let dict_items = pairs(take(2 * o.dict_items.keys.len()));
                            PickleValue::Object(Box::new(PickleObject {
                                module,
                                name,
                                args,
                                kwargs,
                                state,
                                list_items,
                                dict_items,
                            }))
                        }
                    };
                    out.push(value);
                }
            }
        }
        match (out.pop(), out.is_empty()) {
            (Some(v), true) => Ok(v),
            _ => Err(internal()),
        }
    }
}
