//! Fuzzes the restricted unpickler: any input must give a value or an error — no panic, no
//! hang, no unbounded allocation — and a value must convert to plain values consistently.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tessera::{__fuzz::{unpickle, UnpickleLimits}};
use tessera::Value;

fuzz_target!(|data: &[u8]| {
    let limits = UnpickleLimits { max_depth: 64, max_values: 100_000, max_bytes: 1 << 20, ..UnpickleLimits::default() };
    let Ok(v) = unpickle(data, "fuzz", &limits) else { return };
    if let Some(plain) = v.to_plain() {
        // The plain value is at most as deep as the pickle's (≤ 64 < the codec's 128): it
        // must survive the value encoding.
        let bytes = plain.to_bytes();
        let back = Value::from_bytes(&bytes).expect("plain value round trip");
        assert_eq!(back.to_bytes(), bytes);
    }
    let lossy = v.to_value_lossy();
    // Objects add levels (a map, then "args"), so the lossy value may exceed the codec's
    // depth limit; when it decodes, it must decode to the same bytes.
    let bytes = lossy.to_bytes();
    if let Ok(back) = Value::from_bytes(&bytes) {
        assert_eq!(back.to_bytes(), bytes);
    }
});
