//! Dict and set keys deduplicated as Python does: hashed by what Python's equality compares
//! (`1 == 1.0 == True`, tuples item by item, objects by identity), compared in full only on
//! equal hashes, with a union-find so that each pair is compared once. A collection of a few
//! keys is searched key by key; past [`SMALL`] keys it gets a hash index (most dicts of a
//! pickle are the few fields of an object, and an index each would cost more than they hold).

use std::hash::{BuildHasher, Hash, Hasher};

use super::machine::{Id, KeyIndex, Keyed, Machine, Node, Slot, Text};
use crate::error::Result;

/// Deepest tuple nesting hashed as a dict key (deeper keys are not deduplicated).
const KEY_DEPTH: usize = 32;

/// Keys searched one by one; more get a hash index.
const SMALL: usize = 8;

/// "None" in [`KeyIndex::next`].
const NO_NEXT: u32 = u32::MAX;

/// A hashable key reduced to what Python's equality compares.
#[derive(Hash, PartialEq)]
enum Atom<'a> {
    None,
    Int(i64),
    Float(u64),
    Big(&'a [u8]),
    Str(&'a [u8]),
    Bytes(&'a [u8]),
    Global(&'a [u8], &'a [u8]),
}

impl Machine<'_> {
    /// The atom of a scalar node, `None` for containers and unhashable scalars (NaN).
    fn atom(&self, node: Node) -> Option<Atom<'_>> {
        let text = |len, at| self.text(Text { at, len });
        Some(match node {
            Node::None => Atom::None,
            Node::Bool(b) => Atom::Int(i64::from(b)),
            Node::Int(i) => Atom::Int(i),
            Node::Float(f) if f.is_nan() => return None,
            Node::Float(f) => {
                if f.fract() == 0.0 && (-9_223_372_036_854_775_808.0..9_223_372_036_854_775_808.0).contains(&f) {
                    Atom::Int(f as i64)
                } else {
                    Atom::Float(f.to_bits())
                }
            }
            Node::BigInt { len, at } => Atom::Big(text(len, at)),
            Node::Str { len, at } => Atom::Str(text(len, at)),
            Node::Bytes { len, at } => Atom::Bytes(text(len, at)),
            Node::Global(g) => {
                let (m, n) = *self.globals.get(g as usize)?;
                Atom::Global(self.text(m), self.text(n))
            }
            _ => return None,
        })
    }

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
    /// Tuples' hashes are cached; scalars are hashed again, which costs less than keeping them.
    fn key_hash(&mut self, id: Id, depth: usize) -> Option<u64> {
        let node = self.get(id)?;
        match node {
            Node::Tuple { len, at } if depth < KEY_DEPTH => {
                if let Some(h) = self.hash_cache.get(&id) {
                    return *h;
                }
                let items = self.pooled(at, len);
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
                let h = ok.then(|| s.finish());
                self.hash_cache.insert(id, h);
                h
            }
            Node::Tuple { .. } => None,
            // Hashable by identity.
            Node::Object(_) | Node::Persistent(_) | Node::Set(_) => Some(self.hasher.hash_one((8u8, id))),
            Node::List(_) | Node::Dict(_) => None,
            _ => self.atom(node).map(|a| self.hasher.hash_one(a)),
        }
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
        let eq = match (self.get(a), self.get(b)) {
            (Some(Node::Tuple { len: la, at: aa }), Some(Node::Tuple { len: lb, at: ab }))
                if depth < KEY_DEPTH && la == lb =>
            {
                let pairs: Vec<(Id, Id)> = self.pooled(aa, la).into_iter().zip(self.pooled(ab, lb)).collect();
                pairs.into_iter().all(|(p, q)| self.key_eq(p, q, depth + 1))
            }
            (Some(x), Some(y)) => match (self.atom(x), self.atom(y)) {
                (Some(p), Some(q)) => p == q,
                _ => false,
            },
            _ => false,
        };
        if eq {
            self.union(a, b);
        }
        eq
    }

    fn keyed(&self, target: Id, slot: Slot) -> Option<&Keyed> {
        match (self.get(target)?, slot) {
            (Node::Dict(k) | Node::Set(k), Slot::Main) => self.keyeds.get(k as usize),
            (Node::Object(o), Slot::ObjItems) => self.objects.get(o as usize)?.extra.as_ref().map(|e| &e.dict_items),
            _ => None,
        }
    }

    fn keyed_mut(&mut self, target: Id, slot: Slot) -> Option<&mut Keyed> {
        match (self.get(target)?, slot) {
            (Node::Dict(k) | Node::Set(k), Slot::Main) => self.keyeds.get_mut(k as usize),
            (Node::Object(o), Slot::ObjItems) => {
                Some(&mut self.objects.get_mut(o as usize)?.extra.get_or_insert_with(Box::default).dict_items)
            }
            _ => None,
        }
    }

    /// Positions of the keys of `target` that may equal a key of hash `h`: those of equal
    /// hash from the index, or every key of a small collection.
    fn candidates(&mut self, target: Id, slot: Slot, h: u64) -> Result<Vec<usize>> {
        let Some(keyed) = self.keyed(target, slot) else {
            // An object's dict items before the first: none to compare with.
            if matches!((self.get(target), slot), (Some(Node::Object(_)), Slot::ObjItems)) {
                return Ok(Vec::new());
            }
            return Err(self.err("internal: not a keyed node"));
        };
        if let Some(index) = &keyed.index {
            let mut out = Vec::new();
            let mut at = index.first.get(&h).copied().unwrap_or(NO_NEXT);
            while at != NO_NEXT {
                out.push(at as usize);
                at = index.next.get(at as usize).copied().unwrap_or(NO_NEXT);
            }
            // Chains are kept newest first: the first inserted key is found first.
            out.reverse();
            return Ok(out);
        }
        let keys: Vec<(usize, Id)> = keyed.keys().enumerate().collect();
        let mut out = Vec::new();
        for (i, k) in keys {
            if self.key_hash(k, 0) == Some(h) {
                out.push(i);
            }
        }
        Ok(out)
    }

    /// Inserts a key (and its value, for dicts) into a dict, set or object's dict items; an
    /// equal key keeps its place and takes the new value.
    pub(super) fn insert(&mut self, target: Id, slot: Slot, k: Id, v: Option<Id>) -> Result<()> {
        let h = self.key_hash(k, 0);
        let mut found = None;
        if let Some(h) = h {
            for i in self.candidates(target, slot, h)? {
                let Some(kk) = self.keyed(target, slot).map(|keyed| keyed.key(i)) else { continue };
                if self.key_eq(kk, k, 0) {
                    found = Some(i);
                    break;
                }
            }
        }
        // An index is built the first time a collection grows past SMALL keys: the hashes of
        // the keys it holds first.
        let needs_index = self.keyed(target, slot).is_some_and(|keyed| keyed.index.is_none() && keyed.len() >= SMALL);
        let hashes: Vec<Option<u64>> = if found.is_none() && needs_index {
            let keys: Vec<Id> = self.keyed(target, slot).map(|keyed| keyed.keys().collect()).unwrap_or_default();
            keys.into_iter().map(|key| self.key_hash(key, 0)).collect()
        } else {
            Vec::new()
        };
        let Some(keyed) = self.keyed_mut(target, slot) else {
            return Err(self.err("internal: not a keyed node"));
        };
        if let Some(i) = found {
            if let Some(v) = v.filter(|_| keyed.pairs) {
                keyed.items[2 * i + 1] = v;
            }
            return Ok(());
        }
        if needs_index {
            let mut index = KeyIndex::default();
            for (i, h) in hashes.into_iter().enumerate() {
                index_add(&mut index, i, h);
            }
            keyed.index = Some(Box::new(index));
        }
        let i = keyed.len();
        keyed.items.push(k);
        if keyed.pairs {
            keyed.items.push(v.unwrap_or(k));
        }
        if let Some(index) = &mut keyed.index {
            index_add(index, i, h);
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
        let id = self.new_keyed(true)?;
        self.insert_pairs(id, Slot::Main, pairs)?;
        Ok(id)
    }

    pub(super) fn new_set(&mut self, items: &[Id]) -> Result<Id> {
        let id = self.new_keyed(false)?;
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

/// Records position `i`, of hash `h` (unhashable keys are not indexed), in `index`.
fn index_add(index: &mut KeyIndex, i: usize, h: Option<u64>) {
    let prev = h.and_then(|h| index.first.insert(h, i as u32));
    index.next.push(prev.unwrap_or(NO_NEXT));
}
