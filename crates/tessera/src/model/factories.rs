//! Applying factories before save/load and their merges after load.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::model::{PathSeg, StatePath, StateTree, TensorFactory};

/// A factory applied at `path`, to be merged back after load.
pub(crate) struct AppliedFactory {
    pub path: StatePath,
    pub key: String,
    pub factory: Arc<dyn TensorFactory>,
}

/// Replaces every factory leaf by the sub-state it builds.
pub(crate) fn apply_factories(tree: StateTree<'_>) -> Result<(StateTree<'_>, Vec<AppliedFactory>)> {
    let mut applied = Vec::new();
    let tree = tree.map_leaves(&mut |path, leaf| match leaf {
        StateTree::Factory(f) => {
            let built = f.factory.build(&f.key, f.data, &f.replica_id)?;
            applied.push(AppliedFactory { path: path.to_vec(), key: f.key, factory: f.factory });
            Ok(built)
        }
        other => Ok(other),
    })?;
    Ok((tree, applied))
}

/// Merges loaded sub-states back, deepest paths first.
pub(crate) fn apply_merges<'a>(mut tree: StateTree<'a>, mut applied: Vec<AppliedFactory>) -> Result<StateTree<'a>> {
    applied.sort_by_key(|a| std::cmp::Reverse(a.path.len()));
    for a in applied {
        let sub = take_path(&mut tree, &a.path).unwrap_or_else(StateTree::map);
        let merged = a.factory.merge(&a.key, sub)?;
        tree.set_path(&a.path, merged);
    }
    Ok(tree)
}

fn take_path<'a>(tree: &mut StateTree<'a>, path: &[PathSeg]) -> Option<StateTree<'a>> {
    let (last, parents) = path.split_last()?;
    let mut node = tree;
    for seg in parents {
        node = match (node, seg) {
            (StateTree::Map(m), PathSeg::Key(k)) => m.get_mut(k)?,
            (StateTree::List(l), PathSeg::Index(i)) => l.get_mut(*i as usize)?,
            _ => return None,
        };
    }
    match (node, last) {
        (StateTree::Map(m), PathSeg::Key(k)) => m.remove(k),
        (StateTree::List(l), PathSeg::Index(i)) => {
            l.get_mut(*i as usize).map(|x| std::mem::replace(x, StateTree::map()))
        }
        _ => None,
    }
}

/// Removes the leaves at `paths` (map entries are removed; list items become empty maps).
pub(crate) fn remove_paths(tree: &mut StateTree<'_>, paths: &[StatePath]) {
    for p in paths {
        let _ = take_path(tree, p);
    }
}

/// [`apply_factories`] for a collective save: a failure does not return early but travels to
/// the other ranks in the plan exchange (so none waits for this one), and the rank goes on with
/// an empty tree.
pub(crate) fn apply_factories_collective(tree: StateTree<'_>) -> (StateTree<'_>, Option<Error>) {
    match apply_factories(tree) {
        Ok((t, _)) => (t, None),
        Err(e) => (StateTree::map(), Some(e)),
    }
}
