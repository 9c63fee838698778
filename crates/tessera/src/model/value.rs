//! Plain values for the common (non-sharded) state and content metadata.

/// A plain, self-describing value: what the common state, object metadata and
/// `content_metadata` may hold. Maps keep insertion order (as Python dicts do).
#[derive(Debug, Clone, PartialEq, Default)]
pub enum Value {
    /// Absent value (`None`).
    #[default]
    Null,
    /// Boolean.
    Bool(bool),
    /// Signed integer.
    Int(i64),
    /// Float.
    Float(f64),
    /// UTF-8 string.
    Str(String),
    /// Raw bytes.
    Bytes(Vec<u8>),
    /// Ordered list.
    List(Vec<Value>),
    /// String-keyed map in insertion order.
    Map(Vec<(String, Value)>),
}

impl Value {
    /// Looks up `key` in a map value.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Map(entries) => entries.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// Serializes with the safe tagged encoding of FORMAT.md ("value"): no code, only data.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut e = crate::model::codec::Encoder::default();
        e.value(self);
        e.buf
    }

    /// Parses what [`Value::to_bytes`] wrote; malformed or trailing bytes are an error.
    pub fn from_bytes(bytes: &[u8]) -> crate::error::Result<Value> {
        let mut d = crate::model::codec::Decoder::new(bytes);
        let v = d.value().map_err(|e| crate::error::Error::invalid(format!("malformed value encoding: {e}")))?;
        if !d.is_done() {
            return Err(crate::error::Error::invalid("malformed value encoding: trailing bytes"));
        }
        Ok(v)
    }

    /// A JSON rendering for humans and tools; bytes become `{"$bytes": "<hex>"}` and
    /// non-finite floats become strings.
    pub fn to_json(&self) -> serde_json::Value {
        use serde_json::Value as J;
        match self {
            Value::Null => J::Null,
            Value::Bool(b) => J::Bool(*b),
            Value::Int(i) => J::from(*i),
            Value::Float(f) => {
                serde_json::Number::from_f64(*f).map(J::Number).unwrap_or_else(|| J::String(f.to_string()))
            }
            Value::Str(s) => J::String(s.clone()),
            Value::Bytes(b) => {
                let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
                serde_json::json!({ "$bytes": hex })
            }
            Value::List(items) => J::Array(items.iter().map(Value::to_json).collect()),
            Value::Map(entries) => J::Object(entries.iter().map(|(k, v)| (k.clone(), v.to_json())).collect()),
        }
    }
}

macro_rules! value_from {
    ($($t:ty => $v:ident $(as $cast:ty)?),* $(,)?) => {$(
        impl From<$t> for Value {
            fn from(x: $t) -> Self { Value::$v(x $(as $cast)?) }
        }
    )*};
}
value_from!(bool => Bool, i64 => Int, i32 => Int as i64, u32 => Int as i64, f64 => Float, String => Str, Vec<u8> => Bytes);

impl From<&str> for Value {
    fn from(s: &str) -> Self {
        Value::Str(s.to_string())
    }
}

impl From<Vec<Value>> for Value {
    fn from(items: Vec<Value>) -> Self {
        Value::List(items)
    }
}
