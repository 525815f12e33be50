//! Limits: API-key quotas and RPM / TPM / concurrency policies, decided per core and shared
//! through a sync backend.

pub mod ledger;
pub mod redis;
pub mod sync;
