//! A read-only in-memory checkpoint for the targets: `MemoryStorage` writes plain names only,
//! and foreign checkpoints have folders (zarr arrays, `model_and_optim/`, `rng_state/`).

use std::collections::BTreeMap;

use tessera::{Error, Result, Storage};
use tessera::storage::ObjectWriter;

/// Files by `/`-joined name, borrowed (fixtures, the fuzz input): nothing is copied per run.
#[derive(Debug, Default)]
pub struct Files<'a>(BTreeMap<String, &'a [u8]>);

impl<'a> Files<'a> {
    pub fn new(files: impl IntoIterator<Item = (&'a str, &'a [u8])>) -> Self {
        Files(files.into_iter().map(|(n, b)| (n.to_string(), b)).collect())
    }

    fn get(&self, name: &str) -> Result<&'a [u8]> {
        self.0.get(name).copied().ok_or_else(|| Error::not_found(format!("fuzz://{name}")))
    }
}

impl Storage for Files<'_> {
    fn location(&self) -> String {
        "fuzz://".into()
    }

    fn size(&self, name: &str) -> Result<u64> {
        Ok(self.get(name)?.len() as u64)
    }

    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        let data = self.get(name)?;
        match offset.checked_add(buf.len() as u64).filter(|&e| e <= data.len() as u64) {
            Some(end) => {
                buf.copy_from_slice(&data[offset as usize..end as usize]);
                Ok(())
            }
            None => Err(Error::Corrupt { path: format!("fuzz://{name}").into(), reason: "truncated".into() }),
        }
    }

    fn create(&self, name: &str, _size: u64) -> Result<Box<dyn ObjectWriter>> {
        Err(Error::InvalidArgument { reason: format!("{name}: read-only") })
    }

    fn put_atomic(&self, name: &str, _bytes: &[u8]) -> Result<()> {
        Err(Error::InvalidArgument { reason: format!("{name}: read-only") })
    }

    fn list(&self) -> Result<Vec<String>> {
        Ok(self.0.keys().filter(|k| !k.contains('/')).cloned().collect())
    }

    fn list_recursive(&self) -> Result<Vec<String>> {
        Ok(self.0.keys().cloned().collect())
    }

    fn delete(&self, name: &str) -> Result<()> {
        Err(Error::InvalidArgument { reason: format!("{name}: read-only") })
    }
}
