//! Dict and set keys deduplicated as Python does: hashed by what Python's equality compares
//! (`1 == 1.0 == True`, tuples item by item, objects by identity), compared in full only on
//! equal hashes, with a union-find so that each pair is compared once.

use std::hash::{BuildHasher, Hash, Hasher};

use super::machine::{Id, Keyed, Machine, Node, Slot};
use super::PickleValue;
use crate::error::Result;

/// Deepest tuple nesting hashed as a dict key (deeper keys are not deduplicated).
const KEY_DEPTH: usize = 32;

/// A hashable key reduced to what Python's equality compares.
#[derive(Hash, PartialEq)]
enum Atom<'a> {
    None,
    Int(i64),
    Float(u64),
    Big(&'a [u8]),
    Str(&'a str),
    Bytes(&'a [u8]),
    Global(&'a str, &'a str),
}

fn atom(v: &PickleValue) -> Option<Atom<'_>> {
    Some(match v {
        PickleValue::None => Atom::None,
        PickleValue::Bool(b) => Atom::Int(i64::from(*b)),
        PickleValue::Int(i) => Atom::Int(*i),
        PickleValue::Float(f) if f.is_nan() => return None,
        PickleValue::Float(f) => {
            if f.fract() == 0.0 && *f >= -9_223_372_036_854_775_808.0 && *f < 9_223_372_036_854_775_808.0 {
                Atom::Int(*f as i64)
            } else {
                Atom::Float(f.to_bits())
            }
        }
        PickleValue::BigInt(b) => Atom::Big(b),
        PickleValue::Str(s) => Atom::Str(s),
        PickleValue::Bytes(b) => Atom::Bytes(b),
        PickleValue::Global { module, name } => Atom::Global(module, name),
        _ => return None,
    })
}

impl Machine<'_> {
    fn find(&mut self, id: Id) -> Id {
        let mut root = id;
        while let Some(&next) = self.alias.get(&root) {
            root = next;
        }
        let mut cur = id;
        while let Some(&next) = self.alias.get(&cur) {
            if next != root {
                self.alias.insert(cur, root);
            }
            cur = next;
        }
        root
    }

    fn union(&mut self, a: Id, b: Id) {
        let (ra, rb) = (self.find(a), self.find(b));
        if ra != rb {
            // Aliases point to smaller ids, so chains end.
            self.alias.insert(ra.max(rb), ra.min(rb));
        }
    }

    /// Hash of a value as a dict key, `None` if it is not hashable (or too deep a tuple).
    fn key_hash(&mut self, id: Id, depth: usize) -> Option<u64> {
        if let Some(h) = self.hash_cache.get(&id) {
            return *h;
        }
        let h = match self.nodes.get(id) {
            Some(Node::Leaf(v)) => atom(v).map(|a| self.hasher.hash_one(a)),
            Some(Node::Tuple(items)) if depth < KEY_DEPTH => {
                let items = items.clone();
                let mut s = self.hasher.build_hasher();
                (7u8, items.len()).hash(&mut s);
                let mut ok = true;
                for item in items {
                    match self.key_hash(item, depth + 1) {
                        Some(h) => h.hash(&mut s),
                        None => {
                            ok = false;
                            break;
                        }
                    }
                }
                ok.then(|| s.finish())
            }
            // Hashable by identity.
            Some(Node::Object(_) | Node::Persistent(_) | Node::Set(_)) => Some(self.hasher.hash_one((8u8, id))),
            _ => None,
        };
        self.hash_cache.insert(id, h);
        h
    }

    /// Whether two keys with equal hashes are equal as Python compares them.
    fn key_eq(&mut self, a: Id, b: Id, depth: usize) -> bool {
        if a == b {
            return true;
        }
        let (a, b) = (self.find(a), self.find(b));
        if a == b {
            return true;
        }
        let eq = match (self.nodes.get(a), self.nodes.get(b)) {
            (Some(Node::Leaf(x)), Some(Node::Leaf(y))) => match (atom(x), atom(y)) {
                (Some(p), Some(q)) => p == q,
                _ => false,
            },
            (Some(Node::Tuple(x)), Some(Node::Tuple(y))) if depth < KEY_DEPTH && x.len() == y.len() => {
                let pairs: Vec<(Id, Id)> = x.iter().copied().zip(y.iter().copied()).collect();
                pairs.into_iter().all(|(p, q)| self.key_eq(p, q, depth + 1))
            }
            _ => false,
        };
        if eq {
            self.union(a, b);
        }
        eq
    }

    fn keyed(&self, target: Id, slot: Slot) -> Option<&Keyed> {
        match (self.nodes.get(target), slot) {
            (Some(Node::Dict(k) | Node::Set(k)), Slot::Main) => Some(&**k),
            (Some(Node::Object(o)), Slot::ObjItems) => Some(&o.dict_items),
            _ => None,
        }
    }

    fn keyed_mut(&mut self, target: Id, slot: Slot) -> Option<&mut Keyed> {
        match (self.nodes.get_mut(target), slot) {
            (Some(Node::Dict(k) | Node::Set(k)), Slot::Main) => Some(&mut **k),
            (Some(Node::Object(o)), Slot::ObjItems) => Some(&mut o.dict_items),
            _ => None,
        }
    }

    /// Inserts a key (and its value, for dicts) into a dict, set or object's dict items; an
    /// equal key keeps its place and takes the new value.
    pub(super) fn insert(&mut self, target: Id, slot: Slot, k: Id, v: Option<Id>) -> Result<()> {
        let h = self.key_hash(k, 0);
        let mut found = None;
        if let Some(h) = h {
            let cands: Vec<(usize, Id)> = match self.keyed(target, slot) {
                Some(keyed) => keyed
                    .index
                    .get(&h)
                    .map(|c| c.iter().filter_map(|&i| keyed.keys.get(i).map(|&kk| (i, kk))).collect())
                    .unwrap_or_default(),
                None => return Err(self.err("internal: not a keyed node")),
            };
            for (i, kk) in cands {
                if self.key_eq(kk, k, 0) {
                    found = Some(i);
                    break;
                }
            }
        }
        let Some(keyed) = self.keyed_mut(target, slot) else {
            return Err(self.err("internal: not a keyed node"));
        };
        match found {
            Some(i) => {
                if let (Some(v), Some(slot)) = (v, keyed.values.get_mut(i)) {
                    *slot = v;
                }
            }
            None => {
                let i = keyed.keys.len();
                keyed.keys.push(k);
                if let Some(v) = v {
                    keyed.values.push(v);
                }
                if let Some(h) = h {
                    keyed.index.entry(h).or_default().push(i);
                }
            }
        }
        Ok(())
    }

    pub(super) fn insert_pairs(&mut self, target: Id, slot: Slot, pairs: &[(Id, Id)]) -> Result<()> {
        for &(k, v) in pairs {
            self.insert(target, slot, k, Some(v))?;
        }
        Ok(())
    }

    /// A new dict holding `pairs`.
    pub(super) fn new_dict(&mut self, pairs: &[(Id, Id)]) -> Result<Id> {
        let id = self.alloc(Node::Dict(Box::default()))?;
        self.insert_pairs(id, Slot::Main, pairs)?;
        Ok(id)
    }

    pub(super) fn new_set(&mut self, items: &[Id]) -> Result<Id> {
        let id = self.alloc(Node::Set(Box::default()))?;
        for &item in items {
            self.insert(id, Slot::Main, item, None)?;
        }
        Ok(id)
    }

    /// Pairs from a mark's items `k1 v1 k2 v2 …`.
    pub(super) fn pairs_of(&self, items: &[Id], what: &str) -> Result<Vec<(Id, Id)>> {
        if !items.len().is_multiple_of(2) {
            return Err(self.err(format!("{what} with an odd number of items")));
        }
        Ok(items.chunks_exact(2).map(|c| (c[0], c[1])).collect())
    }
}
