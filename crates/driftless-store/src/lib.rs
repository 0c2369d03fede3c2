#![doc = include_str!("../README.md")]
#![warn(missing_docs, unreachable_pub, rustdoc::broken_intra_doc_links)]

mod bucket;
mod error;
mod faulty;
pub mod http_bounds;
pub mod layout;
pub mod lockfile;
mod open;
mod options;
mod redact;
pub mod spool;
pub mod stream;

pub use bucket::{Bucket, ObjectInfo, MAX_LIST_BYTES, MAX_LIST_KEYS};
pub use error::{Error, Result, StoreError};
pub use faulty::{FaultKind, FaultOp, FaultyStore};
pub use object_store::{self, ObjectStore};
pub use open::HF_S3_ENDPOINT;
pub use options::{is_plain_http, StoreOptions};
