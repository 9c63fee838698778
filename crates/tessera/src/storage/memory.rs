use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock, RwLock};

use super::{check_name, ObjectWriter, Storage};
use crate::error::{Error, Result};

type Objects = Arc<Mutex<HashMap<String, Arc<RwLock<Vec<u8>>>>>>;

/// A checkpoint held in memory. `MemoryStorage::named` shares one namespace per name within
/// the process, so ranks on threads and later loads see the same checkpoint.
#[derive(Debug, Clone)]
pub struct MemoryStorage {
    name: String,
    objects: Objects,
}

impl Default for MemoryStorage {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryStorage {
    /// A fresh, private store.
    pub fn new() -> Self {
        MemoryStorage { name: "anonymous".into(), objects: Arc::default() }
    }

    /// The process-wide store called `name`.
    pub fn named(name: &str) -> Self {
        static REGISTRY: OnceLock<Mutex<HashMap<String, Objects>>> = OnceLock::new();
        let mut reg = REGISTRY.get_or_init(Default::default).lock().unwrap();
        let objects = reg.entry(name.to_string()).or_default().clone();
        MemoryStorage { name: name.to_string(), objects }
    }

    fn get(&self, name: &str) -> Result<Arc<RwLock<Vec<u8>>>> {
        check_name(name)?;
        self.objects
            .lock()
            .unwrap()
            .get(name)
            .cloned()
            .ok_or_else(|| Error::not_found(format!("mem://{}/{name}", self.name)))
    }
}

impl Storage for MemoryStorage {
    fn location(&self) -> String {
        format!("mem://{}", self.name)
    }

    fn size(&self, name: &str) -> Result<u64> {
        Ok(self.get(name)?.read().unwrap().len() as u64)
    }

    fn is_local(&self) -> bool {
        true
    }

    fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<()> {
        let obj = self.get(name)?;
        let data = obj.read().unwrap();
        let end = offset.checked_add(buf.len() as u64);
        match end {
            Some(end) if end <= data.len() as u64 => {
                buf.copy_from_slice(&data[offset as usize..end as usize]);
                Ok(())
            }
            _ => Err(Error::corrupt(
                format!("mem://{}/{name}", self.name),
                format!("truncated: {} bytes at offset {offset} are not all there", buf.len()),
            )),
        }
    }

    fn create(&self, name: &str, size: u64) -> Result<Box<dyn ObjectWriter>> {
        super::check_plain_name(name)?;
        let obj = Arc::new(RwLock::new(vec![0u8; size as usize]));
        self.objects.lock().unwrap().insert(name.to_string(), obj.clone());
        Ok(Box::new(MemoryWriter { obj }))
    }

    fn put_atomic(&self, name: &str, bytes: &[u8]) -> Result<()> {
        super::check_plain_name(name)?;
        let obj = Arc::new(RwLock::new(bytes.to_vec()));
        self.objects.lock().unwrap().insert(name.to_string(), obj);
        Ok(())
    }

    fn put_if_absent(&self, name: &str, bytes: &[u8]) -> Result<()> {
        super::check_plain_name(name)?;
        let mut objects = self.objects.lock().unwrap();
        if objects.contains_key(name) {
            return Err(Error::AlreadyExists { path: format!("mem://{}/{name}", self.name).into() });
        }
        objects.insert(name.to_string(), Arc::new(RwLock::new(bytes.to_vec())));
        Ok(())
    }

    fn has_atomic_create(&self) -> bool {
        true
    }

    fn list(&self) -> Result<Vec<String>> {
        Ok(self.objects.lock().unwrap().keys().filter(|k| !k.contains('/')).cloned().collect())
    }

    fn list_recursive(&self) -> Result<Vec<String>> {
        Ok(self.objects.lock().unwrap().keys().cloned().collect())
    }

    fn delete(&self, name: &str) -> Result<()> {
        super::check_plain_name(name)?;
        self.objects.lock().unwrap().remove(name);
        Ok(())
    }
}

struct MemoryWriter {
    obj: Arc<RwLock<Vec<u8>>>,
}

impl ObjectWriter for MemoryWriter {
    fn write_at(&self, offset: u64, data: &[u8]) -> Result<()> {
        let mut buf = self.obj.write().unwrap();
        let end = offset as usize + data.len();
        if buf.len() < end {
            buf.resize(end, 0);
        }
        buf[offset as usize..end].copy_from_slice(data);
        Ok(())
    }

    fn finish(self: Box<Self>) -> Result<()> {
        Ok(())
    }
}
