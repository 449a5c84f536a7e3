//! Replication groups and the policies that assign flows to them. CONTRACT (implemented by the
//! ha-engine helper): `Policy` (serde, JSON with "kind": "single" | "streams" | "chords" |
//! "remus"), `GroupSpec { id, name, backup: BackupTarget { name, socket }, hz }`,
//! `Policy::groups()`, `Policy::assign(&FlowKey) -> GroupId` (0 = default unprotected group),
//! `Policy::validate()`.
pub use crate::wire::GroupId;
