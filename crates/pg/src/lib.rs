//! pliant-pg (being written).
