/*!
The test kit of the tessera workspace: the harnesses that more than one crate's tests use, in one
place instead of source files that other crates included by path attributes.

- [`server`]: a free loopback port, and a server process on it that dies with the test process;
- [`s3`], [`azure`], [`gcs`]: an S3 endpoint (moto), an Azure Blob endpoint (Azurite) and a GCS
  endpoint (fake-gcs-server behind the adapter that turns the XML API's writes into its JSON
  API), each started once per process unless the environment names a running one, with a fresh
  `tessera::storage::ObjectStorage` prefix for each test;
- [`files`]: copying fixtures, snapshotting directories;
- [`hostile`]: hostile checkpoints built byte by byte (pickles, zip archives, zstd bombs, DCP
  directories);
- [`cli`]: end-to-end runs of a command-line binary (`tessera`, `tessera-bench`), locally and
  against the S3 test server.

It is not published and not part of tessera's API: the workspace's crates take it as a
dev-dependency only, except `tessera-bench`, whose `--emulators` starts the same emulators
through it.
*/
#![deny(missing_docs)]

pub mod azure;
pub mod cli;
pub mod files;
pub mod gcs;
pub mod hostile;
pub mod s3;
pub mod server;
