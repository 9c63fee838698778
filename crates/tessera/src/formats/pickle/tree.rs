//! The result, at `STOP`: the arena under the root is checked (no cycle; depth, values and
//! string bytes within the limits, shared values counted once per copy) before anything is
//! built, then either read in place (`view`) or materialized into a [`PickleValue`] tree
//! without recursion, each container built straight into its parent's vector.

use std::collections::HashMap;

use super::machine::{Id, Machine, Node, Text};
use super::{PickleObject, PickleValue};
use crate::error::Result;

/// Colours of [`Machine::check_tree`]'s walk: not reached, on the path, done.
const WHITE: u8 = 0;
const GREY: u8 = 1;
const BLACK: u8 = 2;

/// Whether a node has no children.
fn is_leaf(node: Node) -> bool {
    matches!(
        node,
        Node::None
            | Node::Bool(_)
            | Node::Int(_)
            | Node::Float(_)
            | Node::Str { .. }
            | Node::Bytes { .. }
            | Node::BigInt { .. }
            | Node::Global(_)
    )
}

impl Machine<'_> {
    /// Children of a node, in the order materialization lays them out: items; keys and values
    /// interleaved; an object's arguments, keyword arguments, state, list items, dict items.
    pub(super) fn child_count(&self, node: Node) -> usize {
        match node {
            Node::List(l) => self.lists.get(l as usize).map_or(0, Vec::len),
            Node::Tuple { len, .. } => len as usize,
            Node::Dict(k) | Node::Set(k) => self.keyeds.get(k as usize).map_or(0, |k| k.items.len()),
            Node::Persistent(_) => 1,
            Node::Object(o) => self.objects.get(o as usize).map_or(0, |o| {
                let extra = o
                    .extra
                    .as_ref()
                    .map_or(0, |e| e.kwargs.items.len() + e.list_items.len() + e.dict_items.items.len());
                o.args_len as usize + usize::from(o.state.is_some()) + extra
            }),
            _ => 0,
        }
    }

    /// Child `i` of a node (see [`Machine::child_count`]).
    pub(super) fn child(&self, node: Node, i: usize) -> Option<Id> {
        match node {
            Node::List(l) => self.lists.get(l as usize)?.get(i).copied(),
            Node::Tuple { len, at } => (i < len as usize).then(|| self.pool.get(at as usize + i).copied()).flatten(),
            Node::Dict(k) | Node::Set(k) => self.keyeds.get(k as usize)?.items.get(i).copied(),
            Node::Persistent(p) => (i == 0).then_some(p),
            Node::Object(o) => {
                let o = self.objects.get(o as usize)?;
                let mut i = i;
                if i < o.args_len as usize {
                    return self.pool.get(o.args_at as usize + i).copied();
                }
                i -= o.args_len as usize;
                let extra = o.extra.as_deref();
                let kwargs = extra.map_or(&[][..], |e| &e.kwargs.items[..]);
                if i < kwargs.len() {
                    return Some(kwargs[i]);
                }
                i -= kwargs.len();
                if let Some(s) = o.state {
                    if i == 0 {
                        return Some(s);
                    }
                    i -= 1;
                }
                let list = extra.map_or(&[][..], |e| &e.list_items);
                if i < list.len() {
                    return Some(list[i]);
                }
                i -= list.len();
                extra.and_then(|e| e.dict_items.items.get(i).copied())
            }
            _ => None,
        }
    }

    /// Bytes of strings a node holds itself (not counting children).
    fn own_bytes(&self, node: Node) -> usize {
        match node {
            Node::Str { len, .. } | Node::Bytes { len, .. } | Node::BigInt { len, .. } => len as usize,
            Node::Global(g) => self.globals.get(g as usize).map_or(0, |(m, n)| m.len as usize + n.len as usize),
            Node::Object(o) => {
                self.objects.get(o as usize).and_then(|o| self.get(o.class)).map_or(0, |class| self.own_bytes(class))
            }
            _ => 0,
        }
    }

    /// Checks, before building anything, that the tree under `root` is finite (no cycle) and
    /// within the limits: depth, values and string bytes counting every copy of shared values.
    /// Linear in the number of nodes reachable from `root`, in a depth-first walk that keeps
    /// two bytes per node (references, colour) and the totals of shared containers only.
    pub(super) fn check_tree(&self, root: Id) -> Result<()> {
        struct Frame {
            id: Id,
            node: Node,
            next: usize,
            count: usize,
            values: u64,
            bytes: u64,
            height: u64,
        }
        let n = self.nodes.len();
        let internal = || self.err("internal: bad child");
        // References to each node (saturating): a node referenced once is counted once, into
        // its one parent; a shared one keeps its totals for every copy.
        let mut refs = vec![0u8; n];
        for id in 0..n as Id {
            let node = self.node(id)?;
            for i in 0..self.child_count(node) {
                let child = self.child(node, i).ok_or_else(internal)?;
                if let Some(r) = refs.get_mut(child as usize) {
                    *r = r.saturating_add(1);
                }
            }
        }
        let mut color = vec![WHITE; n];
        let mut shared: HashMap<Id, (u64, u64, u64)> = HashMap::new();
        let node = self.node(root)?;
        if (root as usize) >= n || is_leaf(node) {
            return self.verdict(1, self.own_bytes(node) as u64, 0);
        }
        let open = |id: Id, node: Node| Frame {
            id,
            node,
            next: 0,
            count: self.child_count(node),
            values: 0,
            bytes: 0,
            height: 0,
        };
        let deep = || self.err(format!("nesting deeper than {} levels (max_depth)", self.limits.max_depth));
        color[root as usize] = GREY;
        let mut frames = vec![open(root, node)];
        loop {
            let Some(top) = frames.last_mut() else { return Err(internal()) };
            let (values, bytes, height) = if top.next < top.count {
                let child = self.child(top.node, top.next).ok_or_else(internal)?;
                top.next += 1;
                let node = self.node(child)?;
                if (child as usize) >= n || is_leaf(node) {
                    (1, self.own_bytes(node) as u64, 0)
                } else {
                    match color[child as usize] {
                        GREY => {
                            return Err(
                                self.err("recursive structure (a container contains itself), which a tree cannot hold")
                            )
                        }
                        BLACK => *shared.get(&child).ok_or_else(internal)?,
                        _ => {
                            // Open containers are levels: past the limit, the height will be too.
                            if frames.len() > self.limits.max_depth {
                                return Err(deep());
                            }
                            color[child as usize] = GREY;
                            frames.push(open(child, node));
                            continue;
                        }
                    }
                }
            } else {
                let Some(done) = frames.pop() else { return Err(internal()) };
                let values = done.values.saturating_add(1);
                let bytes = done.bytes.saturating_add(self.own_bytes(done.node) as u64);
                let height = done.height.saturating_add(1);
                self.verdict(values, bytes, height)?;
                color[done.id as usize] = BLACK;
                if refs[done.id as usize] > 1 {
                    shared.insert(done.id, (values, bytes, height));
                }
                if frames.is_empty() {
                    return Ok(());
                }
                (values, bytes, height)
            };
            let Some(parent) = frames.last_mut() else { return Err(internal()) };
            parent.values = parent.values.saturating_add(values);
            parent.bytes = parent.bytes.saturating_add(bytes);
            parent.height = parent.height.max(height);
        }
    }

    /// The limits on a subtree of `values` values holding `bytes` bytes of strings, `height`
    /// levels of containers deep (shared values counted once per copy).
    fn verdict(&self, values: u64, bytes: u64, height: u64) -> Result<()> {
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
        self.check_budget(values, bytes, "the result (shared values counted once per copy): ")
    }

    /// The value of a scalar node (a leaf); `None` for a container.
    fn leaf_value(&self, node: Node) -> Option<PickleValue> {
        let text = |len, at| self.text(Text { at, len });
        Some(match node {
            Node::None => PickleValue::None,
            Node::Bool(b) => PickleValue::Bool(b),
            Node::Int(i) => PickleValue::Int(i),
            Node::Float(f) => PickleValue::Float(f),
            Node::Str { len, at } => PickleValue::Str(self.text_str(Text { at, len }).to_string()),
            Node::Bytes { len, at } => PickleValue::Bytes(text(len, at).to_vec()),
            Node::BigInt { len, at } => PickleValue::BigInt(text(len, at).to_vec()),
            Node::Global(_) => {
                let (module, name) = self.global_of_node(node)?;
                PickleValue::Global { module: module.to_string(), name: name.to_string() }
            }
            _ => return None,
        })
    }

    /// `(module, name)` of a `Global` node.
    fn global_of_node(&self, node: Node) -> Option<(&str, &str)> {
        match node {
            Node::Global(g) => {
                let (m, n) = *self.globals.get(g as usize)?;
                Some((self.text_str(m), self.text_str(n)))
            }
            _ => None,
        }
    }

    /// Builds the tree under `root` (checked by [`Machine::check_tree`]) without recursion:
    /// each open container's items are built straight into its vector, sized to its children.
    pub(super) fn materialize(&self, root: Id) -> Result<PickleValue> {
        struct Frame {
            node: Node,
            next: usize,
            count: usize,
            items: Vec<PickleValue>,
        }
        let internal = || self.err("internal: malformed value tree");
        let open = |node: Node| {
            let count = self.child_count(node);
            Frame { node, next: 0, count, items: Vec::with_capacity(count) }
        };
        let root = self.node(root)?;
        if let Some(v) = self.leaf_value(root) {
            return Ok(v);
        }
        let mut frames = vec![open(root)];
        loop {
            let top = frames.last_mut().ok_or_else(internal)?;
            if top.next < top.count {
                let child = self.child(top.node, top.next).ok_or_else(internal)?;
                top.next += 1;
                let child = self.node(child)?;
                match self.leaf_value(child) {
                    Some(v) => top.items.push(v),
                    None => frames.push(open(child)),
                }
                continue;
            }
            let done = frames.pop().ok_or_else(internal)?;
            let value = self.container_value(done.node, done.items)?;
            match frames.last_mut() {
                Some(parent) => parent.items.push(value),
                None => return Ok(value),
            }
        }
    }

    /// The value of a container node from its materialized children (in [`Machine::child`]
    /// order).
    fn container_value(&self, node: Node, items: Vec<PickleValue>) -> Result<PickleValue> {
        let internal = || self.err("internal: malformed value tree");
        let pairs = |v: Vec<PickleValue>| {
            let mut it = v.into_iter();
            let mut pairs = Vec::with_capacity(it.len() / 2);
            while let (Some(k), Some(v)) = (it.next(), it.next()) {
                pairs.push((k, v));
            }
            pairs
        };
        Ok(match node {
            Node::List(_) => PickleValue::List(items),
            Node::Tuple { .. } => PickleValue::Tuple(items),
            Node::Set(_) => PickleValue::Set(items),
            Node::Dict(_) => PickleValue::Dict(pairs(items)),
            Node::Persistent(_) => PickleValue::PersistentId(Box::new(items.into_iter().next().ok_or_else(internal)?)),
            Node::Object(o) => {
                let o = self.objects.get(o as usize).ok_or_else(internal)?;
                let class = self.node(o.class)?;
                let (module, name) = self.global_of_node(class).ok_or_else(internal)?;
                let extra = o.extra.as_deref();
                let n_kwargs = extra.map_or(0, |e| e.kwargs.items.len());
                let n_list = extra.map_or(0, |e| e.list_items.len());
                let mut items = items.into_iter();
                let mut take = |n: usize| items.by_ref().take(n).collect::<Vec<_>>();
                let args = take(o.args_len as usize);
                let kwargs = pairs(take(n_kwargs));
                let state = if o.state.is_some() { take(1).pop() } else { None };
                let list_items = take(n_list);
                let dict_items = pairs(take(usize::MAX));
                PickleValue::Object(Box::new(PickleObject {
                    module: module.to_string(),
                    name: name.to_string(),
                    args,
                    kwargs,
                    state,
                    list_items,
                    dict_items,
                }))
            }
            _ => return Err(internal()),
        })
    }
}
