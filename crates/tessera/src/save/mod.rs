//! Save engines. The native engine still lives in `io/save.rs` (shared with async save and
//! convert) until the crate's re-cut moves it here; new engines start here.

pub(crate) mod olmo;
pub(crate) mod torch_dist;
